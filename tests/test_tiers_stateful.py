"""Random workloads over the tree and a real LocalController (host pool + LMDB), with
faults injected at every load and backup stage: invariants of both after every step,
exact data on every hit, nothing leaked at the end."""

from __future__ import annotations

import shutil
import tempfile

from cache_support import MIXES, MarkerEngine, make_cache
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from test_tree_stateful import Model, TreeMachine

from hicache import Request
from hicache.config import PrefetchPolicy, WritePolicy
from hicache.controller.config import ControllerConfig
from hicache.controller.faults import FaultPlan
from hicache.controller.local import LocalController
from hicache.types import PoolExhaustedError

FAULTS = ["pin", "copy_to_device", "copy_to_host", "evict_before_load", "disk_read"]


class TieredMachine(TreeMachine):
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
    )
    def setup(self, mix, ps, window_pages, pool_pages, write_policy, host_kib, backup_chunk):
        self.tmp = tempfile.mkdtemp(prefix="hicache-stateful-")
        self.ctrl = LocalController(
            ControllerConfig(
                host_pool_bytes=host_kib << 10,
                disk_path=self.tmp,
                disk_budget_bytes=4 << 20,
                backup_chunk_bytes=backup_chunk,
            )
        )
        window = max(1, int(ps * window_pages))
        self.cache = make_cache(
            mix,
            page_size=ps,
            window=window,
            full_slots=ps * pool_pages,
            mamba_slots=12,
            controller=self.ctrl,
            write_policy=write_policy,
            prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
            load_timeout_s=5.0,
        )
        self.engine = MarkerEngine(self.cache)
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

    @rule()
    def settle_backups(self):
        self.cache.flush_backups(10.0)

    @rule()
    def evict_all_device(self):
        self.cache.evict(full_tokens=10**9)

    @invariant()
    def controller_consistent(self):
        if hasattr(self, "ctrl"):
            self.ctrl.check_invariants()

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        counters = self.cache.counters
        event(f"loaded back: {counters['loaded_tokens'] > 0}")
        event(f"failed load-back: {counters['load_back_failed'] > 0}")
        try:
            self.ctrl.faults = None
            super().teardown()
            self.ctrl.check_invariants()
        finally:
            self.ctrl.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


TieredMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_tiers_stateful = TieredMachine.TestCase
