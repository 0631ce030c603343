"""Counters of the controller, as plain numbers (the sidecar turns them into metrics).

Nothing here imports a metrics library: a counter is a key (a tuple of label values)
and a number, and :meth:`Counters.snapshot` nests them into a JSON/msgpack-safe dict,
e.g. ``{"evictions": {"host": {"full": 3}}, "transfer": {"disk_to_host": {"bytes": …}}}``.
"""

from __future__ import annotations

import bisect
import enum
import threading
import time
from collections import Counter
from typing import Any

from hicache.types import ComponentType


class Failure(enum.Enum):
    """Why an operation did not do what was asked (a label of ``failures``)."""

    PAGE_ABSENT = "page_absent"  # load: a page was no longer held
    PIN_ABSENT = "pin_absent"  # pin: a page was not held (a miss, not an error)
    PIN_EXPIRED = "pin_expired"  # load with a pin that had expired or was released
    PIN_FAULT = "pin_fault"  # pin raised (injected)
    HOST_FULL = "host_full"  # no host page free, nothing evictable
    LOAD_TIMEOUT = "load_timeout"  # disk reads did not finish within the load's timeout
    COPY_ERROR = "copy_error"  # a device ↔ host copy raised
    CHECKSUM = "checksum"  # a stored value failed its checksum or header checks
    LAYOUT_MISMATCH = "layout_mismatch"  # a stored value of another layout was read
    DISK_MISSING = "disk_missing"  # the index said disk, LMDB had no value
    DISK_READ_ERROR = "disk_read_error"  # LMDB raised on a read
    DISK_FULL = "disk_full"  # a page did not fit the LMDB map / budget and was rejected
    DISK_WRITE_ERROR = "disk_write_error"  # LMDB raised on a write
    STORE_EXPIRED = "store_expired"  # an engine's store committed after its deadline, or gone
    TENANT_QUOTA = "tenant_quota"  # a page did not fit its tenant's quota: not stored there


def component_label(component: ComponentType) -> str:
    return component.name.lower()


# Busy periods of one direction kept to merge later reports into. A transfer reported
# after many others that it overlaps (a slow disk read among short ones on the other
# reader threads) is counted exactly while what it overlaps is among these; time before
# the oldest kept period counts as busy already, so the total never exceeds wall time.
_BUSY_PERIODS_KEPT = 1024


class BusyTime:
    """Seconds covered by the union of the intervals added (one transfer direction).

    Keeps the union as sorted, disjoint periods (at most ``max_periods``; the oldest are
    forgotten first). Not thread-safe: :class:`Counters` calls it under its lock."""

    def __init__(self, max_periods: int = _BUSY_PERIODS_KEPT) -> None:
        self._max_periods = max_periods
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._floor = float("-inf")  # end of the newest forgotten period

    def add(self, start: float, end: float) -> float:
        """Add ``[start, end]``; returns the seconds of it not covered before."""
        start = max(start, self._floor)
        if end <= start:
            return 0.0
        # Periods [lo, hi) touch the interval: they end at or after its start and begin
        # at or before its end.
        lo = bisect.bisect_left(self._ends, start)
        hi = bisect.bisect_right(self._starts, end)
        covered = sum(
            min(e, end) - max(s, start)
            for s, e in zip(self._starts[lo:hi], self._ends[lo:hi], strict=True)
        )
        if lo < hi:
            self._starts[lo:hi] = [min(start, self._starts[lo])]
            self._ends[lo:hi] = [max(end, self._ends[hi - 1])]
        else:
            self._starts.insert(lo, start)
            self._ends.insert(lo, end)
        if len(self._starts) > self._max_periods:
            self._floor = self._ends[0]
            del self._starts[0], self._ends[0]
        # Never below 0 through rounding: a counter that goes down reads as a restart.
        return max(0.0, (end - start) - covered)


class Counters:
    """Monotonic counters keyed by label tuples; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter[tuple[str, ...]] = Counter()
        self._busy: dict[str, BusyTime] = {}  # per transfer direction

    def add(self, amount: float, *key: str) -> None:
        with self._lock:
            self._values[key] += amount

    def inc(self, *key: str) -> None:
        with self._lock:
            self._values[key] += 1

    def fail(self, reason: Failure, n: int = 1) -> None:
        self.add(n, "failures", reason.value)

    def transfer(self, direction: str, pages: int, nbytes: int, seconds: float) -> None:
        """Count a transfer that took the ``seconds`` up to now.

        Transfers of one direction overlap (the parts of a backup, several engines' loads,
        the reader threads), and one may be reported after shorter ones that began later:
        the seconds counted are those of the union of their intervals, so that
        bytes / seconds is the direction's throughput, not a multiple or a fraction of it."""
        end = time.perf_counter()
        with self._lock:
            busy = self._busy.get(direction)
            if busy is None:
                busy = self._busy[direction] = BusyTime()
            self._values[("transfer", direction, "pages")] += pages
            self._values[("transfer", direction, "bytes")] += nbytes
            self._values[("transfer", direction, "seconds")] += busy.add(end - seconds, end)

    def get(self, *key: str) -> float:
        with self._lock:
            return self._values.get(key, 0)

    def snapshot(self) -> dict[str, Any]:
        """Every counter, nested by its key parts; every failure reason present (0 if none)."""
        out: dict[str, Any] = {"failures": {f.value: 0 for f in Failure}}
        with self._lock:
            items = list(self._values.items())
        for key, value in items:
            node = out
            for part in key[:-1]:
                node = node.setdefault(part, {})
            node[key[-1]] = value
        return out
