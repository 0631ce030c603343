"""The page store's operations for the tiers behind its host pool.

A lower tier (:mod:`hicache.controller.tiers`) never reaches into the page index or the
host pool: it reserves host pages for its reads and settles them, copies host pages out,
and (the LMDB tier, whose pages the index records) queues and settles writes and gives
up stored pages, all through these operations — the
:class:`~hicache.controller.tiers.lower_tier.TierHost` protocol, which
:class:`~hicache.controller.store.page_store.PageStore` implements with this class.
Those named ``*_locked`` run inside a call from the store (its lock held); the others
take the lock.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.controller.store.counters import Failure, component_label
from hicache.controller.store.miss_reasons import MissReason
from hicache.controller.store.page_codec import ReadStatus
from hicache.controller.store.page_index import DiskState, HostState, PageEntry
from hicache.controller.store.store_state import StoreState
from hicache.controller_api import ControllerError, PageKey
from hicache.keys import HASH_BYTES
from hicache.types import ComponentType, Tier

if TYPE_CHECKING:
    from hicache.controller.store.page_entry import DiskRecordLike
    from hicache.controller.tiers.lower_tier import FillResult

log = logging.getLogger("hicache.controller.store.page_store")

# The parent of a chain's first page is the chain's seed, which a lookup does not see: a
# page filled before its parent is known is indexed under this until its value tells.
UNKNOWN_PARENT = bytes(HASH_BYTES)
# A read that failed: why the page is missing (from the tier it was read from). A value
# that failed its checks is gone; a tier not indexed here (remote) that no longer held it
# evicted it, and one that did not answer in time (or failed) missed the read's deadline.
_INVALID_REASON = {ReadStatus.CORRUPT: MissReason.CHECKSUM, ReadStatus.FOREIGN: MissReason.LAYOUT}
_UNINDEXED_REASON = {
    **_INVALID_REASON,
    ReadStatus.MISSING: MissReason.EVICTED,
    ReadStatus.ERROR: MissReason.DEADLINE,
}


class TierHostOps(StoreState):
    """The lower tiers' operations of a page store (the store's state is its own)."""

    # -- reads into host -----------------------------------------------------------------

    def holds_locked(self, key: PageKey) -> bool:
        """Whether a tier of the index (host, or the indexed lower tier) holds ``key``."""
        e = self._index.get(key.storage_key())
        return e is not None and e.held

    def begin_fill_locked(self, key: PageKey, parent_hash: bytes | None) -> PageEntry | None:
        """Reserve a host page for ``key`` and mark it filling, held until
        :meth:`finish_fills`; indexed first if it is not (under ``parent_hash``, or
        provisionally when None). None when no host page is free, or the page's tenant
        has no room within its host quota."""
        owner = self._index.get(key.storage_key())
        tenant = 0 if owner is None else owner.tenant
        if tenant and not self._tenant_room_locked(tenant, key.component):
            return None
        page = self._alloc_host_locked(key.component)
        if page is None:
            return None
        e = self._index.get(key.storage_key())  # the evictions above may have dropped it
        if e is None:
            e = self._index.create(key.component, key.page_hash, parent_hash or UNKNOWN_PARENT)
        self._index.set_host(e, page, ready=False)
        self._index.acquire(e)
        return e

    def prewarm_fill(self, keys: Sequence[PageKey]) -> tuple[list[Future], int, int, bool]:
        """Start reading those of ``keys`` held only by the indexed tier into free host
        pages, evicting nothing: the futures of those reads, the pages and bytes started,
        and False once a component had no free host page left."""
        with self._lock:
            cold: list[PageKey] = []
            free = {c: p.free_pages for c, p in self._host.components.items()}
            room, nbytes = True, 0
            for k in keys:
                e = self._index.get(k.storage_key())
                if e is None or e.disk_state is not DiskState.READY:
                    continue
                if e.host_state is not HostState.NONE:
                    continue
                if free.get(k.component, 0) <= 0:
                    room = False
                    continue
                free[k.component] -= 1
                cold.append(k)
                nbytes += e.disk_nbytes
            if cold:
                self._disk.fill_locked(cold)
            fills = {id(f): f for f in (self._index.get(k.storage_key()).fill for k in cold)}
        return [f for f in fills.values() if f is not None], len(cold), nbytes, room

    def fill_started_locked(self, pages: Sequence[PageEntry], fill: Future) -> None:
        """``fill`` resolves when the reads into ``pages`` end (True: all filled)."""
        for e in pages:
            e.fill = fill

    def host_row(self, page: PageEntry) -> np.ndarray:
        """The bytes of the host page that ``page`` holds or is filling (uint8)."""
        return self._host[page.component].row(page.host_page)

    def finish_fills(self, results: Sequence[FillResult], source: Tier) -> int:
        """Settle reads from ``source``: a page read well is ready on host (and the other
        tiers hear of it); another gives its host page back and, read from the indexed
        tier, loses the copy found invalid there (deleted unless already missing).
        Returns the bytes filled."""
        nbytes = 0
        indexed = self._disk is not None and source is self._disk.tier
        with self._lock:
            for r in results:
                e = r.page
                e.fill = None
                if r.status is ReadStatus.OK:
                    if r.parent is not None:
                        self._index.set_parent(e, r.parent)
                    self._index.mark_host_ready(e)
                    self._index.release(e)
                    for tier in self._tiers:
                        if tier.tier is not source:
                            tier.on_host_ready_locked(e, source)
                    nbytes += self._host[e.component].page_bytes
                    continue
                self._host[e.component].free(self._index.clear_host(e))
                self._index.release(e)
                why = (_INVALID_REASON if indexed else _UNINDEXED_REASON).get(r.status)
                if why is not None:
                    self._departed_locked(e, why, source)
                if indexed and r.status is not ReadStatus.ERROR:
                    self._forget_invalid_locked(e, r.status)
                self._index.discard_if_unused(e)
        return nbytes

    def finish_direct_reads(self, results: Sequence[FillResult]) -> None:
        """Settle reads from the indexed tier that went straight into a load: a page whose
        value failed its checks (or was gone) is forgotten there, as on a fill. The pages
        stay held by their load, which releases them."""
        with self._lock:
            for r in results:
                if r.status is ReadStatus.OK or r.status is ReadStatus.ERROR:
                    continue
                why = _INVALID_REASON.get(r.status)
                if why is not None:
                    self._departed_locked(r.page, why, Tier.DISK)
                self._forget_invalid_locked(r.page, r.status)

    def _forget_invalid_locked(self, e: PageEntry, status: ReadStatus) -> None:
        """The indexed tier's copy of ``e`` was invalid or gone: it is never served again."""
        if e.disk_state is not DiskState.READY:
            return
        self._index.clear_disk(e)
        if status is not ReadStatus.MISSING:  # deleted, unless LMDB lost it already
            # While closing the delete is refused; the next open checks the value again.
            with contextlib.suppress(ControllerError):
                self._disk.delete_locked([e.skey])
        log.warning("disk page %s dropped: %s", e.skey.hex(), status.value)

    def tier_changed(self, tier: Tier, pages: Sequence[PageEntry], removed: bool) -> None:
        """Tell the store's listener (``listen``) that ``pages`` were stored on (or
        ``removed`` from) ``tier``, a lower tier that the index does not record."""
        events = self._index.events
        if events is not None and pages:
            with self._lock:
                if removed:
                    events.removed(tier, pages)
                else:
                    events.stored(tier, pages)

    def copy_host_pages(
        self, pages: Sequence[PageEntry], copy: Callable[[PageEntry, np.ndarray], Any]
    ) -> list[Any]:
        """``copy(page, host_row)`` for each page still ready on host (the lock held for
        all of them), None for the others."""
        out: list[Any] = []
        with self._lock:
            for e in pages:
                if not e.attached or e.host_state is not HostState.READY:
                    out.append(None)
                else:
                    out.append(copy(e, self._host[e.component].row(e.host_page)))
        return out

    # -- the indexed tier's writes and residency -----------------------------------------

    def begin_write_locked(self, page: PageEntry, keep_copy: bool) -> Any:
        """Mark ``page`` (ready on host) queued to the indexed tier, held until
        :meth:`finish_writes`; its frame (header room, then the payload): the host page's
        own, or with ``keep_copy`` a copy that also serves reads until the write commits
        (the host page is about to go). None when it is stored or queued already, or its
        tenant has no room within its disk quota."""
        if page.disk_state is not DiskState.NONE:
            return None
        if page.tenant and not self._fits_disk_quota_locked(page):
            return None
        frame = self._host[page.component].frame(page.host_page)
        if keep_copy:
            frame = bytearray(frame)
            page.pending_payload = frame
        self._index.set_disk(page, DiskState.PENDING)
        self._index.acquire(page)
        return frame

    def finish_writes(self, results: Sequence[tuple[PageEntry, int | Failure]]) -> None:
        """Settle writes to the indexed tier: ``(page, bytes stored)``, or ``(page, why it
        was not stored)`` (counted)."""
        with self._lock:
            tenants = set()
            for e, stored in results:
                if isinstance(stored, Failure):
                    self._departed_locked(e, MissReason.WRITE_FAILED, Tier.DISK)
                    self._index.clear_disk(e)
                    self._counters.fail(stored)
                else:
                    self._index.set_disk(e, DiskState.READY, stored)
                    if e.tenant:
                        tenants.add(e.tenant)
                        self._index.tenants.count(e.tenant, "stored", "disk")
                e.pending_payload = None
                self._index.release(e)
                self._index.discard_if_unused(e)
            for tenant in tenants:  # over its quota: its oldest committed pages go
                self._settle_disk_quota_locked(tenant)

    def unwritten_host_pages_locked(self) -> list[PageEntry]:
        """Pages ready on host that the indexed tier neither stores nor has queued."""
        return [
            e
            for e in self._index
            if e.host_state is HostState.READY and e.disk_state is DiskState.NONE
        ]

    def restore_stored(self, records: Iterable[DiskRecordLike]) -> None:
        """Index the pages the indexed tier found at start (oldest first), into an empty
        index."""
        with self._lock:
            self._index.restore_disk(records)
            self._index.tenants.restored = len(self._index) > 0

    def stored_bytes(self) -> int:
        """Bytes the index says the indexed tier holds committed."""
        return self._index.disk_live_bytes

    def evict_stored(self, nbytes: int) -> list[bytes]:
        """Forget at least ``nbytes`` of the indexed tier's least recently used pages
        (chains cut from the tail, SWA/Mamba pages with their FULL page); their keys, for
        the tier to delete."""
        keys: list[bytes] = []
        freed = 0
        with self._lock:
            self._expire_pins_locked()
            while freed < nbytes:
                victim = self._index.pop_victim(Tier.DISK)
                if victim is None:
                    break
                group = self._disk_group(victim)
                freed += sum(e.disk_nbytes for e in group)
                keys += [e.skey for e in group]
                self._evict_disk_locked(victim, delete=False)
        return keys

    def _disk_group(self, entry: PageEntry) -> list[PageEntry]:
        """``entry`` and, for FULL, its SWA/Mamba pages on disk: what leaves with it."""
        if entry.component is ComponentType.FULL:
            return [*self._index.aux_in(entry, Tier.DISK), entry]
        return [entry]

    def _evict_disk_locked(self, entry: PageEntry, delete: bool) -> int:
        """Forget ``entry``'s disk copy (and, for FULL, its SWA/Mamba pages'), deleting the
        values with ``delete`` (else the caller does); the pages forgotten."""
        group = self._disk_group(entry)
        for e in group:
            self._departed_locked(e, MissReason.EVICTED, Tier.DISK)
            self._index.clear_disk(e)
            self._counters.inc("evictions", "disk", component_label(e.component))
            if e.tenant:
                self._index.tenants.count(e.tenant, "evicted", "disk")
            self._index.discard_if_unused(e)
        if delete:
            self._disk.delete_locked([e.skey for e in group])
        return len(group)

    def forget_stored(
        self, skeys: Sequence[bytes], still_bad: Callable[[list[bytes]], list[bytes]]
    ) -> list[bytes]:
        """Forget and delete the indexed tier's values of ``skeys`` that ``still_bad``
        (asked under the lock) confirms and no operation holds: each counted as a
        checksum failure. Returns the keys deleted."""
        deletes: list[bytes] = []
        with self._lock:
            for skey in still_bad(list(skeys)):
                e = self._index.get(skey)
                if e is not None:
                    if e.busy or e.disk_state is not DiskState.READY:
                        continue
                    self._departed_locked(e, MissReason.CHECKSUM, Tier.DISK)
                    self._index.clear_disk(e)
                    self._index.discard_if_unused(e)
                self._counters.fail(Failure.CHECKSUM)
                deletes.append(skey)
            self._disk.delete_locked(deletes)
        return deletes
