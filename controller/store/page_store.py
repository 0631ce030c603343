"""``PageStore``: the host tier of one layout, the tiers behind it, and the moves between them.

It owns the page index, the pins, the host pool, the queued backups and the lower tiers
(:class:`~hicache.controller.tiers.lower_tier.LowerTier`: LMDB, remote), and one lock
over all of them that it never hands out: callers use its operations, each of which
takes the lock for as long as it needs it. It answers where a page's bytes are, which
page leaves a full tier, and how a page moves between host and the tiers below. It knows
nothing of engines or device memory: the device copies are
:class:`~hicache.controller.store.page_copies.PageCopies`', the engines are
:class:`~hicache.controller.store.local.LocalController`'s.

Its operations, by who calls them (each group in its own module):

* engines, through the controller: here, :meth:`presence`, :meth:`tiers_of`,
  :meth:`pin`, :meth:`unpin`, :meth:`release_engine`, :meth:`start_fills` and the waits
  on fills (:meth:`reap_backups`, :meth:`wait_fills`, :meth:`fill_handle`); around the
  copies between devices and host pages (loads, backups, an engine's own stores),
  :class:`~hicache.controller.store.copy_ops.CopyOps`';
* admins: :class:`~hicache.controller.store.admin_ops.AdminOps`' (clear, evict, fsck, …);
* the lower tiers: :class:`~hicache.controller.store.tier_host.TierHostOps`' (the
  :class:`~hicache.controller.tiers.lower_tier.TierHost` protocol);
* its owner: :meth:`open`, :meth:`listen`, :meth:`stats`, :meth:`check_invariants`,
  :meth:`close`, and what the sidecar reports (:meth:`tiers`, :meth:`tier_health`,
  :meth:`shared_host_pages`, :meth:`indexed_pages`).

Methods named ``*_locked`` run with the lock held: the store's own helpers, and the
operations a lower tier calls from inside a call the store made to it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from hicache.controller.config import ControllerConfig
from hicache.controller.store.admin_ops import AdminOps
from hicache.controller.store.copy_ops import CopyOps
from hicache.controller.store.counters import Counters, Failure, component_label
from hicache.controller.store.engine_stores import EngineStores
from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.fills import FillHandle, FillTracker
from hicache.controller.store.host_pool import HostPool, SharedHostPages
from hicache.controller.store.miss_ops import MissOps
from hicache.controller.store.miss_reasons import MissLog, MissReason
from hicache.controller.store.page_entry import TAGS
from hicache.controller.store.page_index import DiskState, HostState, PageEntry, PageIndex
from hicache.controller.store.pins import PinRecord, PinTable
from hicache.controller.store.tenant_ops import TenantOps
from hicache.controller.store.tenants import TenantLedger
from hicache.controller.store.tier_host import TierHostOps
from hicache.controller.tiers.disk_tier import DiskTier
from hicache.controller.tiers.remote_tier import open_remote
from hicache.controller_api import PageKey
from hicache.types import ComponentType, Tier

if TYPE_CHECKING:
    from hicache.controller.store.cost_rule import ReadCost
    from hicache.controller.store.tier_events import TierEvents
    from hicache.controller.tiers.lower_tier import LowerTier
    from hicache.controller.tiers.remote_store import RemoteStore
    from hicache.layout import ModelLayout

log = logging.getLogger("hicache.controller.store.local")

_PIN_CHUNK_KEYS = 1024  # keys pinned per hold of the lock (about a millisecond)
_HOST, _FULL = Tier.HOST, ComponentType.FULL  # bound once: used per page evicted
_LABEL = {c: component_label(c) for c in ComponentType}


class PageStore(CopyOps, TierHostOps, AdminOps, MissOps, TenantOps):
    """Index, pins, host pool and lower tiers of one layout, behind one lock."""

    def __init__(self, config: ControllerConfig, counters: Counters) -> None:
        self._config = config
        self._counters = counters
        self._faults: FaultPlan | None = None
        self._lock = threading.RLock()
        # Held while the tiers are opened, and by an fsck of the disk tier before they are
        # (LMDB allows one environment per file per process).
        self._opening = threading.Lock()
        self._index = PageIndex(
            config.host_hit_retention_turnovers, TenantLedger.from_config(config)
        )
        self._misses = MissLog(
            counters, config.miss_reasons_remembered_pages, config.miss_reasons_recent_lookups
        )
        self._pins = PinTable(self._index)
        self._fills = FillTracker(self._lock, self._publish_locked)
        self._engine_stores = EngineStores()
        self._host: HostPool | None = None
        self._disk: LowerTier | None = None  # the tier whose pages the index records
        self._tiers: tuple[LowerTier, ...] = ()  # every lower tier, the indexed one first

    @property
    def faults(self) -> FaultPlan | None:
        """Armed failures for tests (None in production)."""
        return self._faults

    @faults.setter
    def faults(self, plan: FaultPlan | None) -> None:
        self._faults = plan

    def fault(self, what: str) -> bool:
        """Whether a ``what`` failure is armed (and now taken)."""
        return self._faults is not None and self._faults.take(what)

    # -- opening -------------------------------------------------------------------------

    def open(
        self,
        layout: ModelLayout,
        page_size: int,
        fingerprint: bytes,
        remote_store: RemoteStore | None = None,
    ) -> HostPool:
        """Allocate the host pool and open the lower tiers, the index rebuilt from what
        LMDB holds; returns the host pool (the device copies address its pages). Every
        operation waits until it is done. ``remote_store`` replaces the cluster of
        ``remote_url`` (tests)."""
        with self._opening, self._lock:
            host = HostPool(layout, page_size, self._config)
            self._index.tenants.page_bytes = {c: p.page_bytes for c, p in host.components.items()}
            if self._config.disk_enabled:
                page_bytes = {c: layout.page_bytes(c, page_size) for c in layout.components}
                self._disk = DiskTier.open(
                    self._config, self, fingerprint, page_bytes, self._counters
                )
                self._tiers = (self._disk,)
            self._host = host
            remote = open_remote(self._config, self, fingerprint, self._counters, remote_store)
            if remote is not None:
                self._tiers += (remote,)
        return host

    def tiers(self) -> frozenset[Tier]:
        """The tiers this store holds pages in: HOST once open, DISK, REMOTE."""
        with self._lock:
            own = {Tier.HOST} if self._host is not None else set()
            return frozenset(own | {t.tier for t in self._tiers})

    def tier_health(self, tier: Tier, timeout_s: float) -> dict[str, Any] | None:
        """The health of lower tier ``tier`` (see ``LowerTier.health``); None without it."""
        for t in self._tiers:
            if t.tier is tier:
                return t.health(timeout_s)
        return None

    def shared_host_pages(self) -> SharedHostPages | None:
        """The host pool's pages as engines may map them; None when not shared or not built."""
        return None if self._host is None else self._host.shared_pages()

    def listen(self, events: TierEvents | None, tell_present: bool = True) -> None:
        """Make ``events`` the listener to where pages become present or absent
        (store/tier_events.py), or stop telling anyone (None). With ``tell_present`` it is
        told at once what the disk and host tiers hold now, then every change."""
        with self._lock:
            if events is not None and tell_present:
                entries = list(self._index)
                ready = [e for e in entries if e.disk_state is DiskState.READY]
                events.stored(Tier.DISK, ready)
                events.stored(Tier.HOST, [e for e in entries if e.host_state is HostState.READY])
            self._index.events = events

    def host_view(self, component: ComponentType) -> torch.Tensor:
        """The host pool's pages of ``component`` (FULL or SWA) as one typed tensor,
        ``[pages, 2, layers, page_size, heads, head_dim]``, for tools that prepare or
        check host memory (a benchmark timing the copy kernels alone); which page holds
        what is the index's to say (:meth:`host_pages`)."""
        return self._host.kv(component)

    def host_pages(self, keys: Sequence[PageKey]) -> list[int]:
        """The host page of each of ``keys`` while ready there, -1 otherwise (at the time
        of the call: a page no pin holds may move)."""
        with self._lock:
            entries = [self._index.get(k.storage_key()) for k in keys]
            return [
                e.host_page if e is not None and e.host_state is HostState.READY else -1
                for e in entries
            ]

    # -- lookups -------------------------------------------------------------------------

    def indexed_pages(self) -> int:
        """Pages the index holds (every component, every tier, in flight included)."""
        return len(self._index)

    def presence(
        self,
        page_hashes: Sequence[bytes],
        components: Sequence[ComponentType],
        tenant: str | None = None,
    ) -> dict[ComponentType, list[int]]:
        """Per component, the ``Presence`` of each page of the chain as a plain int: the
        index's, then what the lower tiers add (asked without the lock). A lookup of
        ``tenant`` counts its FULL pages' results to that tenant, and makes the pages it
        finds that belong to no tenant (found on disk at start) that tenant's."""
        rows: dict[ComponentType, list[int]] = {}
        with self._lock:
            for comp in components:
                rows[comp] = self._index.presence(page_hashes, comp)
        for tier in self._tiers:
            tier.probe(page_hashes, rows)
        if tenant is not None:
            with self._lock:
                self._tenant_lookup_locked(tenant, page_hashes, rows)
        return rows

    def tiers_of(self, keys: Sequence[PageKey]) -> list[frozenset[Tier]]:
        """Which tiers hold each page: HOST once its host copy is ready, DISK once
        committed to LMDB (a queued write does not count)."""
        out = []
        with self._lock:
            for key in keys:
                e = self._index.get(key.storage_key())
                tiers = set()
                if e is not None and e.host_state is HostState.READY:
                    tiers.add(Tier.HOST)
                if e is not None and e.disk_state is DiskState.READY:
                    tiers.add(Tier.DISK)
                out.append(frozenset(tiers))
        return out

    def read_cost(self, tier: Tier) -> ReadCost | None:
        """What reading from ``tier`` costs, as measured (None: not a tier that reads)."""
        for t in self._tiers:
            if t.tier is tier:
                return t.read_cost()
        return None

    def host_page_bytes(self) -> dict[ComponentType, int]:
        """Bytes of one host page, per component of the layout."""
        return {c: p.page_bytes for c, p in self._host.components.items()}

    # -- pins ----------------------------------------------------------------------------

    def pin(self, keys: Sequence[PageKey], engine_id: str, ttl_s: float) -> PinRecord | Failure:
        """Pin every page of ``keys`` (held on host or disk, or offered by a lower tier,
        which then starts reading it) for ``ttl_s``, in chunks of ``_PIN_CHUNK_KEYS`` with
        the lock released in between: what is pinned stays put meanwhile, and the other
        engines' lookups need not wait for a pin of many thousand keys. The failure
        (nothing pinned) when a page is absent, or when the pin expired while it was
        being made."""
        rec = None
        for start in range(0, max(len(keys), 1), _PIN_CHUNK_KEYS):
            if start:
                time.sleep(0)  # let a thread waiting for the lock (or the GIL) take it
            with self._lock:
                if rec is None:
                    self._expire_pins_locked()
                elif self._pins.get(rec.pin_id) is not rec:
                    return Failure.PIN_EXPIRED
                entries = []
                offered: list[PageKey] = []  # held by a lower tier only: read below
                absent = False
                get = self._index.get
                for k in keys[start : start + _PIN_CHUNK_KEYS]:
                    e = get(k.page_hash + TAGS[k.component])  # k.storage_key()
                    if e is not None and e.held:
                        entries.append(e)
                    elif self._offering(k) is not None:
                        offered.append(k)
                    else:  # absent: fail at once, a pin of many keys must not scan on
                        self._count_absent_locked(k, engine_id)
                        absent = True
                        break
                if absent or (offered and not self._fill_offered_locked(offered)):
                    if rec is not None:
                        self._pins.release(rec.pin_id)
                    return Failure.PIN_ABSENT
                entries += [get(k.storage_key()) for k in offered]
                if rec is None:
                    rec = self._pins.add(engine_id, entries, time.monotonic() + ttl_s)
                else:
                    self._pins.extend(rec, entries)
                self._index.touch_all(entries)
        return rec

    def release_engine(self, engine_id: str) -> int:
        """Release every pin of ``engine_id`` and give back the host pages handed to it for
        its own stores (it went away); returns the pins released."""
        with self._lock:
            n = self._pins.release_engine(engine_id)
            self._abort_reservations_locked(self._engine_stores.of_engine_locked(engine_id))
        for tier in self._tiers:  # a killed engine may have left LMDB readers behind
            tier.clear_stale_readers()
        return n

    def _expire_pins_locked(self) -> None:
        n = self._pins.expire(time.monotonic())
        if n:
            self._counters.add(n, "pins", "expired")

    # -- loads ---------------------------------------------------------------------------

    def start_fills(self, keys: Sequence[PageKey]) -> tuple[list[Future], bool]:
        """Start reading every page of ``keys`` that is held below host (or offered by a
        lower tier) into a host page; the futures of those reads and of fills already
        running, and whether every page is held and every read could start."""
        with self._lock:
            offered = [k for k in keys if not self.holds_locked(k) and self._offering(k)]
            ok = not offered or self._fill_offered_locked(offered)
            entries, cold = [], []
            for k in keys:
                e = self._index.get(k.storage_key())
                if e is None or not e.held:
                    ok = False
                    continue
                entries.append(e)
                if e.host_state is HostState.NONE:
                    cold.append(k)
            if cold and not self._disk.fill_locked(cold):
                ok = False
            fills = {id(e.fill): e.fill for e in entries if e.fill is not None}
        return list(fills.values()), ok

    def _offering(self, key: PageKey) -> LowerTier | None:
        """The lower tier that offers ``key`` (one the index does not hold), if any."""
        for tier in self._tiers:
            if tier.offers(key):
                return tier
        return None

    def _fill_offered_locked(self, keys: list[PageKey]) -> bool:
        """Start the fills of ``keys``, each from the tier that offers it."""
        by_tier: dict[LowerTier, list[PageKey]] = {}
        for k in keys:
            by_tier.setdefault(self._offering(k), []).append(k)
        return all(tier.fill_locked(ks) for tier, ks in by_tier.items())

    # -- backups -------------------------------------------------------------------------

    def reap_backups(self, block: bool) -> None:
        """Publish queued backups whose copies ended (all of them, waiting, with ``block``)."""
        self._fills.reap(block)

    def wait_fills(self, fills: list[Future], deadline: float | None) -> bool | None:
        """Wait for fills: True all ready, False one failed, None at ``deadline``."""
        return self._fills.wait(fills, deadline)

    def fill_handle(self, fills: list[Future], ok: bool, default_timeout_s: float) -> FillHandle:
        """A transfer handle that waits for ``fills`` (``ok`` False: one never started)."""
        return self._fills.handle(fills, ok, default_timeout_s)

    # -- host residency (lock held) ------------------------------------------------------

    def _alloc_host_locked(self, component: ComponentType) -> int | None:
        """A free host page of ``component``, evicting LRU pages as needed; None if stuck."""
        pool = self._host[component]
        page = pool.alloc()
        if page is None:
            self._expire_pins_locked()  # a lapsed pin must not keep its pages from eviction
        while page is None:
            victim = self._index.pop_victim(_HOST, component)
            if victim is None:
                return None
            self._evict_host_locked(victim)
            page = pool.alloc()
        return page

    def _evict_host_locked(self, entry: PageEntry, reason: MissReason = MissReason.EVICTED) -> int:
        """Drop ``entry``'s host page (and, for FULL, its SWA/Mamba pages on host);
        ``reason``: why, as a miss will tell it (evicted, or cleared by an admin). The
        pages dropped."""
        index = self._index
        group = [entry]
        if entry.component is _FULL:
            group = [*index.aux_in(entry, _HOST), entry]
        for e in group:
            for tier in self._tiers:
                tier.on_host_evict_locked(e)
            self._host_departure_locked(e, reason)
            self._host[e.component].free(index.clear_host(e))
            self._counters.inc("evictions", "host", _LABEL[e.component])
            if e.tenant:
                index.tenants.count(e.tenant, "evicted", "host")
            index.discard_if_unused(e)
        return len(group)

    def _drop_locked(self, key: PageKey, host_only: bool) -> None:
        """Take a page out of every tier (or only host) now, pinned or not; a page in
        flight is kept. Only fault injection uses it: it stands for a pin that lapsed and
        an eviction."""
        e = self._index.get(key.storage_key())
        if e is None or e.busy:
            return
        if e.host_state is not HostState.NONE:
            self._departed_locked(e, MissReason.EVICTED, Tier.HOST)
            self._host[e.component].free(self._index.clear_host(e))
        if not host_only and e.disk_state is DiskState.READY:
            self._departed_locked(e, MissReason.EVICTED, Tier.DISK)
            self._index.clear_disk(e)
            self._disk.delete_locked([e.skey])
        self._index.discard_if_unused(e)

    # -- state ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Entries, live pins, the host pool's and every lower tier's state."""
        with self._lock:
            self._expire_pins_locked()  # pins_active counts live pins only
            disk: dict[str, Any] = {"enabled": self._disk is not None}
            if self._disk is not None:
                disk.update(self._disk.stats())
                disk["live_bytes"] = self._index.disk_live_bytes
                disk["budget_bytes"] = self._config.disk_budget_bytes
                disk["pages"] = {component_label(c): n for c, n in self._index.disk_pages.items()}
            out = {
                "entries": len(self._index),
                "pins_active": len(self._pins),
                "host": {} if self._host is None else self._host.stats(),
                "disk": disk,
                "tenants": self._index.tenants.report(),
            }
        remote = [t for t in self._tiers if t.tier is Tier.REMOTE]
        out["remote_tier"] = remote[0].stats() if remote else {"enabled": False}
        return out

    def check_invariants(self, deep: bool = False) -> None:
        """Index, pins, host pages, queued backups and in-flight holds agree; with
        ``deep``, the lower tiers' stored pages too (flushed first: call it only while
        nothing else uses the store)."""
        if deep:
            self._fills.reap(block=True)
            if self._disk is not None:  # outside the lock: the writer settles under it
                self._disk.flush(None)
        with self._lock:
            self._index.check_invariants()
            self._pins.check_invariants()
            owned: dict[ComponentType, set[int]] = {c: set() for c in ComponentType}
            for e in self._index:
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
            if self._host is not None:
                for c, pool in self._host.components.items():
                    pool.check_invariants(owned[c])
            self._fills.check_invariants_locked()
            self._engine_stores.check_invariants_locked()
            if deep:
                ready = {e.skey for e in self._index if e.disk_state is DiskState.READY}
                queued = {e.skey for e in self._index if e.disk_state is DiskState.PENDING}
                for tier in self._tiers:
                    tier.check_invariants(ready, queued)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued backups are published and what the lower tiers have queued
        is stored (the remote tier first: its fills may queue disk writes)."""
        self._fills.reap(block=True)
        return all(tier.flush(timeout_s) for tier in reversed(self._tiers))

    def close(self, timeout_s: float) -> int:
        """Publish queued backups, store what the lower tiers must keep, drain and close
        them (the remote tier first: its fills may still queue disk writes). Returns the
        pages that were to be written to disk and are not: writes that failed or were
        rejected while closing, plus pages still queued when the writer did not drain
        within ``timeout_s`` (the remote tier counts what it drops itself)."""
        write_failures = (Failure.DISK_WRITE_ERROR, Failure.DISK_FULL)
        with self._lock:
            failed_before = sum(self._counters.get("failures", f.value) for f in write_failures)
        self._fills.reap(block=True)
        with self._lock:
            for tier in self._tiers:
                tier.on_close_locked()
        drained = True
        for tier in reversed(self._tiers):
            closed = tier.close(timeout_s)
            if tier is self._disk:
                drained = closed
        with self._lock:  # a writer still running settles pages under this lock
            failed = sum(self._counters.get("failures", f.value) for f in write_failures)
            lost = int(failed - failed_before)
            if not drained:
                unwritten = sum(1 for e in self._index if e.disk_state is DiskState.PENDING)
                log.error("controller closed with %d pages still queued for disk", unwritten)
                lost += unwritten
        return lost
