"""The page store's operations for copies between engines and host pages.

A copy of a device's pages to host (a backup) books host pages, which are *filling*
until its copy ends and :meth:`CopyOps.backup_copied` publishes them (or
:meth:`CopyOps.abort_backup` gives them back); a store an engine copies itself is the
same, its pages handed out by :meth:`CopyOps.begin_store` and published by
:meth:`CopyOps.commit_store`. A load claims its pinned pages (:meth:`CopyOps.claim`),
holds them for the copy and releases them when it ends (:meth:`CopyOps.release_load`);
an engine that copies from the shared host pages itself learns where they are
(:meth:`CopyOps.pinned_host_pages`). The copies themselves are
:class:`~hicache.controller.store.page_copies.PageCopies`' and the engine's; these
operations keep the index, the pool and the tiers right around them.
:class:`~hicache.controller.store.page_store.PageStore` implements them with this class.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hicache.controller.store.counters import Failure
from hicache.controller.store.engine_stores import HELD, NO_ROOM, Reservation
from hicache.controller.store.fills import QueuedBackup
from hicache.controller.store.miss_reasons import MissReason
from hicache.controller.store.page_entry import TAGS as _TAG
from hicache.controller.store.page_index import DiskState, HostState, PageEntry
from hicache.controller.store.store_state import StoreState
from hicache.controller_api import ControllerError, PageKey, PageRef
from hicache.types import Tier

if TYPE_CHECKING:
    from hicache.controller.tiers.lower_tier import DirectSink

# PageKey.storage_key() without building a PageKey is ``page_hash + _TAG[component]``:
# this runs once per page per call. Enum members are bound once for the same reason.
_READY, _FILLING = HostState.READY, HostState.FILLING
_DISK_NONE, _ON_DISK = DiskState.NONE, DiskState.READY
_FROM_DEVICE = Tier.DEVICE


class ClaimState(enum.Enum):
    """What :meth:`PageStore.claim` found for a load."""

    HELD = "held"  # every page is on host, held for the copy
    READING = "reading"  # every page is held; ``fills`` bring some of them to host first
    NOT_ON_HOST = "not_on_host"  # (inline) a page must first be read: nothing changed
    FAILED = "failed"  # the load fails at once (a page gone, the pin expired): counted


@dataclass(frozen=True)
class Claim:
    """The pages of a load (``entries``, in the order of its refs) and what they need."""

    state: ClaimState
    entries: list[PageEntry] = field(default_factory=list)
    fills: list[Future] = field(default_factory=list)
    # Those of ``entries`` read straight into the load's slots (held since the claim).
    direct: list[PageEntry] = field(default_factory=list)


@dataclass
class BackupPart:
    """Host pages booked for one part of a backup (:meth:`PageStore.book_backup`)."""

    plan: list[tuple[PageEntry, PageRef]]  # pages to copy into, each with its ref
    waits: list[Future]  # fills of pages another copy is bringing to host
    end: int  # the index of the first ref not looked at
    all_held: bool  # False when a page found no host page


class CopyOps(StoreState):
    """The copy operations of a page store (the store's state is its own)."""

    # -- loads ---------------------------------------------------------------------------

    def pinned_host_pages(self, pin_id: int, keys: Sequence[PageKey]) -> np.ndarray | None:
        """The host page of each of ``keys`` under the pin (-1: not ready on host, or not
        pinned), for an engine that copies from shared host pages; None when they are not
        shared."""
        if self._host is None or not self._host.shared:
            return None
        out = [-1] * len(keys)
        with self._lock:
            rec = self._pins.get(pin_id)
            if rec is not None:
                skeys, get = rec.skeys, self._index.get
                for i, k in enumerate(keys):
                    skey = k.page_hash + _TAG[k.component]
                    e = get(skey) if skey in skeys else None
                    if e is not None and e.host_state is _READY:
                        out[i] = e.host_page
        return np.array(out, dtype=np.int32)

    def pin_held(self, pin_id: int) -> bool:
        """Whether pin ``pin_id`` (any engine's) still holds its pages: pin ids are never
        reused, and a pin's pages stay put until it is released or expires."""
        with self._lock:
            return self._pins.get(pin_id) is not None

    def engine_disk_reads(self) -> dict | None:
        """Where an engine may read pages only on disk itself (the LMDB directory and the
        layout digest its values carry); None without a disk tier."""
        return None if self._disk is None else self._disk.engine_reads()

    def unpin(
        self,
        pin_id: int,
        engine_id: str,
        loaded_s: float | None = None,
        disk_s: float | None = None,
    ) -> None:
        """Release a pin; harmless when released already or expired. ``loaded_s``: the
        engine loaded the pinned pages itself (from shared host pages and, with
        ``disk_s``, the pages only on disk from LMDB in that long), in that long: they count
        as served. Raises ControllerError for another engine's pin."""
        with self._lock:
            rec = self._pins.get(pin_id)
            if rec is not None and rec.engine_id != engine_id:
                raise ControllerError(f"pin {pin_id} belongs to engine {rec.engine_id!r}")
            if rec is not None and (loaded_s is not None or disk_s is not None):
                mine = [e for e in rec.entries if e.skey not in rec.loaded]
                self._served_directly_locked(mine, loaded_s or 0.0, disk_s)
            self._pins.release(pin_id)

    def _served_directly_locked(
        self, entries: list[PageEntry], seconds: float, disk_s: float | None
    ) -> None:
        """An engine copied ``entries`` (pinned) into its slots itself, those on host from
        the shared host pages and, with ``disk_s``, those only on disk from LMDB: count
        the transfers and keep the pages as any page that served a load-back."""
        ready = [e for e in entries if e.host_state is _READY]
        read = [] if disk_s is None or self._disk is None else [
            e for e in entries if e.host_state is not _READY and e.disk_state is _ON_DISK
        ]  # fmt: skip
        self._index.served_all(ready + read)
        for tier in self._tiers:
            tier.on_served_locked(ready + read)
        page_bytes = self.host_page_bytes()
        if ready:
            nbytes = sum(page_bytes[e.component] for e in ready)
            self._counters.transfer("host_to_device", len(ready), nbytes, max(seconds, 0.0))
        if read:
            # The bytes of the pages this store knows were on disk only: the engine sends
            # none, so none can skew the read cost the cost rule weighs.
            nbytes = sum(page_bytes[e.component] for e in read)
            self._disk.read_by_engine_locked(read, nbytes, disk_s)
        # Not a load request (not ("load", "ok")); one load-back, counted once.
        self._counters.inc("load", "engine_read" if read else "engine_copied")

    def claim(
        self,
        refs: Sequence[PageRef],
        pin_id: int,
        engine_id: str,
        inline: bool,
        then: Callable[[list[PageEntry]], None] | None = None,
        direct: DirectSink | None = None,
    ) -> Claim:
        """Check a load of ``refs`` (checked against the engine already) under pin
        ``pin_id``, and hold its pages for the copy when all are on host (HELD). Otherwise
        start the reads that bring them there (READING; ``then`` is handed the pages of
        each read as it ends, see ``LowerTier.fill_locked``), or, ``inline``, change
        nothing (NOT_ON_HOST); pages ``direct`` takes are read straight into the load's
        slots instead, no host page between. FAILED (counted) when the load fails at once; raises
        ControllerError for one that can never succeed (a page outside the pin, another
        engine's pin)."""
        if refs and self._faults is not None:
            for what, host_only in (("evict_before_load", False), ("evict_host_before_load", True)):
                if self.fault(what):
                    with self._lock:
                        self._drop_locked(refs[-1].key, host_only)
        entries: list[PageEntry] = []
        with self._lock:
            self._expire_pins_locked()
            rec = self._pins.get(pin_id)
            if rec is None:
                self._counters.fail(Failure.PIN_EXPIRED)
                for comp in {r.component for r in refs}:
                    self.count_miss(MissReason.PIN_EXPIRED, Tier.HOST, comp, engine_id=engine_id)
                return Claim(ClaimState.FAILED)
            if rec.engine_id != engine_id:
                raise ControllerError(f"pin {pin_id} belongs to engine {rec.engine_id!r}")
            skeys, index = rec.skeys, self._index
            for ref in refs:
                skey = ref.page_hash + _TAG[ref.component]
                if skey not in skeys:
                    raise ControllerError(
                        f"{ref.component.name} page {ref.page_hash.hex()} is not in pin "
                        f"{pin_id}; pin every page before loading it"
                    )
                e = index.get(skey)
                if e is None or not e.held:
                    self._counters.fail(Failure.PAGE_ABSENT)
                    self._count_absent_locked(ref.key, engine_id)
                    return Claim(ClaimState.FAILED)
                entries.append(e)
            rec.loaded.update(e.skey for e in entries)
            ready = HostState.READY
            if all(e.host_state is ready for e in entries):
                # All on host already: hold them now, in the same section.
                for e in entries:
                    self._hold_locked(e)
                return Claim(ClaimState.HELD, entries)
            if inline:
                return Claim(ClaimState.NOT_ON_HOST)
            # Only once every page is known to be held: a doomed load reads nothing.
            cold: list[PageEntry] = []
            straight: list[PageEntry] = []
            none, takes = HostState.NONE, (direct.takes if direct is not None else None)
            for e in entries:
                if e.host_state is none:
                    (straight if takes is not None and takes(e) else cold).append(e)
            if len(cold) > 1:  # a page named twice is read once
                cold = list({id(e): e for e in cold}.values())
            if cold and not self._disk.fill_locked([e.key for e in cold], then):
                return Claim(ClaimState.FAILED)
            fills = list({id(e.fill): e.fill for e in entries if e.fill is not None}.values())
            if straight:
                for e in straight:  # self._hold_locked(e)
                    e.busy += 1
                    e.copies += 1
                fills += self._disk.read_direct_locked(straight, direct, rec.parted())
        return Claim(ClaimState.READING, entries, fills, straight)

    def reads_done(self, claim: Claim, deadline: float, engine_id: str) -> bool:
        """Wait (up to ``deadline``) for the reads of a READING claim and hold its pages for
        the copy; False when they timed out, one failed or a page is gone since (each
        counted, and why the load fell short recorded)."""
        filled = self.wait_fills(claim.fills, deadline)
        if filled is None:
            self._counters.fail(Failure.LOAD_TIMEOUT)
            self._let_go_direct(claim)
            self.load_fell_short(claim.entries, engine_id, timed_out=True)
            return False
        rest = claim.entries
        if len(claim.direct) == len(rest):  # every page read straight into its slot
            rest = ()
        elif claim.direct:
            straight = {id(e) for e in claim.direct}
            rest = [e for e in rest if id(e) not in straight]
        if not filled or not self.hold_for_copy(rest):
            # the read counted its failure; why the page is gone counts here
            self._let_go_direct(claim)
            self.load_fell_short(claim.entries, engine_id)
            return False
        return True

    def _let_go_direct(self, claim: Claim) -> None:
        """A load that fell short releases the pages it read straight into its slots (held
        since its claim); one that lost its copy on every tier meanwhile is forgotten."""
        with self._lock:
            for e in claim.direct:
                e.copies -= 1
                self._index.release(e)
                self._index.discard_if_unused(e)

    def hold_for_copy(self, entries: Sequence[PageEntry]) -> bool:
        """Hold ``entries`` for a copy to a device, once their reads ended; False (counted,
        nothing held) when one is no longer ready on host."""
        with self._lock:
            for e in entries:
                if not e.attached or e.host_state is not HostState.READY:
                    self._counters.fail(Failure.PAGE_ABSENT)
                    return False
            for e in entries:
                self._hold_locked(e)
        return True

    def release_load(self, entries: Sequence[PageEntry], served: bool) -> None:
        """A copy of held ``entries`` to a device has ended: release them; ``served``
        (every byte arrived) makes them most recently used, kept as pages that served."""
        with self._lock:
            if served:  # most recently used before the release makes them evictable
                self._index.served_all(entries)
                for tier in self._tiers:
                    tier.on_served_locked(entries)
            release = self._index.release
            for e in entries:
                e.copies -= 1
                release(e)

    def _hold_locked(self, e: PageEntry) -> None:
        self._index.acquire(e)
        e.copies += 1

    def book_backup(
        self,
        refs: Sequence[PageRef],
        start: int,
        max_bytes: int,
        seen: set[bytes],
        fill: Future,
        tenant: str | None = None,
    ) -> BackupPart:
        """Book host pages for ``refs[start:]`` until ``max_bytes`` are booked: a page
        held already is only touched (``waits`` for it while another copy fills it), a
        new one gets a host page, filling, that shares ``fill`` and is held until
        :meth:`backup_copied` publishes it or :meth:`abort_backup` gives it back. ``seen``
        collects the storage keys looked at (a page named twice is booked once). A new
        page is ``tenant``'s, booked within its host quota (controller/store/tenant_ops.py)."""
        plan: list[tuple[PageEntry, PageRef]] = []
        waits: list[Future] = []
        all_held = True
        page_bytes = self.host_page_bytes()
        planned = deduped = full = 0
        i, n = start, len(refs)
        with self._lock:
            tid = self._index.tenants.intern(tenant)
            get, touch, alloc = self._index.get, self._index.touch, self._alloc_host_locked
            begin_copy = self._begin_copy_locked
            while i < n and planned < max_bytes:
                ref = refs[i]
                i += 1
                skey = ref.page_hash + _TAG[ref.component]
                if skey in seen:
                    continue
                seen.add(skey)
                e = get(skey)
                if e is not None and e.held:
                    touch(e)
                    deduped += 1
                    if e.host_state is _FILLING and e.disk_state is _DISK_NONE:
                        # Held only once another copy into it succeeds: wait for it.
                        waits.append(e.fill)
                    continue
                if tid and not self._tenant_room_locked(tid, ref.component):
                    all_held = False
                    continue
                page = alloc(ref.component)
                if page is None:
                    full += 1
                    all_held = False
                    continue
                plan.append((begin_copy(e, ref, page, fill, tid), ref))
                planned += page_bytes[ref.component]
        if deduped:
            self._counters.add(deduped, "backup", "deduped_pages")
        if full:
            self._counters.fail(Failure.HOST_FULL, full)
        return BackupPart(plan, waits, i, all_held)

    def _begin_copy_locked(
        self, e: PageEntry | None, ref: PageRef, page: int, fill: Future, tenant: int
    ) -> PageEntry:
        """``ref``'s page (its entry ``e``, indexed now if None) gets host ``page``,
        filling under ``fill`` and held until published or aborted. The pages of one part,
        or one engine's store, are published or aborted at once, so they share ``fill``
        (one future per page cost more than the rest of a page's bookkeeping)."""
        index = self._index
        if e is None:
            e = index.create(ref.component, ref.page_hash, ref.parent_hash)
        if ref.engine_key is not None:
            e.engine_key = ref.engine_key
        if e.tenant != tenant:
            self._own_locked(e, tenant)
        index.set_host(e, page, ready=False)
        e.busy += 1  # index.acquire(e)
        e.fill = fill
        return e

    def abort_backup(self, plan: list[tuple[PageEntry, PageRef]], fill: Future) -> None:
        """The copy into the host pages of ``plan`` failed: give the pages back."""
        with self._lock:
            self._abort_locked(plan, fill)

    def _abort_locked(self, plan: list[tuple[PageEntry, PageRef]], fill: Future) -> None:
        for e, _ in plan:
            e.fill = None
            self._host[e.component].free(self._index.clear_host(e))
            self._index.release(e)
            self._index.discard_if_unused(e)
        fill.set_result(False)

    def backup_copied(self, backup: QueuedBackup) -> None:
        """The copies of a backup part are issued: published now when they are done (no
        events), else once its events complete (:meth:`reap_backups`)."""
        with self._lock:
            if backup.events:
                self._fills.queue_locked(backup)
            else:
                self._publish_locked(backup)

    def _publish_locked(self, backup: QueuedBackup) -> None:
        """A backup's bytes are on host: mark its pages ready, and tell the lower tiers."""
        backup.published = True
        backup.source = None  # the copy has ended: the engine's memory may go
        nbytes = 0
        index, tiers, page_bytes = self._index, self._tiers, self.host_page_bytes()
        entries = [e for e, _ in backup.plan]
        index.host_filled(entries)  # ready, and released
        stored: dict[int, int] = {}  # pages per tenant
        for e in entries:
            e.fill = None
            for tier in tiers:
                tier.on_host_ready_locked(e, _FROM_DEVICE)
            nbytes += page_bytes[e.component]
            if e.tenant:
                stored[e.tenant] = stored.get(e.tenant, 0) + 1
        for tid, n in stored.items():
            index.tenants.count(tid, "stored", "host", n)
        backup.fill.set_result(True)
        n = len(backup.plan)
        self._counters.add(n, "backup", "stored_pages")
        seconds = time.perf_counter() - backup.t0
        self._counters.transfer("device_to_host", n, nbytes, seconds)

    # -- stores an engine copies itself (store/engine_stores.py) -------------------------

    def begin_store(
        self, refs: Sequence[PageRef], engine_id: str, ttl_s: float, tenant: str | None = None
    ) -> tuple[int, list[int]]:
        """Hand ``engine_id`` a host page for each ref not held yet; returns the
        reservation's id and, per ref, its page, :data:`HELD` (on host or disk already:
        only touched) or :data:`NO_ROOM`. The pages are filling, invisible, and the
        engine's to write until :meth:`commit_store` or ``ttl_s`` seconds. A new page is
        ``tenant``'s, handed out within its host quota (a page that does not fit: NO_ROOM)."""
        if self._host is None:
            raise ControllerError("register a layout before storing")
        t0 = time.perf_counter()
        now = time.monotonic()
        pages: list[int] = []
        plan: list[tuple[PageEntry, PageRef]] = []
        fill: Future = Future()
        seen: set[bytes] = set()
        deduped = full = 0
        with self._lock:
            self._abort_reservations_locked(self._engine_stores.expired_locked(now))
            tid = self._index.tenants.intern(tenant)
            get, touch, alloc = self._index.get, self._index.touch, self._alloc_host_locked
            begin_copy = self._begin_copy_locked
            for ref in refs:
                skey = ref.page_hash + _TAG[ref.component]
                if skey in seen:
                    pages.append(HELD)
                    continue
                seen.add(skey)
                e = get(skey)
                if e is not None and e.held:
                    touch(e)
                    deduped += 1
                    pages.append(HELD)
                    continue
                if tid and not self._tenant_room_locked(tid, ref.component):
                    pages.append(NO_ROOM)
                    continue
                page = alloc(ref.component)
                if page is None:
                    full += 1
                    pages.append(NO_ROOM)
                    continue
                plan.append((begin_copy(e, ref, page, fill, tid), ref))
                pages.append(page)
            store_id = self._engine_stores.add_locked(engine_id, plan, fill, now + ttl_s, t0)
            if not plan:
                fill.set_result(True)
        if deduped:
            self._counters.add(deduped, "backup", "deduped_pages")
        if full:
            self._counters.fail(Failure.HOST_FULL, full)
        self._counters.add(len(plan), "engine_stores", "pages_handed")
        return store_id, pages

    def commit_store(self, store_id: int, engine_id: str, written: bool) -> int:
        """Publish the pages of reservation ``store_id`` (``written``) or give them back;
        the pages published. 0 for a reservation that is gone (expired, aborted with its
        engine, committed before); ControllerError for another engine's."""
        with self._lock:
            res = self._engine_stores.take_locked(store_id, engine_id)
            if res is None:
                self._counters.fail(Failure.STORE_EXPIRED)
                return 0
            if not written:
                self._abort_locked(res.plan, res.fill)
                self._counters.add(len(res.plan), "engine_stores", "pages_aborted")
                return 0
            if time.monotonic() > res.deadline:
                # Due back but not swept yet (expiry runs at the next begin): refused all
                # the same, so a slow engine never publishes pages past its lease on them.
                self._abort_locked(res.plan, res.fill)
                self._counters.fail(Failure.STORE_EXPIRED)
                return 0
            self._publish_locked(QueuedBackup(res.plan, [], res.t0, res.fill))
        self._counters.add(len(res.plan), "engine_stores", "pages_committed")
        return len(res.plan)

    def _abort_reservations_locked(self, reservations: list[Reservation]) -> None:
        n = 0
        for res in reservations:
            self._abort_locked(res.plan, res.fill)
            n += len(res.plan)
        if n:
            self._counters.add(n, "engine_stores", "pages_aborted")
