"""Stores an engine copies itself: host pages handed out for a store in flight, visible
only once the engine commits them.

The one copy of such a store is the engine's: it asks for host pages
(``PageStore.begin_store``), writes its own memory into them through its mapping of the
shared host pool, and commits (``PageStore.commit_store``). Until the commit the pages
are *filling*, exactly as a backup's pages are while the sidecar copies: no lookup finds
them, no eviction takes them, no other store or disk read is handed them. A reservation
that is not committed by its deadline, or whose engine goes (unregistered, its lease
lapsed, killed), is aborted: its pages go back to the free list and nothing of it was
ever visible. A page already held on host or disk is not handed out (it is only touched,
as a backup's duplicate is).

A commit names the reservation and its engine: an engine can publish only pages it was
handed, and only once. The bytes become a stored page's only at the commit; checksums are
computed where they always are, when the disk writer (or the remote tier) takes the page.

:class:`EngineStores` is the page store's table of the open reservations, kept under the
store's lock like its pins; the store books, publishes and aborts their pages.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass

from hicache.controller.store.page_index import HostState, PageEntry
from hicache.controller_api import ControllerError, PageRef

# What begin_store answers for a ref that gets no host page to write.
HELD = -1  # already on host or disk: nothing to write
NO_ROOM = -2  # no free host page: the page is not stored


@dataclass
class Reservation:
    """Host pages handed to one engine for one store, until committed or aborted."""

    engine_id: str
    plan: list[tuple[PageEntry, PageRef]]
    fill: Future
    deadline: float
    t0: float


class EngineStores:
    """The open reservations of one page store, by id (called with its lock held)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._open: dict[int, Reservation] = {}

    def add_locked(
        self,
        engine_id: str,
        plan: list[tuple[PageEntry, PageRef]],
        fill: Future,
        deadline: float,
        t0: float,
    ) -> int:
        """A new reservation's id; kept open only when it hands out pages (``plan``)."""
        store_id = next(self._ids)
        if plan:
            self._open[store_id] = Reservation(engine_id, plan, fill, deadline, t0)
        return store_id

    def take_locked(self, store_id: int, engine_id: str) -> Reservation | None:
        """Close reservation ``store_id`` of ``engine_id`` and return it; None when it is
        gone. ControllerError (and it stays open) when it is another engine's."""
        res = self._open.get(store_id)
        if res is None:
            return None
        if res.engine_id != engine_id:
            raise ControllerError(f"store {store_id} belongs to engine {res.engine_id!r}")
        del self._open[store_id]
        return res

    def expired_locked(self, now: float) -> list[Reservation]:
        """Close and return the reservations past their deadline."""
        return self._close([i for i, r in self._open.items() if r.deadline < now])

    def of_engine_locked(self, engine_id: str) -> list[Reservation]:
        """Close and return every reservation of ``engine_id`` (it went away)."""
        return self._close([i for i, r in self._open.items() if r.engine_id == engine_id])

    def _close(self, store_ids: list[int]) -> list[Reservation]:
        return [self._open.pop(i) for i in store_ids]

    def check_invariants_locked(self) -> None:
        """Every handed page is filling, under its reservation's fill, and held."""
        for res in self._open.values():
            for e, _ in res.plan:
                assert e.host_state is HostState.FILLING, f"{e}: handed to a store, not filling"
                assert e.fill is res.fill, f"{e}: handed to a store, filled by another"
