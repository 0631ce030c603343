"""Random workloads over the tree and a real LocalController (host pool + LMDB), with
faults injected at every load and backup stage: invariants of both after every step,
exact data on every hit, nothing leaked at the end. Two variants: sliding windows of
several pages over an SWA pool smaller than the FULL pool (loads that fill SWA tombstones
under pressure), and a controller whose transfers settle late (copies that still read or
write device pages after the cache stopped waiting for them)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from hicache import ComponentType, MatchResult, Request
from hicache.config import EvictionPolicyKind, PrefetchPolicy, WritePolicy
from hicache.controller.config import ControllerConfig
from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.local import LocalController
from hicache.learned_eviction import LearnedPolicyParams
from hicache.node import TreeNode
from hicache.types import PoolExhaustedError
from tests.core.test_tree_stateful import PREFIXES, Model, TreeMachine
from tests.support.cache import MIXES, MarkerEngine, make_cache
from tests.support.fake_controller import FAULTS as FAKE_FAULTS
from tests.support.fake_controller import FakeController

FAULTS = ["pin", "copy_to_device", "copy_to_host", "evict_before_load", "disk_read"]
ALL = 10**9
WINDOW_NS = "window"  # the namespace that only load_window_under_swa_pressure caches into


class TieredMachine(TreeMachine):
    # What the machine builds its cache with and drives it by (a subclass may swap both).
    make_cache = staticmethod(make_cache)
    engine_class = MarkerEngine

    @initialize(
        mix=st.sampled_from(list(MIXES)),
        ps=st.sampled_from([1, 4, 16]),
        window_pages=st.sampled_from([0.5, 1, 2.5]),
        pool_pages=st.integers(8, 40),
        write_policy=st.sampled_from(list(WritePolicy)),
        host_kib=st.sampled_from([16, 64, 1024]),
        # 1: every page of a backup is a part of its own (a failed copy keeps the parts
        # before it); 0: one copy per component.
        backup_chunk=st.sampled_from([1, 4096, 0]),
        # The learned device policy: a sample of 1 evicts a page-sized quantum per pick
        # and cuts returning chains into pieces; 64 ranks every leaf of these small pools.
        eviction=st.sampled_from([("lru", 64), ("learned", 1), ("learned", 64)]),
    )
    def setup(
        self, mix, ps, window_pages, pool_pages, write_policy, host_kib, backup_chunk, eviction
    ):
        self.start_cache(
            self.local_controller(host_kib, backup_chunk),
            mix,
            ps,
            window=max(1, int(ps * window_pages)),
            full_slots=ps * pool_pages,
            write_policy=write_policy,
            eviction=eviction,
        )

    def local_controller(self, host_kib: int, backup_chunk: int) -> LocalController:
        self.tmp = tempfile.mkdtemp(prefix="hicache-stateful-")
        return LocalController(
            ControllerConfig(
                host_pool_bytes=host_kib << 10,
                disk_path=self.tmp,
                disk_budget_bytes=4 << 20,
                backup_chunk_bytes=backup_chunk,
            )
        )

    def start_cache(
        self, ctrl, mix, ps, window, full_slots, write_policy, swa_slots=None, eviction=("lru", 64)
    ):
        self.ctrl = ctrl
        policy, sample = eviction
        self.cache = self.make_cache(
            mix,
            page_size=ps,
            window=window,
            full_slots=full_slots,
            swa_slots=swa_slots,
            mamba_slots=12,
            controller=ctrl,
            write_policy=write_policy,
            prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
            load_timeout_s=5.0,
            eviction_policy=EvictionPolicyKind(policy),
            eviction_sample_size=sample,
        )
        if policy == "learned":  # quanta of one page, so that cuts happen in small pools
            self.cache.tree.leaf_policy.params = LearnedPolicyParams(evict_quantum_tokens=ps)
        self.engine = self.engine_class(self.cache)
        self.model = Model(ps, self.cache.mamba is not None)
        self.swa_released = False
        self.receipts = []

    @rule(fault=st.sampled_from(FAULTS))
    def arm_fault(self, fault):
        plan = self.ctrl.faults or FaultPlan()
        setattr(plan, fault, getattr(plan, fault) + 1)
        self.ctrl.faults = plan

    @rule(
        first=st.tuples(st.integers(0, 3), st.integers(1, 6)),
        second=st.tuples(st.integers(0, 3), st.integers(1, 6)),
    )
    def match_both_then_load(self, first, second):
        """Two requests match before either loads back (a scheduler batching its
        admissions): the second match may make the tree forget what the first one was
        told to load. Each load-back is exact or a clean miss."""
        started = []
        try:
            for prefix, pages in (first, second):
                tokens = self.tokens(prefix, [], pages)
                req = Request(rid=f"batched-{len(started)}")
                m = self.cache.match_prefix(tokens, req=req)
                started.append((req, m, tokens))
            for req, m, tokens in reversed(started):
                if m.load_node is not None:
                    self.cache.load_back(m.load_node, req=req)
                self.cache.check_invariants()
                self.engine.verify_prefix(req, tokens, req.prefix_len)
        except PoolExhaustedError:
            pass
        finally:
            for req, _, _ in started:
                self.cache.cache_finished_req(req, insert=False)

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        held_pages=st.integers(1, 3),
        gap=st.integers(0, 4),
        extra_pages=st.integers(0, 2),
        swa_pages=st.sampled_from([1, ALL, ALL]),
        states=st.sampled_from([0, ALL, ALL]),
        shortfall_pages=st.sampled_from([0, 1, 1, 2]),
    )
    def load_window_under_swa_pressure(
        self, prefix, held_pages, gap, extra_pages, swa_pages, states, shortfall_pages
    ):
        """A conversation cached page by page; SWA evicted while one reader holds its head
        and another a longer prefix (SWA tombstones form between their windows, kept on
        the device by the longer one); Mamba states evicted (ALL: no state ends a match
        early). A prefix whose window reaches back into the head is matched, the SWA pool
        is filled until ``shortfall_pages`` are missing for its load, and it is loaded
        back: the eviction that makes room must not take the SWA pages of the window that
        the load completes."""
        ps = self.cache.page_size
        window_pages = -(-(self.cache.config.sliding_window or ps) // ps)
        # The load ends less than a window after the head; the longer prefix's window
        # starts after the head's end.
        pages = held_pages + 1 + gap % max(1, window_pages - 1)
        deeper_pages = held_pages + window_pages - pages + 1 + extra_pages
        self.serve_whole_requests([(prefix, [], pages + deeper_pages, WINDOW_NS, 1)])
        self.settle_backups()  # the host holds what the tombstones below will lack
        tokens = self.tokens(prefix, [], pages + deeper_pages)
        longer = self.cache.lock(self.device_node(tokens, WINDOW_NS))
        head = self.cache.lock(self.device_node(tokens[: held_pages * ps], WINDOW_NS))
        self.cache.evict(swa_tokens=swa_pages * ps)
        self.cache.unlock(head)
        self.cache.evict(mamba_states=states)
        tokens = tokens[: pages * ps]
        req, hog = Request(rid="window-load", extra_key=WINDOW_NS), Request(rid="swa-hog")
        started = []
        try:
            m = self.cache.match_prefix(tokens, WINDOW_NS, req=req)
            started.append(req)
            if m.load_node is not None:
                need, above_tombstone = self.swa_pages_to_load(m)
                event(f"window load over an SWA tombstone: {above_tombstone}")
                self.cache.match_prefix(tokens[:0], req=hog)
                started.append(hog)
                pools = self.cache.pools
                if pools.swa is not None:
                    free = min(pools.swa.available(), pools.full.available())
                    take = free - max(0, need - shortfall_pages) * ps
                    if take > 0:
                        self.cache.alloc_tokens(hog, take)
                self.cache.load_back(m.load_node, req=req)
            self.cache.check_invariants()
            self.engine.verify_prefix(req, tokens, req.prefix_len)
        except PoolExhaustedError:
            pass
        finally:
            for r in started:
                self.cache.cache_finished_req(r, insert=False)
            self.cache.unlock(longer)

    def device_node(self, tokens: np.ndarray, ns: str | None) -> TreeNode:
        """The deepest node on the device within ``tokens``' path in ``ns`` (whatever its
        Mamba state, unlike a match): what a request reading that prefix holds."""
        node = self.cache.tree.namespace_root(ns)
        if node is None:
            return self.cache.match_prefix(tokens[:0]).last_node
        for n in self.cache.tree.walk(node, tokens.tobytes())[0]:
            if n.data[0].value is None:
                break
            node = n
        return node

    def swa_pages_to_load(self, m: MatchResult) -> tuple[int, bool]:
        """The SWA pages a load-back of ``m`` brings (the SWA-less nodes of the window
        ending at ``m.load_node``, below the match), and whether SWA pages that the match
        does not lock lie above an SWA tombstone on the device there (the load's lock of
        the deepest device node stops at that tombstone)."""
        swa = self.cache.tree.by_type.get(ComponentType.SWA)
        if swa is None:
            return 0, False
        start = max(swa.window_start(m.load_node.end), m.last_node.end)
        node, need, tombstone, above = m.load_node, 0, False, False
        while node.parent is not None and node.end > start:
            if node.data[swa.idx].value is None:
                need += node.end - max(node.start, start)
                tombstone |= node.data[0].value is not None
            else:
                above |= tombstone
            node = node.parent
        return need // self.cache.page_size, above

    @rule()
    def settle_backups(self):
        self.cache.flush_backups(10.0)

    @rule()
    def evict_all_device(self):
        self.cache.evict(full_tokens=10**9)

    @invariant()
    def controller_consistent(self):
        if hasattr(self, "ctrl"):
            self.check_controller()

    def check_controller(self):
        self.ctrl.check_invariants()

    def quiet_controller(self):
        """No more injected faults: the teardown's own transfers must succeed."""
        self.ctrl.faults = None

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        counters = self.cache.counters
        event(f"loaded back: {counters['loaded_tokens'] > 0}")
        event(f"failed load-back: {counters['load_back_failed'] > 0}")
        try:
            self.quiet_controller()
            super().teardown()
            self.check_controller()
        finally:
            self.ctrl.close()
            if hasattr(self, "tmp"):
                shutil.rmtree(self.tmp, ignore_errors=True)


class SWAPressureMachine(TieredMachine):
    """The tiered machine with sliding windows of several pages and an SWA pool smaller
    than the FULL pool: loads fill SWA tombstones inside their windows while the SWA pool
    must be evicted to make room for them."""

    @initialize(
        mix=st.sampled_from(["full+swa+mamba", "full+swa+mamba", "full+swa"]),
        ps=st.sampled_from([1, 4]),
        window_pages=st.integers(3, 6),
        pool_pages=st.integers(24, 40),
        swa_pages=st.integers(10, 16),
        # Write-through mostly: the other policies copy nothing at an SWA tombstone
        # (write-back only when a node leaves the device), so no load could fill one.
        write_policy=st.sampled_from([*WritePolicy, *[WritePolicy.WRITE_THROUGH] * 2]),
    )
    def setup(self, mix, ps, window_pages, pool_pages, swa_pages, write_policy):
        self.start_cache(
            self.local_controller(host_kib=1024, backup_chunk=4096),
            mix,
            ps,
            window=ps * window_pages,
            full_slots=ps * pool_pages,
            swa_slots=ps * swa_pages,
            write_policy=write_policy,
        )


class LateTransferMachine(TieredMachine):
    """The tiered machine over a FakeController whose transfers settle late (a sidecar
    that has not answered): an armed backup stays not done, its waits timing out, until a
    rule settles it, and reads the device pages only then (checking that they were kept);
    an armed load gives up with a LoadOutcome whose copy writes garbage into the load's
    slots when it settles. Every live request's data is checked after every step, so
    slots handed out while a copy may still write into them, or pages freed while a backup
    may still read them, show as wrong data."""

    @initialize(
        mix=st.sampled_from(list(MIXES)),
        ps=st.sampled_from([1, 4, 16]),
        window_pages=st.sampled_from([0.5, 1, 2.5, 4]),
        pool_pages=st.integers(12, 40),
        half_swa_pool=st.booleans(),
        write_policy=st.sampled_from(list(WritePolicy)),
        late_backups=st.sampled_from([0, 2, ALL]),
    )
    def setup(self, mix, ps, window_pages, pool_pages, half_swa_pool, write_policy, late_backups):
        ctrl = FakeController()
        ctrl.late_backups = late_backups
        self.flushes = 0
        self.start_cache(
            ctrl,
            mix,
            ps,
            window=max(1, int(ps * window_pages)),
            full_slots=ps * pool_pages,
            swa_slots=ps * (pool_pages // 2) if half_swa_pool else None,
            write_policy=write_policy,
        )

    @rule(fault=st.sampled_from([None, None, *FAKE_FAULTS]))
    def arm_fault(self, fault):
        """Every load fails this way until another fault (or None) is armed."""
        self.ctrl.fault = fault

    @rule(n=st.integers(1, 3))
    def arm_late_backups(self, n):
        self.ctrl.late_backups += n

    @rule()
    def arm_late_load(self):
        self.ctrl.late_loads += 1

    @rule(
        target=TreeMachine.requests,
        prefix=st.integers(0, len(PREFIXES) - 1),
        pages=st.integers(1, 5),
        chunk_pages=st.integers(1, 3),
        settle_after=st.booleans(),
    )
    def reload_with_late_copy(self, prefix, pages, chunk_pages, settle_after):
        """A prefix cached, backed up and evicted from the device; a request for it whose
        load-back gives up on a copy that will write into the slots it was given when it
        settles. The request recomputes the prefix (into other slots) and lives on; with
        ``settle_after`` the copy lands right after that, else at a later settle."""
        since = len(self.ctrl.unsettled)
        self.serve_whole_requests([(prefix, [], pages, None, chunk_pages)])
        self.ctrl.settle(since=since)
        self.cache.evict(full_tokens=ALL)
        self.ctrl.settle(since=since)  # write-back copies taken at the eviction
        armed, self.ctrl.late_loads = self.ctrl.late_loads, 1
        try:
            req = self.start(prefix, [], pages, None)
        finally:
            self.ctrl.late_loads = armed
        if req is not None:
            with contextlib.suppress(PoolExhaustedError):
                self.engine.compute(req, req.full_tokens, req.full_tokens.size)
        if settle_after:
            self.ctrl.settle(since=since)
        self.cache.poll_transfers()
        return req

    @rule(
        target=TreeMachine.requests,
        prefix=st.integers(0, len(PREFIXES) - 1),
        shift=st.integers(1, len(PREFIXES) - 1),
        pages=st.integers(1, 5),
    )
    def flush_while_backups_run(self, prefix, shift, pages):
        """A prefix cached (in a namespace of its own, so that all of it is backed up)
        while its backups run late; a flush whose waits time out, an eviction of
        everything evictable, another conversation computed (into whatever was freed);
        then the late copies run and the prefix is asked for again. A flush must keep
        what an unfinished backup reads, or the backup stores other KV under the prefix's
        hashes."""
        self.flushes += 1
        ns = f"flush-{self.flushes}"
        since = len(self.ctrl.unsettled)
        armed, self.ctrl.late_backups = self.ctrl.late_backups, ALL
        try:
            self.serve_whole_requests([(prefix, [], pages, ns, 1)])
            self.cache.flush_backups(0.0)
            self.cache.evict(full_tokens=ALL)
        finally:
            self.ctrl.late_backups = armed
        other = (prefix + shift) % len(PREFIXES)
        self.serve_whole_requests([(other, [], pages, None, 1)])
        self.ctrl.settle(since=since)
        self.cache.poll_transfers()
        return self.start(prefix, [], pages, ns)

    @rule(pick=st.one_of(st.none(), st.integers(0, 7)), ok=st.sampled_from([True, True, False]))
    def settle_transfer(self, pick, ok):
        """One late copy (None: every one) runs now or fails: a backup reads its device
        pages then, a load writes garbage into its slots."""
        if self.ctrl.settle(pick, ok):
            self.cache.poll_transfers()

    @rule()
    def settle_backups(self):
        """A flush whose waits time out: backups not done must keep their pages."""
        self.cache.flush_backups(0.0)

    @rule(full=st.integers(0, 64), swa=st.integers(0, 64), mamba=st.integers(0, 4))
    def evict(self, full, swa, mamba):
        """As TreeMachine's, except that pages a write-back's unsettled copy may still read
        go to the quarantine and do not count as freed: what left the device is checked."""
        before = self.cache.stats()
        self.cache.evict(full, swa, mamba)
        after = self.cache.stats()
        for ctype, asked in ((ComponentType.FULL, full), (ComponentType.MAMBA, mamba)):
            if ctype in before.evictable and asked <= before.evictable[ctype]:
                held_before = before.evictable[ctype] + before.protected[ctype]
                assert held_before - after.evictable[ctype] - after.protected[ctype] >= asked

    def dirty(self) -> bool:
        # A write-back's quarantined pages left the tree without counting as evicted.
        return super().dirty() or self.cache.counters["write_back_quarantined"] > 0

    @invariant()
    def requests_hold_their_data(self):
        if not hasattr(self, "cache"):
            return
        for req in self.cache.requests.values():
            tokens = getattr(req, "full_tokens", None)
            if tokens is not None:
                self.engine.verify_prefix(req, tokens, req.computed_len)

    def check_controller(self):
        assert not self.ctrl.pins, "a load-back left its pages pinned"

    def quiet_controller(self):
        self.ctrl.fault = None
        self.ctrl.late_backups = 0
        self.ctrl.late_loads = 0
        self.ctrl.settle()
        self.cache.poll_transfers()


STATEFUL_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TieredMachine.TestCase.settings = STATEFUL_SETTINGS
test_tiers_stateful = TieredMachine.TestCase
SWAPressureMachine.TestCase.settings = STATEFUL_SETTINGS
test_swa_pressure_stateful = SWAPressureMachine.TestCase
LateTransferMachine.TestCase.settings = STATEFUL_SETTINGS
test_late_transfer_stateful = LateTransferMachine.TestCase
