"""Never slower than recompute: a lookup offers a lower tier's pages only where loading
them beats computing them again.

* :class:`ReadCost` keeps what a tier's reads cost, measured on its own calls: its
  latency (a moving average of the round trips that carry no payload: the remote tier's
  existence probes; the disk tier has none, its fixed cost per read is in the next
  figure), the seconds per byte of one reader (a moving average over read batches, the
  latency taken out) and how many readers run at once. The disk tier feeds it every read
  batch, the remote tier every fill batch and every probe.
* :class:`CostRule` holds each engine's prefill rate (tokens per second: reported by the
  engine with its lookups, or measured from its own prefills by its integration and
  sent the same way; hicache/prefill_rate.py) and cuts a looked-up chain where the run
  of pages that only a lower tier holds would take longer to load than the engine takes
  to compute those tokens. The cut pages are reported absent (the engine recomputes
  them) and counted as ``slower_than_recompute`` misses of that tier. No rate, or no
  read of that tier measured yet: nothing is cut. ``cost_rule = false`` turns it off.
* **Kept up to date.** A tier whose pages are cut is no longer read, so its figures
  would never change: when the last read of a tier is older than ``cost_rule_recheck_s``
  the rule lets one lookup's run through (offered, and measured again if it is loaded),
  then cuts again until the next interval ends.

Loading a run costs ``latency + bytes × seconds_per_byte / readers`` where the tier cuts
a load into one batch per reader (the disk tier); where it reads batches of a fixed
number of pages (the remote tier, ``remote_read_batch_pages`` on ``remote_io_threads``),
a latency per round of batches and the bytes over the readers that have a batch.
Computing the run costs ``tokens / rate``. Both grow with the run and loading's fixed
costs spread over it, so the rule keeps or cuts each run after the host pages whole
(what follows a cut run is unusable anyway: a hit is a prefix).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from hicache.controller.store.miss_reasons import MissReason
from hicache.controller_api import P_ABSENT, P_DISK, P_HOST, P_REMOTE
from hicache.types import ComponentType, Tier

__all__ = ["CostRule", "ReadCost"]

_SMOOTHING = 0.25  # weight of the newest observation in the moving averages
_TIER_OF = {P_DISK: Tier.DISK, P_REMOTE: Tier.REMOTE}
_LOCAL = (P_ABSENT, P_HOST)  # presences that no lower tier reads


class ReadCost:
    """What reading from one tier costs, measured (see the module docstring)."""

    def __init__(
        self,
        readers: int,
        batch_pages: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``batch_pages``: the tier reads a load in batches of that many pages, one per
        reader at a time (None: it cuts every load into one batch per reader)."""
        self.readers = max(1, readers)
        self.batch_pages = batch_pages
        self.seconds_per_byte: float | None = None  # one reader's; None: nothing read yet
        self.latency_s = 0.0  # a round trip without payload; 0 until one is measured
        self.round_trips = 0  # measured
        self.clock = clock
        self.read_at: float | None = None  # when the last read batch was measured
        self._rechecked_at: float | None = None
        self._lock = threading.Lock()

    def observe(self, nbytes: int, seconds: float) -> None:
        """One reader read ``nbytes`` in ``seconds`` (a batch, checks included)."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            s = max(seconds - self.latency_s, 0.0) / nbytes
            old = self.seconds_per_byte
            self.seconds_per_byte = s if old is None else old + _SMOOTHING * (s - old)
            self.read_at = self.clock()

    def observe_round_trip(self, seconds: float) -> None:
        """A call that moved no payload took ``seconds``: the tier's latency."""
        if seconds <= 0:
            return
        with self._lock:
            if self.round_trips == 0:
                self.latency_s = seconds
            else:
                self.latency_s += _SMOOTHING * (seconds - self.latency_s)
            self.round_trips += 1

    def seconds(self, nbytes: int, pages: int = 1) -> float | None:
        """How long reading ``nbytes`` in ``pages`` pages takes, its batches on the
        readers (a round trip per round of batches); None: unknown."""
        s = self.seconds_per_byte
        if s is None:
            return None
        if self.batch_pages is None:
            return self.latency_s + nbytes * s / self.readers
        batches = -(-max(1, pages) // self.batch_pages)
        rounds = -(-batches // self.readers)
        return rounds * self.latency_s + nbytes * s / min(batches, self.readers)

    def recheck_due(self, interval_s: float) -> bool:
        """Whether a run this rule would cut is to be let through, to be measured again:
        the last read (or recheck) is ``interval_s`` old. Taken: the next one is due an
        interval later. Never with ``interval_s`` 0."""
        if interval_s <= 0:
            return False
        now = self.clock()
        with self._lock:
            times = [t for t in (self.read_at, self._rechecked_at) if t is not None]
            if times and now - max(times) < interval_s:
                return False
            self._rechecked_at = now
            return True

    def stats(self) -> dict[str, float | None]:
        s = self.seconds_per_byte
        return {
            "read_bytes_per_s": None if not s else round(self.readers / s),
            "read_latency_ms": round(self.latency_s * 1e3, 3),
        }


class CostRule:
    """Cuts looked-up chains where recomputing is faster (see the module docstring)."""

    def __init__(self, enabled: bool, recheck_s: float = 0.0) -> None:
        self.enabled = enabled
        self.recheck_s = recheck_s
        self._rates: dict[str, float] = {}  # reported by the engine
        self._measured: dict[str, float] = {}  # measured by its integration

    def report_rate(
        self, engine_id: str, tokens_per_s: float | None, measured: bool = False
    ) -> None:
        """``engine_id`` prefills this many tokens per second (None: forget it); a
        ``measured`` rate counts only while the engine reports none."""
        rates = self._measured if measured else self._rates
        if tokens_per_s is None or not tokens_per_s > 0:
            rates.pop(engine_id, None)
        else:
            rates[engine_id] = float(tokens_per_s)

    def rate(self, engine_id: str) -> float | None:
        """The rate the rule uses for ``engine_id``: reported, else measured."""
        rate = self._rates.get(engine_id)
        return rate if rate is not None else self._measured.get(engine_id)

    def forget(self, engine_id: str) -> None:
        self._rates.pop(engine_id, None)
        self._measured.pop(engine_id, None)

    def stats(self) -> dict[str, Any]:
        """Whether it is on, and each engine's rate (tokens per second)."""
        engines = sorted({*self._rates, *self._measured})
        rates = {e: round(r) for e in engines if (r := self.rate(e)) is not None}
        return {"enabled": self.enabled, "prefill_tokens_per_s": rates}

    def apply(
        self,
        engine_id: str,
        rows: dict[ComponentType, list[int]],
        page_tokens: int,
        store: Any,
    ) -> None:
        """Cut ``rows`` (presence per component, one entry per page) where the engine
        would wait longer for a lower tier than it would compute. ``store``: the page
        store, asked ``host_page_bytes``, ``read_cost`` of a tier and ``count_miss``
        (the pages cut, per tier and component, to the engine)."""
        rate = self.rate(engine_id)
        if not self.enabled or rate is None or not rows:
            return
        page_bytes = store.host_page_bytes()
        n = min(len(r) for r in rows.values())
        # The hit ends where FULL (the backbone) does; another component may lack a page
        # inside it (SWA outside its window, Mamba states between checkpoints).
        full = rows.get(ComponentType.FULL)
        i = 0
        while i < n:
            lower = self._lower(rows, full, i)
            if lower is None:
                return  # the engine's hit ends here anyway
            if not lower:
                i += 1  # on host
                continue
            # A run of pages some component of which only one lower tier holds.
            tier = lower[0]
            start, nbytes, items = i, 0, 0
            while i < n and (lower := self._lower(rows, full, i)) and lower[0] is tier:
                below = [c for c, r in rows.items() if r[i] not in _LOCAL]
                nbytes += sum(page_bytes.get(c, 0) for c in below)
                items += len(below)
                i += 1
            measured = store.read_cost(tier)
            load_s = None if measured is None else measured.seconds(nbytes, items)
            if load_s is not None and load_s > (i - start) * page_tokens / rate:
                if measured.recheck_due(self.recheck_s):
                    continue  # offered this once: a load measures the tier again
                self._cut(rows, start, n, tier, store, engine_id)
                return

    @staticmethod
    def _lower(
        rows: dict[ComponentType, list[int]], full: list[int] | None, i: int
    ) -> list[Tier] | None:
        """The lower tiers page ``i`` is read from (empty: all on host); None where the
        hit ends (FULL absent, or any component when FULL is not asked)."""
        backbone = [full[i]] if full is not None else [r[i] for r in rows.values()]
        if P_ABSENT in backbone:
            return None
        return [_TIER_OF[r[i]] for r in rows.values() if r[i] not in _LOCAL]

    @staticmethod
    def _cut(
        rows: dict[ComponentType, list[int]],
        start: int,
        n: int,
        tier: Tier,
        store: Any,
        engine_id: str,
    ) -> None:
        """Report every page from ``start`` on absent; count those a tier held."""
        for comp, row in rows.items():
            held = sum(1 for p in row[start:n] if p != P_ABSENT)
            row[start:n] = [P_ABSENT] * (n - start)
            if held:
                reason = MissReason.SLOWER_THAN_RECOMPUTE
                store.count_miss(reason, tier, comp, held, engine_id=engine_id)
