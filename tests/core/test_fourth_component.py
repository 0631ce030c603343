"""A fourth component that only the tests define (tests/support/indexer.py) runs through the
tree scenarios and the tiered state machine unchanged: the tree, the cache, the eviction
and the tiering reach it only through the component hooks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from hicache import ComponentType, Request
from hicache.config import WritePolicy
from tests.core import test_tree_scenarios as scenarios
from tests.core.test_tiers_stateful import STATEFUL_SETTINGS, LateTransferMachine
from tests.core.test_tree_scenarios import (  # noqa: F401 - collected here with this module's `case`
    test_chunked_prefill_caches_progress,
    test_eviction_is_lru_across_chains_and_tail_first,
    test_extra_key_namespaces_are_separate,
    test_insert_then_match_whole_and_prefix,
    test_lock_receipts_replay_exactly_and_refuse_double_unlock,
    test_locked_path_survives_eviction,
    test_request_slots_come_back_on_finish_without_insert,
    test_shared_prefix_insert_frees_duplicate_slots,
    test_split_keeps_values_and_locks,
    test_unaligned_and_empty_inputs,
    test_unfinished_then_finished_with_generated_tail,
)
from tests.support.cache import MIXES
from tests.support.indexer import (
    INDEXER,
    IndexerController,
    IndexerEngine,
    make_indexer_cache,
)

CASES = [(m, ps, w) for m, ps, w in scenarios.CASES if ps in (1, 4, 16)]


@pytest.fixture(params=CASES, ids=[f"{m}-p{ps}-w{w}" for m, ps, w in CASES])
def case(request):
    mix, ps, w = request.param
    cache = make_indexer_cache(mix, page_size=ps, window=w, full_slots=ps * 96, mamba_slots=48)
    assert INDEXER in cache.tree.by_type and "indexer" in cache.pools.free_counts()
    return cache, IndexerEngine(cache)


def seq(n: int, base: int = 0) -> np.ndarray:
    return scenarios.seq(n, base)


@pytest.mark.parametrize("mix", list(MIXES))
def test_an_indexer_tombstone_stops_a_match_and_eviction_asks_it_by_type(mix):
    """Evicting indexer keys by their type makes tombstones that no match may cross; the
    FULL pages under them stay cached, and the amounts come back keyed by that type."""
    ps = 4
    cache = make_indexer_cache(mix, page_size=ps, full_slots=ps * 64)
    engine = IndexerEngine(cache)
    tokens = seq(6 * ps)
    engine.run(tokens[: 3 * ps])
    engine.run(tokens)  # a second node below the first
    cache.check_invariants()
    before = cache.stats()
    freed = cache.evict(amounts={INDEXER: 1})
    cache.check_invariants()
    assert freed.get(INDEXER) >= ps
    after = cache.stats()
    assert after.evictable[INDEXER] == before.evictable[INDEXER] - freed.get(INDEXER)
    m = cache.match_prefix(tokens)
    assert m.prefix_len < tokens.size  # the indexer keys of part of the prefix are gone
    assert after.total_tokens > 0 and cache.stats().evictable[ComponentType.FULL] > 0
    req = engine.start(tokens)  # exact up to where a match may end
    cache.cache_finished_req(req, insert=False)
    cache.check_invariants()


def test_requests_are_refused_room_only_when_no_indexer_page_can_be_freed():
    """The indexer pool smaller than the FULL pool: allocating a request's pages evicts
    cached indexer keys (tombstones) first, and the request's own keys are exact."""
    ps = 4
    cache = make_indexer_cache("full", page_size=ps, full_slots=ps * 32, indexer_slots=ps * 16)
    engine = IndexerEngine(cache)
    first = seq(12 * ps)
    engine.run(first)
    second = seq(12 * ps, base=500)
    req = Request("second")
    cache.match_prefix(second, req=req)
    engine.compute(req, second, second.size)
    engine.verify_prefix(req, second, second.size)
    cache.check_invariants()
    cache.cache_finished_req(req)
    cache.check_invariants()
    assert cache.evicted.get(INDEXER) > 0


def test_an_indexer_evicted_prefix_loads_back_exactly():
    """Backed up, evicted from the device and asked for again: the indexer keys come back
    from the controller with the KV, through the same plan/prepare/finalize hooks."""
    ps = 4
    ctrl = IndexerController()
    cache = make_indexer_cache("full+swa+mamba", page_size=ps, window=6, controller=ctrl)
    engine = IndexerEngine(cache)
    tokens = seq(8 * ps)
    engine.run(tokens)
    cache.flush_backups()
    cache.evict(full_tokens=10**9)
    cache.check_invariants()
    assert any(key.component == INDEXER for key in ctrl.pages)
    req = Request("again")
    m = cache.match_prefix(tokens, req=req)
    assert m.prefix_len == 0 and m.host_hit_len == tokens.size
    assert cache.load_back(m.load_node, req=req)
    cache.check_invariants()
    engine.verify_prefix(req, tokens, tokens.size)
    cache.cache_finished_req(req)
    cache.check_invariants()


class IndexerLateTransferMachine(LateTransferMachine):
    """The late-transfer tiered state machine, with the indexer as a fourth component."""

    @initialize(
        mix=st.sampled_from(list(MIXES)),
        ps=st.sampled_from([1, 4, 16]),
        window_pages=st.sampled_from([0.5, 1, 2.5, 4]),
        pool_pages=st.integers(12, 40),
        half_indexer_pool=st.booleans(),
        write_policy=st.sampled_from(list(WritePolicy)),
        late_backups=st.sampled_from([0, 2, 10**9]),
    )
    def setup(
        self, mix, ps, window_pages, pool_pages, half_indexer_pool, write_policy, late_backups
    ):
        ctrl = IndexerController()
        ctrl.late_backups = late_backups
        self.flushes = 0
        self.indexer_slots = ps * (pool_pages // 2) if half_indexer_pool else None
        self.start_cache(
            ctrl,
            mix,
            ps,
            window=max(1, int(ps * window_pages)),
            full_slots=ps * pool_pages,
            write_policy=write_policy,
        )

    engine_class = IndexerEngine

    def make_cache(self, *args, **kwargs):
        return make_indexer_cache(*args, indexer_slots=self.indexer_slots, **kwargs)

    @rule(tokens=st.integers(1, 64))
    def evict_indexer(self, tokens):
        """Indexer keys asked by their type: what the result counts left the device."""
        before = self.cache.stats()
        freed = self.cache.evict(amounts={INDEXER: tokens})
        after = self.cache.stats()
        held = before.evictable[INDEXER] + before.protected[INDEXER]
        assert held - after.evictable[INDEXER] - after.protected[INDEXER] >= freed.get(INDEXER)

    def dirty(self) -> bool:
        return super().dirty() or self.cache.evicted.get(INDEXER) > 0


IndexerLateTransferMachine.TestCase.settings = STATEFUL_SETTINGS
test_indexer_late_transfer_stateful = IndexerLateTransferMachine.TestCase
