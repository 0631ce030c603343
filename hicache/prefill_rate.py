"""The engine's prefill rate, measured from its own prefills, for the cost rule.

The controller offers a page that only a lower tier holds only where loading it beats
computing it again (controller/store/cost_rule.py); for that it needs how many tokens
per second the engine prefills. An engine may report it (the sidecar client's
``prefill_tokens_per_s`` or ``prefill_rate``); where it does not, the integrations
measure it from the engine's own calls with a :class:`PrefillMeter` and hand it to the
controller as a *measured* rate, which a reported one always overrides:

* :meth:`PrefillMeter.observe` takes one prefill (or one engine step that prefilled):
  the tokens it computed and its wall time, and hands the new rate to the controller.
  Prefills of fewer than ``min_tokens`` tokens are ignored (their time is mostly fixed
  per-call cost, not per-token work).
* The rate is the median of the last ``window`` rates observed (the lower middle one of
  an even count): one prefill slowed down by something else (a page fault storm, a
  compile, a preemption) moves it not at all, and a lasting change of rate takes over
  once it is half the window.
* :class:`StepTimer` times engine steps that may overlap (a scheduler that plans step
  N+1 while step N runs): a step's time runs from when it was planned or the previous
  step ended, whichever is later, to when its output came back.

No clock is read here but ``clock`` (tests pass their own).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_MIN_TOKENS", "PrefillMeter", "StepTimer", "report_measured_rate"]

DEFAULT_MIN_TOKENS = 256  # shorter prefills are mostly fixed cost
DEFAULT_WINDOW = 9  # prefills whose median is the rate


class PrefillMeter:
    """A smoothed prefill rate from observed prefills (see the module docstring)."""

    def __init__(
        self,
        controller: Any = None,
        min_tokens: int = DEFAULT_MIN_TOKENS,
        window: int = DEFAULT_WINDOW,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``controller``: where each new rate goes (:func:`report_measured_rate`)."""
        if min_tokens < 1 or window < 1:
            raise ValueError(f"min_tokens and window must be >= 1, got {min_tokens}, {window}")
        self.controller = controller
        self.min_tokens = min_tokens
        self.clock = clock
        self._rates: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.observed = 0  # prefills taken
        self.ignored = 0  # prefills too short (or timed as nothing) to count

    def observe(self, tokens: int, seconds: float) -> float | None:
        """One prefill of ``tokens`` tokens took ``seconds``; returns the rate now (tokens
        per second) when this one was taken, None when it was ignored."""
        if tokens < self.min_tokens or not (seconds > 0 and math.isfinite(seconds)):
            self.ignored += 1
            return None
        with self._lock:
            self._rates.append(tokens / seconds)
            self.observed += 1
            rate = statistics.median_low(self._rates)
        if self.controller is not None:
            report_measured_rate(self.controller, rate)
        return rate

    @property
    def rate(self) -> float | None:
        """Tokens per second (the median of the recent prefills); None: none observed."""
        with self._lock:
            return statistics.median_low(self._rates) if self._rates else None


class StepTimer:
    """Engine steps timed from their planning to their output, overlap taken out (see
    the module docstring); each step's prefill goes to ``meter``."""

    def __init__(self, meter: PrefillMeter) -> None:
        self.meter = meter
        # Bounded: a step whose output never comes back is forgotten after a while.
        self._planned: deque[tuple[float, int, int]] = deque(maxlen=16)
        self._last_end: float | None = None

    def planned(self, tokens: int, prefill_tokens: int) -> None:
        """A step was planned computing ``tokens`` tokens in all, ``prefill_tokens`` of
        them prompt tokens (a step of decodes only is not a prefill)."""
        self._planned.append((self.meter.clock(), tokens, prefill_tokens))

    def finished(self) -> float | None:
        """The oldest planned step's output came back: the rate when it counted."""
        if not self._planned:
            return None
        now = self.meter.clock()
        start, tokens, prefill = self._planned.popleft()
        if self._last_end is not None:
            start = max(start, self._last_end)
        self._last_end = now
        if prefill < self.meter.min_tokens:
            self.meter.ignored += 1
            return None
        return self.meter.observe(tokens, now - start)

    def reset(self) -> None:
        """Forget planned steps (the engine dropped them)."""
        self._planned.clear()
        self._last_end = None


def report_measured_rate(controller: Any, tokens_per_s: float | None) -> bool:
    """Hand a measured rate to ``controller`` (any CacheController that takes one:
    ``report_prefill_rate(rate, measured=True)``); a rate the engine reported itself
    stays in force. False when the controller takes none."""
    report = getattr(controller, "report_prefill_rate", None)
    if report is None or tokens_per_s is None:
        return False
    report(tokens_per_s, measured=True)
    return True
