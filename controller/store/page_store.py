"""``PageStore``: the host and disk tiers of one layout and the moves between them.

It owns the page index, the pins, the host pool and the LMDB tier, and one lock over
all of them. It answers: where can this page's bytes be found, which page leaves a full
tier, and how does a page get from host to disk and back. It knows nothing of engines
or device memory (that is :class:`hicache.controller.store.local.LocalController`).

Methods whose name ends in ``_locked`` expect ``store.lock`` held by the caller; the
others take it themselves. The writer thread calls :meth:`evict_disk` and
:meth:`on_written`; reader threads run :meth:`read_job`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from hicache.controller.config import ControllerConfig, DiskWritePolicy
from hicache.controller.store.counters import Counters, Failure, component_label
from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.host_pool import HostPool
from hicache.controller.store.page_codec import HEADER_BYTES
from hicache.controller.store.page_index import DiskState, HostState, PageEntry, PageIndex
from hicache.controller.store.pins import PinRecord, PinTable
from hicache.controller.tiers.lmdb_tier import LmdbTier, ReadStatus, WriteJob, WriteResult
from hicache.controller_api import ControllerError, PageKey
from hicache.layout import ModelLayout
from hicache.types import ComponentType, Tier

log = logging.getLogger(__name__)

_PIN_CHUNK_KEYS = 1024  # keys pinned per hold of the lock (about a millisecond)

_READ_FAILURES = {
    ReadStatus.CORRUPT: Failure.CHECKSUM,
    ReadStatus.FOREIGN: Failure.LAYOUT_MISMATCH,
    ReadStatus.MISSING: Failure.DISK_MISSING,
    ReadStatus.ERROR: Failure.DISK_READ_ERROR,
}


@contextlib.contextmanager
def _gc_paused():
    """No automatic garbage collection inside: for the index rebuild at start, which makes
    millions of long-lived, acyclic objects. Every collection the growing heap would
    trigger scans all of them, and that doubled the rebuild's time (200 k pages: 9 s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class RemoteHooks(Protocol):
    """What the local tiers ask of a tier behind them (the remote tier,
    :class:`hicache.controller.tiers.remote_tier.RemoteTier`), under the store's lock unless
    said otherwise: the place where a tier beyond disk plugs in."""

    def hinted(self, key: PageKey) -> bool: ...
    def fill_locked(self, keys: list[PageKey]) -> bool: ...
    def on_host_evict_locked(self, e: PageEntry) -> None: ...
    def on_served_locked(self, e: PageEntry) -> None: ...
    def probe(self, page_hashes: Sequence[bytes], rows: dict[ComponentType, list[int]]) -> None:
        """Fill in absent pages of ``rows`` that the tier holds (without the lock)."""

    def flush(self, timeout_s: float | None) -> bool: ...
    def stats(self) -> dict[str, Any]: ...
    def health(self, timeout_s: float) -> dict[str, Any]: ...
    def close(self, timeout_s: float) -> Any: ...


class PageStore:
    """Index, pins, host pool and LMDB tier of one layout, under one lock."""

    def __init__(self, config: ControllerConfig, counters: Counters) -> None:
        self.config = config
        self.counters = counters
        self.faults: FaultPlan | None = None
        self.lock = threading.RLock()
        self.index = PageIndex(config.host_hit_retention_turnovers)
        self.pins = PinTable(self.index)
        self.host: HostPool | None = None
        self.disk: LmdbTier | None = None
        self.remote: RemoteHooks | None = None  # set by the controller when configured

    def fault(self, what: str) -> bool:
        return self.faults is not None and self.faults.take(what)

    # -- opening -------------------------------------------------------------------------

    def open_locked(self, layout: ModelLayout, page_size: int, fingerprint: bytes) -> None:
        """Allocate the host pool and open LMDB, rebuilding the index from what it holds."""
        host = HostPool(layout, page_size, self.config)
        if self.config.disk_enabled:
            tier = LmdbTier(
                self.config,
                fingerprint,
                {c: layout.page_bytes(c, page_size) for c in layout.components},
                live_bytes=lambda: self.index.disk_live_bytes,
                evict=self.evict_disk,
                on_written=self.on_written,
            )
            with _gc_paused():
                try:
                    records = tier.scan()
                except BaseException:
                    tier.close()
                    raise
                # oldest first, so the LRU order survives the restart
                self.index.restore_disk(records)
            self.disk = tier
            over = self.index.disk_live_bytes - self.config.disk_budget_bytes
            if over > 0:  # the budget shrank since the last run
                tier.submit_delete(self.evict_disk(over))
            tier.fault_hook = self.fault
            tier.start()
            log.info("LMDB tier %s: %d pages found", self.config.disk_path, len(records))
        self.host = host

    # -- holds and pins (lock held) ------------------------------------------------------

    def hold_locked(self, e: PageEntry) -> None:
        """Hold ``e`` for a device copy."""
        self.index.acquire(e)
        e.copies += 1

    def unhold_locked(self, e: PageEntry) -> None:
        e.copies -= 1
        self.index.release(e)

    def pin_keys(
        self, keys: Sequence[PageKey], engine_id: str, ttl_s: float
    ) -> PinRecord | Failure:
        """Pin every page of ``keys`` (held on host or disk) for ``ttl_s``, in chunks of
        ``_PIN_CHUNK_KEYS`` with the lock released in between: what is pinned stays put
        meanwhile, and the other engines' lookups need not wait for a pin of many
        thousand keys. The failure (nothing pinned) when a page is absent, or when the
        pin expired while it was being made."""
        rec = None
        for start in range(0, max(len(keys), 1), _PIN_CHUNK_KEYS):
            if start:
                time.sleep(0)  # let a thread waiting for the lock (or the GIL) take it
            with self.lock:
                if rec is None:
                    self.expire_pins_locked()
                elif self.pins.get(rec.pin_id) is not rec:
                    return Failure.PIN_EXPIRED
                entries = []
                missing: list[PageKey] | None = []  # hinted remotely: read below
                for k in keys[start : start + _PIN_CHUNK_KEYS]:
                    e = self.index.get(k.storage_key())
                    if e is not None and e.held:
                        entries.append(e)
                    elif self.remote is not None and self.remote.hinted(k):
                        missing.append(k)
                    else:  # absent: fail at once, a pin of many keys must not scan on
                        missing = None
                        break
                if missing is None or (missing and not self.remote.fill_locked(missing)):
                    if rec is not None:
                        self.pins.release(rec.pin_id)
                    return Failure.PIN_ABSENT
                entries += [self.index.get(k.storage_key()) for k in missing]
                if rec is None:
                    rec = self.pins.add(engine_id, entries, time.monotonic() + ttl_s)
                else:
                    self.pins.extend(rec, entries)
                for e in entries:
                    self.index.touch(e)
        return rec

    def tiers_locked(self, key: PageKey) -> frozenset[Tier]:
        """HOST once ``key``'s host copy is ready, DISK once it is committed to LMDB."""
        e = self.index.get(key.storage_key())
        tiers = set()
        if e is not None and e.host_state is HostState.READY:
            tiers.add(Tier.HOST)
        if e is not None and e.disk_state is DiskState.READY:
            tiers.add(Tier.DISK)
        return frozenset(tiers)

    def expire_pins_locked(self) -> None:
        n = self.pins.expire(time.monotonic())
        if n:
            self.counters.add(n, "pins", "expired")

    # -- host residency (lock held) ------------------------------------------------------

    def alloc_host_locked(self, component: ComponentType) -> int | None:
        """A free host page of ``component``, evicting LRU pages as needed; None if stuck."""
        pool = self.host[component]
        page = pool.alloc()
        if page is None:
            self.expire_pins_locked()  # a lapsed pin must not keep its pages from eviction
        while page is None:
            victim = self.index.pop_victim(Tier.HOST, component)
            if victim is None:
                return None
            self.evict_host_locked(victim)
            page = pool.alloc()
        return page

    def evict_host_locked(self, entry: PageEntry) -> None:
        """Drop ``entry``'s host page (and, for FULL, its SWA/Mamba pages on host)."""
        group = [entry]
        if entry.component is ComponentType.FULL:
            group = [*self.index.aux_in(entry, Tier.HOST), entry]
        for e in group:
            if (
                self.disk is not None
                and self.config.disk_write_policy is DiskWritePolicy.WRITE_BACK
                and e.disk_state is DiskState.NONE
            ):
                # Copied out before the page is reused; served from this copy until committed.
                frame = bytearray(self.host[e.component].frame(e.host_page))
                self._queue_write_locked(e, frame)
                e.pending_payload = frame
            if self.remote is not None:
                self.remote.on_host_evict_locked(e)
            self.host[e.component].free(self.index.clear_host(e))
            self.counters.inc("evictions", "host", component_label(e.component))
            self.index.discard_if_unused(e)

    def _queue_write_locked(self, e: PageEntry, frame: Any) -> None:
        """Queue ``frame`` (header room + payload) for the writer; it holds ``e``."""
        self.index.set_disk(e, DiskState.PENDING)
        self.index.acquire(e)
        job = WriteJob(e.skey, e.component, e.parent_hash, frame, token=e, framed=True)
        self.disk.submit_write(job)

    def write_through_locked(self, e: PageEntry) -> None:
        """Queue a page that just reached host to the writer, if the policy says so."""
        if (
            self.disk is not None
            and self.config.disk_write_policy is DiskWritePolicy.WRITE_THROUGH
            and e.disk_state is DiskState.NONE
        ):
            # Zero-copy: the writer stores the host page's frame, which the hold keeps.
            self._queue_write_locked(e, self.host[e.component].frame(e.host_page))

    def write_back_all_locked(self) -> int:
        """Queue every page held only on host to the writer (write-back, at close)."""
        if self.disk is None or self.config.disk_write_policy is not DiskWritePolicy.WRITE_BACK:
            return 0
        n = 0
        for e in self.index:
            if e.host_state is HostState.READY and e.disk_state is DiskState.NONE:
                self._queue_write_locked(e, self.host[e.component].frame(e.host_page))
                n += 1
        return n

    def drop_locked(self, key: PageKey, host_only: bool = False) -> None:
        """Take a page out of every tier (or only host) now, pinned or not; a page in
        flight is kept.

        Only fault injection uses it: it stands for a pin that lapsed and an eviction.
        """
        e = self.index.get(key.storage_key())
        if e is None or e.busy:
            return
        if e.host_state is not HostState.NONE:
            self.host[e.component].free(self.index.clear_host(e))
        if not host_only and e.disk_state is DiskState.READY:
            self.index.clear_disk(e)
            self.disk.submit_delete([e.skey])
        self.index.discard_if_unused(e)

    # -- disk residency (writer thread) --------------------------------------------------

    def evict_disk(self, nbytes: int) -> list[bytes]:
        """Drop at least ``nbytes`` of LRU disk pages from the index; their keys to delete."""
        keys: list[bytes] = []
        freed = 0
        with self.lock:
            self.expire_pins_locked()
            while freed < nbytes:
                victim = self.index.pop_victim(Tier.DISK)
                if victim is None:
                    break
                group = [victim]
                if victim.component is ComponentType.FULL:
                    group = [*self.index.aux_in(victim, Tier.DISK), victim]
                for e in group:
                    freed += self.index.clear_disk(e)
                    keys.append(e.skey)
                    self.counters.inc("evictions", "disk", component_label(e.component))
                    self.index.discard_if_unused(e)
        return keys

    def on_written(self, results: list[WriteResult], seconds: float) -> None:
        """Record a writer batch: committed pages are on disk, rejected ones are not."""
        ok_bytes = 0
        failed = [r for r in results if not r.ok]
        with self.lock:
            for r in results:
                e: PageEntry = r.job.token
                if r.ok:
                    self.index.set_disk(e, DiskState.READY, r.nbytes)
                    ok_bytes += r.nbytes
                else:
                    self.index.clear_disk(e)
                    reason = Failure.DISK_FULL if r.map_full else Failure.DISK_WRITE_ERROR
                    self.counters.fail(reason)
                e.pending_payload = None
                self.index.release(e)
                self.index.discard_if_unused(e)
        if failed:  # one line per batch, not per page: a full disk must not flood the log
            log.warning(
                "%d of %d pages not stored: %s", len(failed), len(results), failed[0].reason
            )
        self.counters.transfer("host_to_disk", len(results) - len(failed), ok_bytes, seconds)

    # -- disk → host (reader threads) ----------------------------------------------------

    def start_fills_locked(self, keys: Sequence[PageKey]) -> tuple[list[Future], bool]:
        """Start reading every disk-only (or remote-hinted) page of ``keys`` into a host
        page; the futures of those reads and of fills already running, and whether every
        page is held and every read could start."""
        ok = True
        if self.remote is not None:  # the hinted pages no local tier holds: read them in
            missing = [
                k
                for k in keys
                if ((e := self.index.get(k.storage_key())) is None or not e.held)
                and self.remote.hinted(k)
            ]
            ok = not missing or self.remote.fill_locked(missing)
        fills: list[Future] = []
        for k in keys:
            e = self.index.get(k.storage_key())
            if e is None or not e.held:
                ok = False
            elif e.host_state is HostState.FILLING:
                fills.append(e.fill)
            elif e.host_state is HostState.NONE:
                fut = self.start_read_locked(e)
                ok = ok and fut is not None
                if fut is not None:
                    fills.append(fut)
        return fills, ok

    def start_read_locked(self, e: PageEntry) -> Future | None:
        """Reserve a host page for a disk-only entry and queue its read; None if host full."""
        page = self.alloc_host_locked(e.component)
        if page is None:
            self.counters.fail(Failure.HOST_FULL)
            return None
        self.index.set_host(e, page, ready=False)
        self.index.acquire(e)
        e.fill = self.disk.submit_read(self.read_job, e, page)
        return e.fill

    def read_job(self, e: PageEntry, page: int) -> bool:
        """Fill host ``page`` with ``e``'s stored bytes (reader thread); True when served."""
        t0 = time.perf_counter()
        status = ReadStatus.ERROR
        try:
            if self.faults is not None and self.faults.disk_read_delay_s:
                time.sleep(self.faults.disk_read_delay_s)
            dst = self.host[e.component].row(page)
            frame = e.pending_payload  # write-back: not committed yet, served from memory
            if frame is not None:
                dst[:] = np.frombuffer(frame, np.uint8, offset=HEADER_BYTES)
                status = ReadStatus.OK
            else:
                status = self.disk.read_into(e.skey, dst)
        except Exception:
            log.exception("disk read of %s failed", e.skey.hex())
        with self.lock:
            return self._finish_read_locked(e, status, time.perf_counter() - t0)

    def _finish_read_locked(self, e: PageEntry, status: ReadStatus, seconds: float) -> bool:
        e.fill = None
        if status is ReadStatus.OK:
            self.index.mark_host_ready(e)
            self.index.release(e)
            nbytes = self.host[e.component].page_bytes
            self.counters.transfer("disk_to_host", 1, nbytes, seconds)
            return True
        self.host[e.component].free(self.index.clear_host(e))
        self.index.release(e)
        self.counters.fail(_READ_FAILURES[status])
        if status is not ReadStatus.ERROR and e.disk_state is DiskState.READY:
            # Never served again: forget it, and delete it unless LMDB lost it already.
            self.index.clear_disk(e)
            if status is not ReadStatus.MISSING:
                # While closing the delete is refused; the next open checks the value again.
                with contextlib.suppress(ControllerError):
                    self.disk.submit_delete([e.skey])
            log.warning("disk page %s dropped: %s", e.skey.hex(), status.value)
        self.index.discard_if_unused(e)
        return False

    # -- state ---------------------------------------------------------------------------

    def stats_locked(self) -> dict[str, Any]:
        self.expire_pins_locked()  # pins_active counts live pins only
        disk: dict[str, Any] = {"enabled": self.disk is not None}
        if self.disk is not None:
            disk.update(self.disk.stats())
            disk["live_bytes"] = self.index.disk_live_bytes
            disk["budget_bytes"] = self.config.disk_budget_bytes
            disk["pages"] = {component_label(c): n for c, n in self.index.disk_pages.items()}
        return {
            "entries": len(self.index),
            "pins_active": len(self.pins),
            "host": {} if self.host is None else self.host.stats(),
            "disk": disk,
        }

    def check_invariants(self, deep: bool = False) -> None:
        """Index, pins, host pages and in-flight holds agree; with ``deep``, LMDB too.

        ``deep`` flushes the writer first and must run while nothing else uses the store.
        """
        if deep and self.disk is not None:
            self.disk.flush()
        with self.lock:
            self.index.check_invariants()
            self.pins.check_invariants()
            owned: dict[ComponentType, set[int]] = {c: set() for c in ComponentType}
            for e in self.index:
                if e.host_page >= 0:
                    assert e.host_page not in owned[e.component], f"{e}: host page shared"
                    owned[e.component].add(e.host_page)
                want = (
                    (e.host_state is HostState.FILLING)
                    + (e.disk_state is DiskState.PENDING)
                    + e.copies
                )
                assert e.busy == want, f"{e}: busy {e.busy} != {want} operations in flight"
                assert (e.fill is not None) == (e.host_state is HostState.FILLING), f"{e}: fill"
                assert e.pending_payload is None or e.disk_state is DiskState.PENDING, f"{e}"
            if self.host is not None:
                for c, pool in self.host.components.items():
                    pool.check_invariants(owned[c])
            if deep and self.disk is not None:
                stored = self.disk.stored_keys()
                ready = {e.skey for e in self.index if e.disk_state is DiskState.READY}
                queued = {e.skey for e in self.index if e.disk_state is DiskState.PENDING}
                assert ready <= stored, f"{len(ready - stored)} indexed pages missing in LMDB"
                extra = stored - ready - queued - self.disk.pending_deletes
                extra -= self.disk.foreign_keys
                assert not extra, f"{len(extra)} LMDB values unknown to the index"

    def close(self, timeout_s: float) -> bool:
        """Drain the writer and close LMDB (call without the lock); True when drained."""
        if self.disk is None:
            return True
        return self.disk.close(timeout_s)
