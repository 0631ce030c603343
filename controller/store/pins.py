"""Pins: pages held against eviction for a load, until unpinned or their deadline passes.

A pin is owned by an engine, so that an engine that goes away (the sidecar notices a
missed heartbeat) loses its pins at once. Expired pins drop at the next controller call:
the deadlines sit in a min-heap, so expiry costs O(log n) per pin.

Called with the controller's lock held.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from hicache.controller.store.page_entry import DiskState, HostState
from hicache.controller.store.page_index import PageEntry, PageIndex


@dataclass
class PinRecord:
    pin_id: int
    engine_id: str
    entries: list[PageEntry]
    skeys: frozenset[bytes]
    deadline: float
    # The pages a load through the store under this pin claimed: an engine that read the
    # others itself (a load parted between them) books only those at its unpin.
    loaded: set[bytes] = field(default_factory=set)

    def parted(self) -> bool:
        """Whether the loads claimed only part of this pin's pages, some of the others on
        disk only: the sidecar's part of a load parted with the engine, which reads the
        rest at the same time on a core of its own (``inflight.split_load``); the sidecar
        then reads its part on one thread: its readers beside each other and the engine
        would only take turns at the cores and at the interpreter's lock."""
        loaded, none, ready = self.loaded, HostState.NONE, DiskState.READY
        return any(
            e.skey not in loaded and e.host_state is none and e.disk_state is ready
            for e in self.entries
        )


class PinTable:
    """Active pins by id, with an expiry heap."""

    def __init__(self, index: PageIndex) -> None:
        self._index = index
        self._pins: dict[int, PinRecord] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, engine_id: str, entries: list[PageEntry], deadline: float) -> PinRecord:
        """Pin every entry (an entry listed twice is pinned twice) until ``deadline``."""
        rec = PinRecord(
            next(self._ids), engine_id, entries, frozenset(e.skey for e in entries), deadline
        )
        self._index.pin_all(entries)
        self._pins[rec.pin_id] = rec
        heapq.heappush(self._deadlines, (deadline, rec.pin_id))
        if len(self._deadlines) > 2 * len(self._pins) + 1024:
            self._deadlines = [(r.deadline, r.pin_id) for r in self._pins.values()]
            heapq.heapify(self._deadlines)
        return rec

    def extend(self, rec: PinRecord, entries: list[PageEntry]) -> None:
        """Pin ``entries`` too, under the same pin (a large pin is made in chunks)."""
        self._index.pin_all(entries)
        rec.entries += entries
        rec.skeys = rec.skeys | {e.skey for e in entries}

    def records(self) -> list[PinRecord]:
        """Every active pin (for admin listings)."""
        return list(self._pins.values())

    def get(self, pin_id: int) -> PinRecord | None:
        """The active pin ``pin_id``; None once released or expired."""
        return self._pins.get(pin_id)

    def release(self, pin_id: int) -> bool:
        """Unpin; False when ``pin_id`` was not active (released twice, or expired)."""
        rec = self._pins.pop(pin_id, None)
        if rec is None:
            return False
        self._index.unpin_all(rec.entries)
        return True

    def expire(self, now: float) -> int:
        """Release every pin whose deadline is at or before ``now``; returns how many."""
        n = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, pin_id = heapq.heappop(self._deadlines)
            rec = self._pins.get(pin_id)
            if rec is not None and rec.deadline == deadline:
                self.release(pin_id)
                n += 1
        return n

    def release_engine(self, engine_id: str) -> int:
        """Release every pin held by ``engine_id``; returns how many."""
        ids = [p for p, rec in self._pins.items() if rec.engine_id == engine_id]
        for p in ids:
            self.release(p)
        return len(ids)

    def check_invariants(self) -> None:
        """Each indexed entry's pin count equals the number of active pins on it."""
        want: dict[int, int] = {}
        for rec in self._pins.values():
            for e in rec.entries:
                want[id(e)] = want.get(id(e), 0) + 1
        for e in self._index:
            assert e.pins == want.get(id(e), 0), f"{e}: pins {e.pins} != {want.get(id(e), 0)}"
