"""``LocalController``: the host and disk tiers in-process, for one layout, many engines.

Threading model
---------------
* **Callers** (engine threads, or the sidecar's request handlers) run every public
  method. Index work happens under one lock (the :class:`PageStore`'s), held only for
  index and pool bookkeeping, never across a copy or an LMDB call. Device ↔ host copies
  run in the caller's thread (CPU) or on the transfer engine's CUDA streams.
* **The LMDB writer thread** commits queued pages in batches; it calls back into the
  controller (under the lock) to choose disk victims and to record what it committed.
* **The reader pool** copies disk pages into host pages and publishes them (under the
  lock); a load or prefetch waits on their futures without holding the lock.

An operation in flight on a page holds it (``PageEntry.busy``): a host page being
filled, a page queued for the writer, a page being copied to a device. Held pages are
never evicted, so no copy ever reads or writes a page that changed owner. A pin only
promises presence between ``pin`` and ``load``; ``load`` holds its pages for the copy.

Engines
-------
One controller serves every engine of one layout (the first registration fixes it;
another fingerprint is refused). Every engine-scoped method takes ``engine_id``
(default ``"local"``), and :meth:`LocalController.session` returns an object bound to
one engine that implements :class:`hicache.controller_api.CacheController` exactly; the
sidecar keeps one session per connected engine and closes it when the engine goes away
(which releases its pins).

Durability: with the default write-through policy every page that reaches host is queued
to LMDB at once and ``close`` drains the queue, so a clean restart keeps every page
that was ever backed up; a crash loses at most what was queued and not yet committed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.controller.admin import ops as admin_ops
from hicache.controller.config import BackupAck, ControllerConfig
from hicache.controller.store.counters import Counters, Failure, component_label
from hicache.controller.store.engine_stores import EngineStores
from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.fills import FillTracker
from hicache.controller.store.page_copies import DeviceLoad, PageCopies
from hicache.controller.store.page_index import DiskState, HostState
from hicache.controller.store.page_store import PageStore
from hicache.controller.store.session import EngineSession
from hicache.controller.store.transfer_engine import EngineBuffers, TransferEngine, check_refs
from hicache.controller.tiers.remote_store import RemoteStore
from hicache.controller.tiers.remote_tier import open_remote
from hicache.controller.wire.security import check_private_dir
from hicache.controller_api import (
    P_ABSENT,
    P_DISK,
    P_HOST,
    ControllerError,
    LoadResult,
    LookupResult,
    PageKey,
    PageRef,
    PinReceipt,
    TransferHandle,
)
from hicache.types import ComponentType, LayoutMismatchError, Tier

if TYPE_CHECKING:
    from hicache.layout import ModelLayout
    from hicache.pools import DevicePools

log = logging.getLogger(__name__)

# How long a clear waits for queued backups and disk writes to commit before it drops
# what it may: a write still queued after this is kept (in flight), never lost or torn.
CLEAR_FLUSH_TIMEOUT_S = 30.0

DEFAULT_ENGINE = "local"


class ControllerLayoutMismatch(ControllerError, LayoutMismatchError):
    """An engine registered a layout other than the one the controller serves."""


class LocalController:
    """Host pool + LMDB tier + page index + transfers, behind the CacheController methods."""

    def __init__(
        self,
        config: ControllerConfig | None = None,
        layout: ModelLayout | None = None,
        page_size: int | None = None,
        remote_store: RemoteStore | None = None,
    ) -> None:
        """Without ``layout``, the tiers are built at the first :meth:`register`.
        ``remote_store`` replaces the cluster of ``config.remote_url`` (tests)."""
        self.config = config or ControllerConfig()
        if self.config.disk_enabled:  # before anything is built: refuse a path others write
            check_private_dir(Path(self.config.disk_path), "disk_path")
        self._remote_store = remote_store
        self.counters = Counters()
        self._store = PageStore(self.config, self.counters)
        self._engines: dict[str, EngineBuffers] = {}
        self._fills = FillTracker(self._store)
        self._layout: ModelLayout | None = None
        self._fingerprint: bytes | None = None
        self._copies: PageCopies | None = None
        self._engine_stores: EngineStores | None = None
        self._closed = False
        # Held while the tiers are opened, and by an fsck of the disk tier before they are
        # (LMDB allows one environment per file per process).
        self.opening_lock = threading.Lock()
        if layout is not None:
            if page_size is None:
                raise ControllerError("give page_size together with layout")
            self._ensure_layout(layout, page_size)

    # -- setup ---------------------------------------------------------------------------

    def open_layout(self, layout: ModelLayout, page_size: int) -> None:
        """Build the tiers for ``layout`` (host pool, the index rebuilt from disk) unless
        built already; refuses another layout (ControllerLayoutMismatch)."""
        self._ensure_layout(layout, page_size)

    def _ensure_layout(self, layout: ModelLayout, page_size: int) -> None:
        fp = layout.fingerprint(page_size)
        # Held throughout: a second register waits until the tiers (and the index rebuilt
        # from LMDB) are complete; the opening lock first, so that an fsck of the
        # unopened disk tier (which holds it) ends before the tier is opened here.
        with self.opening_lock, self._store.lock:
            if self._fingerprint is not None:
                if fp != self._fingerprint:
                    raise ControllerLayoutMismatch(
                        f"layout {layout.model_id!r} (page_size={page_size}, fingerprint "
                        f"{fp.hex()}) differs from the layout this controller serves "
                        f"({self._fingerprint.hex()}); run one controller per layout"
                    )
                return
            self._store.open_locked(layout, page_size, fp)
            self._store.remote = open_remote(
                self.config, self._store, fp, self.counters, self._remote_store
            )
            transfer = TransferEngine(self._store.host)
            self._copies = PageCopies(
                self._store, self._fills, transfer, self.counters, self.config
            )
            self._engine_stores = EngineStores(self._store, self._fills, self.counters)
            self._layout, self._fingerprint = layout, fp

    @property
    def faults(self) -> FaultPlan | None:
        """Armed failures for tests (None in production)."""
        return self._store.faults

    @faults.setter
    def faults(self, plan: FaultPlan | None) -> None:
        self._store.faults = plan

    def register(
        self,
        layout: ModelLayout,
        page_size: int,
        pools: DevicePools,
        engine_id: str = DEFAULT_ENGINE,
    ) -> None:
        """Make ``pools`` addressable as ``engine_id``; refuses another layout."""
        if pools.config.page_size != page_size:
            raise ControllerError(
                f"page_size={page_size} but the pools were built with page_size="
                f"{pools.config.page_size}; pass the pools' own page size"
            )
        if pools.layout.fingerprint(page_size) != layout.fingerprint(page_size):
            raise ControllerLayoutMismatch("the pools were built for another layout")
        self.register_buffers(layout, page_size, EngineBuffers.from_pools(pools), engine_id)

    def register_buffers(
        self, layout: ModelLayout, page_size: int, buffers: EngineBuffers, engine_id: str
    ) -> None:
        """Like :meth:`register`, for device tensors mapped by the sidecar."""
        self._check_open()
        if buffers.page_size != page_size:
            raise ControllerError(f"buffers have page_size {buffers.page_size}, not {page_size}")
        self._ensure_layout(layout, page_size)
        with self._store.lock:
            self._engines[engine_id] = buffers

    def unregister(self, engine_id: str) -> None:
        """Forget an engine: release its pins. Its queued backups finish on their own
        (each holds the engine's buffers until published), so this never waits on a GPU
        stream: the sidecar calls it on its I/O thread, which serves every engine."""
        self._fills.reap(block=False)
        with self._store.lock:
            self._engines.pop(engine_id, None)
            n = self._store.pins.release_engine(engine_id)
            if self._engine_stores is not None:
                self._engine_stores.abort_engine_locked(engine_id)
        if n:
            self.counters.add(n, "pins", "released_with_engine")

    @property
    def opened(self) -> bool:
        """Whether the tiers are built (the layout is known, the index rebuilt from disk)."""
        return self._fingerprint is not None

    @property
    def store(self) -> PageStore:
        """The index, pins and tiers behind this controller, for admin verbs (fsck, evict,
        clear) that work on them directly under ``store.lock``."""
        return self._store

    def session(self, engine_id: str) -> EngineSession:
        """The CacheController protocol bound to one engine of this controller."""
        return EngineSession(self, engine_id)

    @property
    def engines(self) -> list[str]:
        with self._store.lock:
            return sorted(self._engines)

    # -- helpers -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ControllerError("the controller is closed")

    def _buffers(self, engine_id: str) -> EngineBuffers:
        try:
            return self._engines[engine_id]
        except KeyError:
            raise ControllerError(
                f"engine {engine_id!r} is not registered; call register() first"
            ) from None

    # -- the protocol --------------------------------------------------------------------

    def lookup(
        self,
        page_hashes: Sequence[bytes],
        components: Sequence[ComponentType],
        engine_id: str = DEFAULT_ENGINE,
    ) -> LookupResult:
        """Presence per component of each page of the chain; only the index is read."""
        self._check_open()
        rows: dict[ComponentType, list[int]] = {}
        with self._store.lock:
            for comp in components:
                rows[comp] = self._store.index.presence(page_hashes, comp)
        if self._store.remote is not None:  # outside the lock: it waits on the network
            self._store.remote.probe(page_hashes, rows)
        for comp, row in rows.items():
            label = component_label(comp)
            self.counters.add(row.count(P_HOST), "lookup", "host", label)
            self.counters.add(row.count(P_DISK), "lookup", "disk", label)
            self.counters.add(row.count(P_ABSENT), "lookup", "miss", label)
        return LookupResult({c: np.array(row, dtype=np.int8) for c, row in rows.items()})

    def presence(
        self, page_hashes: Sequence[bytes], components: Sequence[ComponentType]
    ) -> dict[ComponentType, list[int]]:
        """What :meth:`lookup` answers, without counting it as a lookup (a router's
        ``score`` is not an engine's lookup)."""
        self._check_open()
        with self._store.lock:
            rows = {c: self._store.index.presence(page_hashes, c) for c in components}
        if self._store.remote is not None:  # outside the lock: it waits on the network
            self._store.remote.probe(page_hashes, rows)
        return rows

    def backup(
        self,
        refs: Sequence[PageRef],
        ready_event: Any = None,
        engine_id: str = DEFAULT_ENGINE,
    ) -> TransferHandle:
        """Copy device pages into host pages (queued to disk by policy).

        Pages already held (host or disk) are only touched. The handle's ``wait`` is True
        when every page of ``refs`` is held afterwards; pages that found no host page
        (all pinned or busy) are counted under ``failures.host_full``.
        """
        self._check_open()
        buffers = self._buffers(engine_id)
        check_refs(refs, buffers, self._layout)
        return self._copies.backup(refs, buffers, ready_event)

    def begin_store(
        self, refs: Sequence[PageRef], ttl_s: float | None = None, engine_id: str = DEFAULT_ENGINE
    ) -> tuple[int, list[int]]:
        """Host pages for a store the engine copies itself (``refs``' device indices are
        not used): the reservation's id and, per ref, the host page to write, -1 (held
        already: nothing to write) or -2 (no room: not stored). The pages stay invisible
        until :meth:`commit_store`; ``ttl_s`` (default ``pin_ttl_default_s``, at most
        ``pin_ttl_max_s``) bounds how long they are the engine's."""
        self._check_open()
        if self._engine_stores is None:
            raise ControllerError("register a layout before storing")
        ttl = min(ttl_s or self.config.pin_ttl_default_s, self.config.pin_ttl_max_s)
        self._fills.reap(block=False)
        return self._engine_stores.begin(refs, engine_id, ttl)

    def commit_store(self, store_id: int, written: bool, engine_id: str = DEFAULT_ENGINE) -> int:
        """Publish the pages of store ``store_id`` (the engine wrote them: ``written``) or
        give them back; the pages published (0 for a store past its deadline)."""
        if self._engine_stores is None:
            return 0
        return self._engine_stores.commit(store_id, engine_id, written)

    def pin(
        self, keys: Sequence[PageKey], ttl_s: float | None = None, engine_id: str = DEFAULT_ENGINE
    ) -> PinReceipt | None:
        """Pin every page of ``keys`` (held on host or disk) for ``ttl_s`` seconds.

        None, with nothing pinned, when any page is absent. ``ttl_s`` defaults to
        ``pin_ttl_default_s`` and is capped at ``pin_ttl_max_s``.
        """
        self._check_open()
        if self._store.fault("pin"):
            self.counters.fail(Failure.PIN_FAULT)
            raise ControllerError("pin failed (injected fault)")
        ttl = self.config.pin_ttl_default_s if ttl_s is None else ttl_s
        if not ttl > 0:
            raise ControllerError(f"ttl_s must be > 0 seconds, got {ttl_s}")
        ttl = min(ttl, self.config.pin_ttl_max_s)
        rec = self._store.pin_keys(keys, engine_id, ttl)
        if isinstance(rec, Failure):
            self.counters.fail(rec)
            return None
        self.counters.inc("pins", "pinned")
        return PinReceipt(rec.pin_id, list(keys), rec.deadline, engine_id=engine_id)

    def unpin(
        self, pin: PinReceipt, engine_id: str = DEFAULT_ENGINE, loaded_s: float | None = None
    ) -> None:
        """Release a pin; harmless when released already or expired. ``loaded_s``: the
        engine copied the pinned pages itself from shared host pages, in that long."""
        with self._store.lock:
            rec = self._store.pins.get(pin.pin_id)
            if rec is not None and rec.engine_id != engine_id:
                raise ControllerError(f"pin {pin.pin_id} belongs to engine {rec.engine_id!r}")
            if rec is not None and loaded_s is not None:
                self._copies.served_directly_locked(rec.entries, loaded_s)
            self._store.pins.release(pin.pin_id)

    def pinned_host_pages(self, pin: PinReceipt, keys: Sequence[PageKey]) -> np.ndarray | None:
        """The host page of each of ``keys`` under ``pin`` (-1: not ready on host), for an
        engine that copies from shared host pages; None when they are not shared."""
        return self._copies.pinned_host_pages(pin.pin_id, keys)

    def prefetch(self, keys: Sequence[PageKey], engine_id: str = DEFAULT_ENGINE) -> TransferHandle:
        """Start reading disk-only (and remote-hinted) pages into host pages; the handle
        waits for them."""
        self._check_open()
        with self._store.lock:
            fills, ok = self._store.start_fills_locked(keys)
        self.counters.add(len(fills), "prefetch", "pages")
        return self._fills.handle(fills, ok, self.config.prefetch_timeout_s)

    def load(
        self,
        refs: Sequence[PageRef],
        pin: PinReceipt,
        timeout_s: float | None = None,
        engine_id: str = DEFAULT_ENGINE,
    ) -> LoadResult:
        """Copy pinned pages into the device slots of ``refs`` (disk → host first).

        A failure when a page is gone, a read fails its checks, the reads outlast
        ``timeout_s`` (default ``load_timeout_s``) or a copy fails; the device slots are
        then undefined (nothing writes into them after the return: no ``pending``).
        Raises ControllerError for a call that can never succeed (an unregistered
        engine, a page outside the pin, a bad device index).
        """
        loaded = self._load(refs, pin, timeout_s, engine_id)
        return LoadResult.LOADED if loaded else LoadResult.FAILED

    def start_load(
        self,
        refs: Sequence[PageRef],
        pin: PinReceipt,
        engine_id: str = DEFAULT_ENGINE,
    ) -> DeviceLoad | bool | None:
        """:meth:`load` of pages all held on host, without waiting for the copy: the
        returned load's ``done()`` says when it has ended and its ``finish()`` (which
        must be called) releases the pages and says whether the bytes arrived. False for
        a load that fails at once (a page gone, the pin expired); None, with nothing
        changed, when a page must first be read from disk (call :meth:`load`). Raises as
        :meth:`load` does."""
        self._check_open()
        buffers = self._buffers(engine_id)
        claimed = self._copies.claim(refs, pin.pin_id, engine_id, buffers, self._layout, True)
        if not isinstance(claimed, list):
            return claimed
        return self._copies.start_to_device(refs, claimed, buffers)

    def _load(
        self, refs: Sequence[PageRef], pin: PinReceipt, timeout_s: float | None, engine_id: str
    ) -> bool:
        self._check_open()
        buffers = self._buffers(engine_id)
        timeout = self.config.load_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        claimed = self._copies.claim(refs, pin.pin_id, engine_id, buffers, self._layout, False)
        if isinstance(claimed, bool):
            return claimed
        if isinstance(claimed, tuple):
            entries, fills = claimed
            filled = self._fills.wait(fills, deadline)
            if filled is None:
                self.counters.fail(Failure.LOAD_TIMEOUT)
                return False
            if not filled:
                return False  # the read counted its own reason
            with self._store.lock:
                for e in entries:
                    if not e.attached or e.host_state is not HostState.READY:
                        self.counters.fail(Failure.PAGE_ABSENT)
                        return False
                for e in entries:
                    self._store.hold_locked(e)
        else:
            entries = claimed
        return self._copies.to_device(refs, entries, buffers)

    # -- state ---------------------------------------------------------------------------

    def tiers_of(self, keys: Sequence[PageKey]) -> list[frozenset[Tier]]:
        """Which tiers hold each page: HOST once its host copy is ready, DISK once
        committed to LMDB (a queued write does not count)."""
        with self._store.lock:
            return [self._store.tiers_locked(k) for k in keys]

    def acknowledged(self, refs: Sequence[PageRef], ack: BackupAck, timeout_s: float) -> bool:
        """Whether the pages of a backup that ended well are where ``ack`` promises:
        always for HOST (the backup held them); for DISK once every one is committed to
        LMDB, waiting up to ``timeout_s`` for the writer."""
        if ack is BackupAck.HOST:
            return True
        keys = list({r.key: None for r in refs})
        return self.flush(timeout_s) and all(Tier.DISK in t for t in self.tiers_of(keys))

    # -- admin: the work is admin_ops', whose functions say what each one promises ------

    def clear(
        self,
        fingerprint: bytes | None,
        tiers: Sequence[Tier],
        namespace: str | None = None,
        all_namespaces: bool = True,
    ) -> admin_ops.ClearResult:
        """Drop every unpinned page of ``tiers`` (admin_ops.clear). Backups and disk
        writes queued before the call are committed first (for up to
        ``CLEAR_FLUSH_TIMEOUT_S``), so a page stored just before a clear is dropped
        instead of being kept as in flight, or written to disk after it."""
        self.flush(CLEAR_FLUSH_TIMEOUT_S)
        return admin_ops.clear(self, fingerprint, tiers, namespace, all_namespaces)

    def evict(
        self, tier: Tier, nbytes: int, component: ComponentType | None = None
    ) -> dict[str, int]:
        return admin_ops.evict(self, tier, nbytes, component)

    def prefix_keys(
        self, fingerprint: bytes, page_size: int, tokens: list[int], namespace: str | None
    ) -> list[PageKey]:
        return admin_ops.prefix_keys(self, fingerprint, page_size, tokens, namespace)

    def pin_prefix(self, keys: list[PageKey], ttl_s: float) -> PinReceipt | None:
        return admin_ops.pin_prefix(self, keys, ttl_s)

    def unpin_prefix(self, pin_id: int) -> None:
        admin_ops.unpin(self, pin_id)

    def fsck(
        self, repair: bool = False, progress: Callable[[int, int], None] | None = None
    ) -> admin_ops.FsckResult:
        return admin_ops.fsck(self, repair, progress)

    def residency(self) -> dict[str, dict[str, dict[str, int]]]:
        return admin_ops.residency(self)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued backups are published and queued disk writes committed."""
        self._fills.reap(block=True)
        remote = self._store.remote
        sent = True if remote is None else remote.flush(timeout_s)
        return sent and (True if self._store.disk is None else self._store.disk.flush(timeout_s))

    def stats(self, engine_id: str = DEFAULT_ENGINE) -> dict[str, Any]:
        """Counters and residency as a JSON/msgpack-safe dict (see docs/metrics.md)."""
        out = self.counters.snapshot()
        with self._store.lock:
            out.update(self._store.stats_locked())
            out["engines"] = len(self._engines)
            out["kernels"] = None if self._copies is None else self._copies.transfer.source
        remote = self._store.remote
        out["remote_tier"] = {"enabled": False} if remote is None else remote.stats()
        return out

    def check_invariants(self, deep: bool = False) -> None:
        """Recompute the index, pools, pins and holds and compare; AssertionError if off.

        ``deep`` also flushes the writer and compares the index with LMDB's keys; call it
        only while no other thread uses the controller.
        """
        if deep:
            self._fills.reap(block=True)
        self._store.check_invariants(deep)
        with self._store.lock:
            self._fills.check_invariants_locked()
            if self._engine_stores is not None:
                self._engine_stores.check_invariants_locked()

    def close(self) -> int:
        """Finish queued copies, drain the writer, close LMDB. Idempotent.

        Returns the pages that were to be written to disk and are not: writes that failed
        or were rejected while closing, plus pages still queued when the writer did not
        drain within ``close_timeout_s``. 0: every queued page is committed (and always
        from a second call, which does nothing).
        """
        write_failures = (Failure.DISK_WRITE_ERROR, Failure.DISK_FULL)
        with self._store.lock:
            if self._closed:
                return 0
            self._closed = True
            failed_before = sum(self.counters.get("failures", f.value) for f in write_failures)
        self._fills.reap(block=True)
        with self._store.lock:
            # Write-back keeps pages in memory only; a clean shutdown must not lose them.
            self._store.write_back_all_locked()
        if self._store.remote is not None:  # first: its fills may still queue disk writes
            self._store.remote.close(self.config.close_timeout_s)
        drained = self._store.close(self.config.close_timeout_s)
        with self._store.lock:  # a writer still running settles pages under this lock
            failed = sum(self.counters.get("failures", f.value) for f in write_failures)
            lost = int(failed - failed_before)
            if not drained:
                unwritten = sum(1 for e in self._store.index if e.disk_state is DiskState.PENDING)
                log.error("controller closed with %d pages still queued for disk", unwritten)
                lost += unwritten
            self._engines.clear()
        return lost
