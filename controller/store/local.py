"""``LocalController``: the host and disk tiers in-process, for one layout, many engines.

It is the in-process implementation of :class:`hicache.controller_api.CacheController`
over a :class:`PageStore`: it keeps the engines' device buffers, checks what they ask,
and carries it out with the store's operations and the device copies of
:class:`~hicache.controller.store.page_copies.PageCopies`. What is not an engine's (admin
verbs, a router's score, the sidecar's reports) goes to the store itself
(:attr:`LocalController.store`).

Threading model
---------------
* **Callers** (engine threads, or the sidecar's request handlers) run every public
  method. Index work happens under one lock, the :class:`PageStore`'s, held only for
  index and pool bookkeeping, never across a copy or an LMDB call. Device ↔ host copies
  run in the caller's thread (CPU) or on the transfer engine's CUDA streams.
* **The LMDB writer thread** commits queued pages in batches; it calls back into the
  store (under the lock) to choose disk victims and to record what it committed.
* **The reader pool** copies disk pages into host pages (a load's large pages on into its
  engine's slots too, or into them alone: ``store/load_reads.py``) and publishes them; a
  load or prefetch waits on their futures without holding the lock.

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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.controller.config import BackupAck, ControllerConfig
from hicache.controller.store.copy_ops import ClaimState
from hicache.controller.store.cost_rule import CostRule
from hicache.controller.store.counters import Counters, Failure, component_label
from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.miss_reasons import RecentLookup
from hicache.controller.store.page_copies import DeviceLoad, PageCopies
from hicache.controller.store.page_store import PageStore
from hicache.controller.store.session import EngineSession
from hicache.controller.store.transfer_engine import EngineBuffers, TransferEngine, check_refs
from hicache.controller.wire.security import check_private_dir
from hicache.controller_api import (
    P_ABSENT,
    P_DISK,
    P_HOST,
    ControllerError,
    LayerGroups,
    LayerLoad,
    LoadResult,
    LookupResult,
    PageKey,
    PageRef,
    PinReceipt,
    TransferHandle,
    WholeLayerLoad,
)
from hicache.types import ComponentType, LayoutMismatchError, Tier

if TYPE_CHECKING:
    from hicache.controller.tiers.remote_store import RemoteStore
    from hicache.layout import ModelLayout
    from hicache.pools import DevicePools

log = logging.getLogger(__name__)

DEFAULT_ENGINE = "local"


class ControllerLayoutMismatch(ControllerError, LayoutMismatchError):
    """An engine registered a layout other than the one the controller serves."""


class LocalController:
    """The CacheController methods, per engine, over one page store and its copies."""

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
        # The engines' buffers, the layout served and the closed flag; the store has its
        # own lock, never taken while this one is held but to open the tiers.
        self._lock = threading.Lock()
        self._engines: dict[str, EngineBuffers] = {}
        self._layout: ModelLayout | None = None
        self._fingerprint: bytes | None = None
        self._copies: PageCopies | None = None
        self._page_size = 0
        self._closed = False
        self.cost_rule = CostRule(self.config.cost_rule, self.config.cost_rule_recheck_s)
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
        # from LMDB) are complete.
        with self._lock:
            if self._fingerprint is not None:
                if fp != self._fingerprint:
                    raise ControllerLayoutMismatch(
                        f"layout {layout.model_id!r} (page_size={page_size}, fingerprint "
                        f"{fp.hex()}) differs from the layout this controller serves "
                        f"({self._fingerprint.hex()}); run one controller per layout"
                    )
                return
            host = self._store.open(layout, page_size, fp, self._remote_store)
            transfer = TransferEngine(host)
            self._copies = PageCopies(self._store, transfer, self.counters, self.config)
            self._layout, self._fingerprint = layout, fp
            self._page_size = page_size

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
        self._copies.warm(buffers)  # its kernels and plans now, not at a first load
        with self._lock:
            self._engines[engine_id] = buffers

    def unregister(self, engine_id: str) -> None:
        """Forget an engine: release its pins and the host pages handed to it for its own
        stores. Its queued backups finish on their own (each holds the engine's buffers
        until published), so this never waits on a GPU stream: the sidecar calls it on
        its I/O thread, which serves every engine."""
        self._store.reap_backups(block=False)
        with self._lock:
            self._engines.pop(engine_id, None)
        self.cost_rule.forget(engine_id)
        n = self._store.release_engine(engine_id)
        if n:
            self.counters.add(n, "pins", "released_with_engine")

    @property
    def opened(self) -> bool:
        """Whether the tiers are built (the layout is known, the index rebuilt from disk)."""
        return self._fingerprint is not None

    @property
    def store(self) -> PageStore:
        """The page store behind this controller: what is not an engine's (admin verbs, a
        router's score, the sidecar's reports) uses its operations."""
        return self._store

    def session(self, engine_id: str) -> EngineSession:
        """The CacheController protocol bound to one engine of this controller."""
        return EngineSession(self, engine_id)

    @property
    def engines(self) -> list[str]:
        with self._lock:
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
        tenant: str | None = None,
        prefill_tokens_per_s: float | None = None,
    ) -> LookupResult:
        """Presence per component of each page of the chain; only the index (and a remote
        tier's probe) is read. ``tenant``: whose lookup it is (its results are counted to
        it; the pages found are the chain's, whoever stored them).
        ``prefill_tokens_per_s``: the engine's prefill rate, for the cost rule
        (controller/store/cost_rule.py: pages slower to load than to recompute are
        reported absent); kept until the engine reports another."""
        self._check_open()
        if prefill_tokens_per_s is not None:
            self.cost_rule.report_rate(engine_id, prefill_tokens_per_s)
        rows = self._store.presence(page_hashes, components, tenant)
        self.cost_rule.apply(engine_id, rows, self._page_size, self._store)
        reasons = self._store.first_misses(page_hashes, rows)
        self._store.remember_lookup(engine_id, RecentLookup.of(page_hashes, rows, reasons))
        for comp, row in rows.items():
            label = component_label(comp)
            self.counters.add(row.count(P_HOST), "lookup", "host", label)
            self.counters.add(row.count(P_DISK), "lookup", "disk", label)
            self.counters.add(row.count(P_ABSENT), "lookup", "miss", label)
        return LookupResult({c: np.array(row, dtype=np.int8) for c, row in rows.items()})

    def report_prefill_rate(
        self, tokens_per_s: float | None, engine_id: str = DEFAULT_ENGINE, measured: bool = False
    ) -> None:
        """``engine_id`` prefills ``tokens_per_s`` tokens per second (None: unknown): its
        lookups then offer lower-tier pages only where loading beats recomputing. A
        ``measured`` rate (hicache/prefill_rate.py) counts only while none is reported."""
        self.cost_rule.report_rate(engine_id, tokens_per_s, measured)

    def backup(
        self,
        refs: Sequence[PageRef],
        ready_event: Any = None,
        engine_id: str = DEFAULT_ENGINE,
        tenant: str | None = None,
    ) -> TransferHandle:
        """Copy device pages into host pages (queued to disk by policy).

        Pages already held (host or disk) are only touched. The handle's ``wait`` is True
        when every page of ``refs`` is held afterwards; pages that found no host page
        (all pinned or busy) are counted under ``failures.host_full``, those that did not
        fit ``tenant``'s quota under ``failures.tenant_quota`` (controller/store/tenants.py).
        """
        self._check_open()
        buffers = self._buffers(engine_id)
        check_refs(refs, buffers, self._layout)
        return self._copies.backup(refs, buffers, ready_event, tenant)

    def begin_store(
        self,
        refs: Sequence[PageRef],
        ttl_s: float | None = None,
        engine_id: str = DEFAULT_ENGINE,
        tenant: str | None = None,
    ) -> tuple[int, list[int]]:
        """Host pages for a store the engine copies itself (``refs``' device indices are
        not used): the reservation's id and, per ref, the host page to write, -1 (held
        already: nothing to write) or -2 (no room: not stored). The pages stay invisible
        until :meth:`commit_store`; ``ttl_s`` (default ``pin_ttl_default_s``, at most
        ``pin_ttl_max_s``) bounds how long they are the engine's; new pages are ``tenant``'s
        (within its host quota)."""
        self._check_open()
        ttl = min(ttl_s or self.config.pin_ttl_default_s, self.config.pin_ttl_max_s)
        self._store.reap_backups(block=False)
        return self._store.begin_store(refs, engine_id, ttl, tenant)

    def commit_store(self, store_id: int, written: bool, engine_id: str = DEFAULT_ENGINE) -> int:
        """Publish the pages of store ``store_id`` (the engine wrote them: ``written``) or
        give them back; the pages published (0 for a store past its deadline)."""
        if not self.opened:
            return 0
        return self._store.commit_store(store_id, engine_id, written)

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
        rec = self._store.pin(keys, engine_id, ttl)
        if isinstance(rec, Failure):
            self.counters.fail(rec)
            return None
        self.counters.inc("pins", "pinned")
        return PinReceipt(rec.pin_id, list(keys), rec.deadline, engine_id=engine_id)

    def unpin(
        self,
        pin: PinReceipt,
        engine_id: str = DEFAULT_ENGINE,
        loaded_s: float | None = None,
        disk_s: float | None = None,
    ) -> None:
        """Release a pin; harmless when released already or expired. ``loaded_s``: the
        engine copied the pinned pages itself from shared host pages, in that long;
        ``disk_s``: and read those only on disk from LMDB, in that long."""
        self._store.unpin(pin.pin_id, engine_id, loaded_s, disk_s)

    def prefetch(self, keys: Sequence[PageKey], engine_id: str = DEFAULT_ENGINE) -> TransferHandle:
        """Start reading disk-only (and remote-hinted) pages into host pages; the handle
        waits for them."""
        self._check_open()
        fills, ok = self._store.start_fills(keys)
        self.counters.add(len(fills), "prefetch", "pages")
        return self._store.fill_handle(fills, ok, self.config.prefetch_timeout_s)

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
        self._check_open()
        buffers = self._buffers(engine_id)
        timeout = self.config.load_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        check_refs(refs, buffers, self._layout)
        # The pages read from disk for this load go into its slots as each read ends (see
        # store/load_reads.py), and nothing writes into the engine's slots once this returns.
        with self._copies.copying_as_read(refs, buffers) as early:
            claim = self._store.claim(refs, pin.pin_id, engine_id, False, early, early)
            if claim.state is ClaimState.FAILED:
                return LoadResult.FAILED
            if claim.state is ClaimState.READING and not self._store.reads_done(
                claim, deadline, engine_id
            ):
                return LoadResult.FAILED
            loaded = self._copies.to_device(refs, claim.entries, buffers, early)
            return LoadResult.LOADED if loaded else LoadResult.FAILED

    def start_layer_load(
        self,
        refs: Sequence[PageRef],
        pin: PinReceipt,
        groups: LayerGroups,
        timeout_s: float | None = None,
        engine_id: str = DEFAULT_ENGINE,
    ) -> LayerLoad:
        """:meth:`load` started for every layer at once and waited on group by group
        (:class:`~hicache.controller_api.LayerLoad`): pages only on disk are read to host
        first (that part is not layer-wise), then each group's copy is issued in order.
        A load that fails before its copies is a failed load of every group."""
        self._check_open()
        buffers = self._buffers(engine_id)
        timeout = self.config.load_timeout_s if timeout_s is None else timeout_s
        check_refs(refs, buffers, self._layout)
        claim = self._store.claim(refs, pin.pin_id, engine_id, inline=False)
        if claim.state is ClaimState.FAILED:
            return WholeLayerLoad(groups, LoadResult.FAILED)
        if claim.state is ClaimState.READING:
            filled = self._store.wait_fills(claim.fills, time.monotonic() + timeout)
            if filled is None:
                self.counters.fail(Failure.LOAD_TIMEOUT)
            if not filled or not self._store.hold_for_copy(claim.entries):
                return WholeLayerLoad(groups, LoadResult.FAILED)
        return self._copies.start_layers_to_device(refs, claim.entries, buffers, groups)

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
        check_refs(refs, buffers, self._layout)
        claim = self._store.claim(refs, pin.pin_id, engine_id, inline=True)
        if claim.state is ClaimState.FAILED:
            return False
        if claim.state is ClaimState.NOT_ON_HOST:
            return None
        return self._copies.start_to_device(refs, claim.entries, buffers)

    # -- state ---------------------------------------------------------------------------

    def acknowledged(self, refs: Sequence[PageRef], ack: BackupAck, timeout_s: float) -> bool:
        """Whether the pages of a backup that ended well are where ``ack`` promises:
        always for HOST (the backup held them); for DISK once every one is committed to
        LMDB, waiting up to ``timeout_s`` for the writer."""
        if ack is BackupAck.HOST:
            return True
        keys = list({r.key: None for r in refs})
        return self.flush(timeout_s) and all(Tier.DISK in t for t in self._store.tiers_of(keys))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued backups are published and queued disk (and remote) writes
        committed."""
        return self._store.flush(timeout_s)

    def stats(self, engine_id: str = DEFAULT_ENGINE) -> dict[str, Any]:
        """Counters and residency as a JSON/msgpack-safe dict (see docs/metrics.md)."""
        out = self.counters.snapshot()
        out.update(self._store.stats())
        with self._lock:
            out["engines"] = len(self._engines)
        out["kernels"] = None if self._copies is None else self._copies.transfer.source
        out["cost_rule"] = self.cost_rule.stats()
        return out

    def check_invariants(self, deep: bool = False) -> None:
        """Recompute the index, pools, pins and holds and compare; AssertionError if off.

        ``deep`` also flushes the writer and compares the index with LMDB's keys; call it
        only while no other thread uses the controller.
        """
        self._store.check_invariants(deep)

    def close(self) -> int:
        """Finish queued copies, drain the writer, close LMDB. Idempotent.

        Returns the pages that were to be written to disk and are not: writes that failed
        or were rejected while closing, plus pages still queued when the writer did not
        drain within ``close_timeout_s``. 0: every queued page is committed (and always
        from a second call, which does nothing).
        """
        with self._lock:
            if self._closed:
                return 0
            self._closed = True
        lost = self._store.close(self.config.close_timeout_s)
        with self._lock:
            self._engines.clear()
        return lost
