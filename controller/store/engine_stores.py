"""Stores an engine copies itself: host pages handed out for a store in flight, visible
only once the engine commits them.

The one copy of such a store is the engine's: it asks for host pages (:meth:`begin`),
writes its own memory into them through its mapping of the shared host pool, and commits
(:meth:`commit`). Until the commit the pages are *filling*, exactly as a backup's pages
are while the sidecar copies: no lookup finds them, no eviction takes them, no other
store or disk read is handed them. A reservation that is not committed by its deadline,
or whose engine goes (unregistered, its lease lapsed, killed), is aborted: its pages go
back to the free list and nothing of it was ever visible. A page already held on host or
disk is not handed out (it is only touched, as a backup's duplicate is).

A commit names the reservation and its engine: an engine can publish only pages it was
handed, and only once. The bytes become a stored page's only at the commit; checksums are
computed where they always are, when the disk writer (or the remote tier) takes the page.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from hicache.controller.store.counters import Counters, Failure
from hicache.controller.store.fills import FillTracker, QueuedBackup
from hicache.controller.store.page_index import HostState, PageEntry
from hicache.controller.store.page_store import PageStore
from hicache.controller_api import ControllerError, PageRef
from hicache.types import ComponentType

_TAG = {c: bytes((int(c),)) for c in ComponentType}

# What begin() answers for a ref that gets no host page to write.
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
    """The reservations of one store; every method but :meth:`begin`'s bookkeeping runs
    under the store's lock, which the caller takes through these methods."""

    def __init__(self, store: PageStore, fills: FillTracker, counters: Counters) -> None:
        self._store = store
        self._fills = fills
        self._counters = counters
        self._ids = itertools.count(1)
        self._open: dict[int, Reservation] = {}

    def begin(self, refs: Sequence[PageRef], engine_id: str, ttl_s: float) -> tuple[int, list[int]]:
        """Hand ``engine_id`` a host page for each ref not held yet; returns the
        reservation's id and, per ref, its page, :data:`HELD` or :data:`NO_ROOM`. The
        pages are the engine's to write until :meth:`commit` or ``ttl_s`` seconds."""
        t0 = time.perf_counter()
        now = time.monotonic()
        pages: list[int] = []
        plan: list[tuple[PageEntry, PageRef]] = []
        fill: Future = Future()
        seen: set[bytes] = set()
        store = self._store
        with store.lock:
            self._expire_locked(now)
            for ref in refs:
                skey = ref.page_hash + _TAG[ref.component]
                e = store.index.get(skey)
                if skey in seen or (e is not None and e.held):
                    if e is not None and skey not in seen:
                        store.index.touch(e)
                        self._counters.inc("backup", "deduped_pages")
                    seen.add(skey)
                    pages.append(HELD)
                    continue
                seen.add(skey)
                page = store.alloc_host_locked(ref.component)
                if page is None:
                    self._counters.fail(Failure.HOST_FULL)
                    pages.append(NO_ROOM)
                    continue
                if e is None:
                    e = store.index.create(ref.component, ref.page_hash, ref.parent_hash)
                self._fills.begin_locked(e, page, fill)
                plan.append((e, ref))
                pages.append(page)
            store_id = next(self._ids)
            if plan:
                self._open[store_id] = Reservation(engine_id, plan, fill, now + ttl_s, t0)
            else:
                fill.set_result(True)
        self._counters.add(len(plan), "engine_stores", "pages_handed")
        return store_id, pages

    def commit(self, store_id: int, engine_id: str, written: bool) -> int:
        """Publish the pages of reservation ``store_id`` (``written``) or give them back;
        the pages published. 0 for a reservation that is gone (expired, aborted with its
        engine, committed before); ControllerError for another engine's."""
        with self._store.lock:
            res = self._open.get(store_id)
            if res is None:
                self._counters.fail(Failure.STORE_EXPIRED)
                return 0
            if res.engine_id != engine_id:
                raise ControllerError(f"store {store_id} belongs to engine {res.engine_id!r}")
            del self._open[store_id]
            if not written:
                self._fills.abort_locked(res.plan, res.fill)
                self._counters.add(len(res.plan), "engine_stores", "pages_aborted")
                return 0
            if time.monotonic() > res.deadline:
                # Its pages may have been handed out again by an expiry in another call:
                # never here (expiry removes the reservation first), but a late commit
                # is refused all the same, so a slow engine cannot publish stale bytes.
                self._fills.abort_locked(res.plan, res.fill)
                self._counters.fail(Failure.STORE_EXPIRED)
                return 0
            self._fills.publish_locked(QueuedBackup(res.plan, [], res.t0, res.fill))
        self._counters.add(len(res.plan), "engine_stores", "pages_committed")
        return len(res.plan)

    def abort_engine_locked(self, engine_id: str) -> int:
        """Give back every page handed to ``engine_id`` (it went away); the pages."""
        gone = [i for i, r in self._open.items() if r.engine_id == engine_id]
        return self._abort_locked(gone)

    def _expire_locked(self, now: float) -> None:
        self._abort_locked([i for i, r in self._open.items() if r.deadline < now])

    def _abort_locked(self, store_ids: list[int]) -> int:
        n = 0
        for i in store_ids:
            res = self._open.pop(i)
            self._fills.abort_locked(res.plan, res.fill)
            n += len(res.plan)
        if n:
            self._counters.add(n, "engine_stores", "pages_aborted")
        return n

    def expire(self) -> None:
        """Abort the reservations past their deadline."""
        with self._store.lock:
            self._expire_locked(time.monotonic())

    def check_invariants_locked(self) -> None:
        """Every handed page is filling, under its reservation's fill, and held."""
        for res in self._open.values():
            for e, _ in res.plan:
                assert e.host_state is HostState.FILLING, f"{e}: handed to a store, not filling"
                assert e.fill is res.fill, f"{e}: handed to a store, filled by another"
