"""Counters of the controller, as plain numbers (the sidecar turns them into metrics).

Nothing here imports a metrics library: a counter is a key (a tuple of label values)
and a number, and :meth:`Counters.snapshot` nests them into a JSON/msgpack-safe dict,
e.g. ``{"evictions": {"host": {"full": 3}}, "transfer": {"disk_to_host": {"bytes": …}}}``.
"""

from __future__ import annotations

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


def component_label(component: ComponentType) -> str:
    return component.name.lower()


class Counters:
    """Monotonic counters keyed by label tuples; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter[tuple[str, ...]] = Counter()
        self._busy_until: dict[str, float] = {}  # per transfer direction

    def add(self, amount: float, *key: str) -> None:
        with self._lock:
            self._values[key] += amount

    def inc(self, *key: str) -> None:
        self.add(1, *key)

    def fail(self, reason: Failure, n: int = 1) -> None:
        self.add(n, "failures", reason.value)

    def transfer(self, direction: str, pages: int, nbytes: int, seconds: float) -> None:
        """Count a transfer that took the ``seconds`` up to now.

        Transfers of one direction overlap (the parts of a backup, several engines' loads,
        the reader threads): the seconds counted are those of the union of their
        intervals, so that bytes / seconds is the direction's throughput, not a fraction
        of it."""
        end = time.perf_counter()
        with self._lock:
            busy = self._busy_until.get(direction, 0.0)
            self._busy_until[direction] = max(busy, end)
            self._values[("transfer", direction, "pages")] += pages
            self._values[("transfer", direction, "bytes")] += nbytes
            self._values[("transfer", direction, "seconds")] += max(
                0.0, end - max(end - seconds, busy)
            )

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
