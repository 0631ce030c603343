"""The remote tier's health: a circuit breaker over store calls, and presence hints.

The breaker opens after ``failures`` consecutive calls that failed on every key (the
cluster is gone) and lets one trial call through per cooldown; a call with some key
answered closes it. Presence hints remember which pages a store held lately, bounded in
number and each believed for a while only: the page index never records the remote tier.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict


class BreakerState(enum.IntEnum):
    CLOSED = 0  # calls go to the store
    OPEN = 1  # calls answer at once as failed, until the cooldown ends
    HALF_OPEN = 2  # one trial call is in flight


class CircuitBreaker:
    """Opens after ``failures`` consecutive all-failed calls; one trial per cooldown."""

    def __init__(self, failures: int, cooldown_s: float) -> None:
        self._threshold = failures
        self._cooldown_s = cooldown_s
        self._lock = threading.Lock()
        self.state = BreakerState.CLOSED
        self._failed = 0
        self._open_until = 0.0
        self.opened = 0  # times it opened

    def allow(self) -> bool:
        """Whether a call may go to the store now (taking the trial when one is due)."""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return True
            if self.state is BreakerState.OPEN and time.monotonic() >= self._open_until:
                self.state = BreakerState.HALF_OPEN
                return True
            return False

    def record(self, answered: bool | None) -> None:
        """A call ended: some key answered (True), every key failed (False), or it asked
        nothing conclusive (None: only hinted-failing nodes)."""
        with self._lock:
            if answered:
                self.state = BreakerState.CLOSED
                self._failed = 0
                return
            if answered is False:
                self._failed += 1
            if self.state is BreakerState.HALF_OPEN or (
                answered is False and self._failed >= self._threshold
            ):
                if self.state is not BreakerState.OPEN:
                    self.opened += 1
                self.state = BreakerState.OPEN
                self._open_until = time.monotonic() + self._cooldown_s


class PresenceHints:
    """Page storage keys seen present in the store: bounded, each believed ``ttl_s``.

    The value is the page's chain parent when the lookup knew it (None: a first page)."""

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self._max = max_entries
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._hints: OrderedDict[bytes, tuple[float, bytes | None]] = OrderedDict()

    def add(self, skey: bytes, parent: bytes | None) -> None:
        with self._lock:
            self._hints[skey] = (time.monotonic() + self._ttl_s, parent)
            self._hints.move_to_end(skey)
            while len(self._hints) > self._max:
                self._hints.popitem(last=False)

    def get(self, skey: bytes) -> tuple[bool, bytes | None]:
        """(hinted, parent) for ``skey``; an expired hint is forgotten."""
        with self._lock:
            hint = self._hints.get(skey)
            if hint is None:
                return False, None
            if time.monotonic() >= hint[0]:
                del self._hints[skey]
                return False, None
            return True, hint[1]

    def discard(self, skey: bytes) -> None:
        with self._lock:
            self._hints.pop(skey, None)

    def __len__(self) -> int:
        return len(self._hints)
