"""Load-back through the component hooks: exact on success, and on every failure the
pools and the request are exactly as before (ARCHITECTURE §4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache import ComponentType, Request
from hicache.config import PrefetchPolicy, WritePolicy
from tests.support.cache import MIXES, MarkerEngine, make_cache
from tests.support.fake_controller import FAULTS, FakeController


def seq(n: int, base: int = 0) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 13 + base) % 991 + 1


def demoted_cache(mix: str, ps: int, window: int = 6, **config):
    """A cache whose only prefix was backed up and then evicted from the device."""
    ctrl = FakeController()
    cache = make_cache(
        mix, page_size=ps, window=window, full_slots=ps * 64, controller=ctrl, **config
    )
    engine = MarkerEngine(cache)
    tokens = seq(6 * ps)
    engine.run(tokens)
    cache.flush_backups()
    cache.evict(full_tokens=10**6)
    cache.check_invariants()
    assert cache.stats().total_tokens == 0 and cache.stats().host_only_tokens == tokens.size
    return cache, engine, ctrl, tokens


def scribble(cache) -> None:
    """Overwrite every device pool, so that only a real copy can restore markers."""
    cache.pools.full.buffer.fill_(-7.0)
    if cache.pools.swa is not None:
        cache.pools.swa.buffer.fill_(-7.0)


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_host_hit_loads_back_bit_exact(mix, ps):
    cache, engine, ctrl, tokens = demoted_cache(mix, ps)
    scribble(cache)
    req = Request("r")
    m = cache.match_prefix(tokens, req=req)
    assert m.prefix_len == 0 and m.host_hit_len == tokens.size and m.load_node is not None
    assert cache.load_back(m.load_node, req=req)
    cache.check_invariants()
    assert req.prefix_len == tokens.size
    engine.verify_prefix(req, tokens, req.prefix_len)
    cache.cache_finished_req(req)
    cache.check_invariants()
    # Loaded nodes are device nodes again (a finished request that computed nothing more
    # hands its copy of the state back to the end node): the next request hits on device.
    assert cache.match_prefix(tokens).prefix_len == tokens.size


@pytest.mark.parametrize("ps", [1, 4])
def test_a_sibling_of_a_loaded_hybrid_prefix_hits_it_on_the_device(ps):
    """A load-back for a request leaves the prefix's Mamba state on the device as well
    (from a free slot): a second request with the same prefix, arriving while the first
    still runs, is a device hit, and each request works on its own state."""
    cache, engine, ctrl, tokens = demoted_cache("full+mamba", ps)
    scribble(cache)
    first = Request("first")
    m = cache.match_prefix(tokens, req=first)
    assert cache.load_back(m.load_node, req=first)
    cache.check_invariants()
    second = Request("second")
    again = cache.match_prefix(tokens, req=second)
    assert again.prefix_len == tokens.size and again.load_node is None
    assert second.mamba_slot is not None and second.mamba_slot != first.mamba_slot
    for req in (first, second):
        engine.verify_prefix(req, tokens, req.prefix_len)
    cache.check_invariants()
    for req in (first, second):
        cache.cache_finished_req(req)
        cache.check_invariants()
    assert cache.match_prefix(tokens).prefix_len == tokens.size


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("mix", list(MIXES))
def test_failed_load_back_leaves_pools_and_request_as_they_were(fault, mix):
    ps = 4
    cache, engine, ctrl, tokens = demoted_cache(mix, ps)
    # The request holds a device prefix of its own first: a shorter cached sequence.
    engine.run(tokens[: 2 * ps])
    req = Request("r")
    m = cache.match_prefix(tokens, req=req)
    assert m.prefix_len == 2 * ps and m.load_node is not None
    before_free = cache.pools.free_counts()
    before = (req.kv_slots.copy(), req.prefix_len, req.mamba_slot, req.last_node)
    state = None
    if req.mamba_slot is not None:
        state = cache.pools.mamba.conv[:, req.mamba_slot].clone()
    ctrl.fault = fault
    assert cache.load_back(m.load_node, req=req) is False
    cache.check_invariants()
    assert cache.pools.free_counts() == before_free
    assert np.array_equal(req.kv_slots, before[0])
    assert (req.prefix_len, req.mamba_slot, req.last_node) == before[1:]
    if state is not None:
        assert torch.equal(cache.pools.mamba.conv[:, req.mamba_slot], state)
    engine.verify_prefix(req, tokens, req.prefix_len)
    assert not ctrl.pins, "a failed load-back left pages pinned"
    assert cache.counters["load_back_failed"] == 1
    # The request carries on: it recomputes the rest and finishes without leaking.
    engine.compute(req, tokens, tokens.size)
    cache.cache_finished_req(req)
    cache.check_invariants()
    cache.reset()
    assert cache.pools.free_counts() == {p.name: p.capacity for p in cache.pools.all()}


def test_pool_exhaustion_during_prepare_is_a_clean_miss():
    cache, engine, ctrl, tokens = demoted_cache("full+swa", 4)
    holders = []
    while cache.pools.full.available() >= 4:  # fill the pool with live requests
        r = Request(len(holders))
        cache.match_prefix(seq(4, base=500 + len(holders)), req=r)
        cache.alloc_tokens(r, 4)
        holders.append(r)
    req = Request("r")
    m = cache.match_prefix(tokens, req=req)
    before = cache.pools.free_counts()
    assert cache.load_back(m.load_node, req=req) is False
    assert cache.counters["load_back_failed_PoolExhaustedError"] == 1
    assert cache.pools.free_counts() == before
    cache.check_invariants()
    for r in [*holders, req]:
        cache.cache_finished_req(r, insert=False)
    cache.check_invariants()


def test_quota_caps_the_load():
    cache, engine, ctrl, tokens = demoted_cache("full", 4)
    req = Request("r")
    m = cache.match_prefix(tokens, req=req)
    assert cache.load_back(m.load_node, req=req, mem_quota=tokens.size - 4) is False
    assert ctrl.loads == 0
    assert cache.load_back(m.load_node, req=req, mem_quota=tokens.size) is True
    cache.cache_finished_req(req)
    cache.check_invariants()


@pytest.mark.parametrize("mix", list(MIXES))
def test_write_through_backs_up_a_prefix_from_the_root(mix):
    ctrl = FakeController()
    cache = make_cache(mix, page_size=4, full_slots=256, controller=ctrl)
    engine = MarkerEngine(cache)
    engine.run(seq(12))
    engine.run(np.concatenate([seq(12), seq(8, base=3)]))
    cache.flush_backups()
    for node in cache.tree.iter_nodes():
        if node.data[0].backed:
            assert node.parent.parent is None or node.parent.data[0].backed
        assert node.data[0].backed
    cache.check_invariants()


def test_write_back_backs_up_exactly_at_eviction():
    ctrl = FakeController()
    cache = make_cache(
        "full+mamba", page_size=4, controller=ctrl, write_policy=WritePolicy.WRITE_BACK
    )
    engine = MarkerEngine(cache)
    tokens = seq(16)
    engine.run(tokens)
    assert ctrl.backups == 0 and not ctrl.pages
    cache.evict(full_tokens=1)
    assert ctrl.backups == 1
    assert {k.component for k in ctrl.pages} == {ComponentType.FULL, ComponentType.MAMBA}
    m = cache.match_prefix(tokens)
    assert m.host_hit_len == tokens.size
    cache.check_invariants()


def test_selective_write_through_waits_for_hits():
    ctrl = FakeController()
    cache = make_cache(
        "full",
        page_size=4,
        controller=ctrl,
        write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE,
        write_through_threshold_hits=2,
    )
    engine = MarkerEngine(cache)
    tokens = seq(16)
    engine.run(tokens)
    cache.match_prefix(tokens)
    assert not ctrl.pages
    cache.match_prefix(tokens)
    cache.flush_backups()
    assert len(ctrl.pages) == 4
    cache.check_invariants()


def test_failed_backup_keeps_the_node_unbacked_and_evicts_it_whole():
    ctrl = FakeController()
    ctrl.fail_backups = True
    cache = make_cache("full", page_size=4, controller=ctrl)
    engine = MarkerEngine(cache)
    engine.run(seq(16))
    cache.flush_backups()
    assert cache.counters["backup_failed"] == 1
    cache.evict(full_tokens=16)
    cache.check_invariants()
    assert cache.stats().num_nodes == 0  # no host-only node left behind


@pytest.mark.parametrize("policy", list(PrefetchPolicy))
def test_disk_hits_follow_the_prefetch_policy(policy):
    cache, engine, ctrl, tokens = demoted_cache("full+mamba", 4, prefetch_policy=policy)
    ctrl.on_disk = set(ctrl.pages)
    req = Request("r")
    m = cache.match_prefix(tokens, req=req)
    assert m.host_hit_len == 0 and m.disk_hit_len == tokens.size
    assert ctrl.prefetched or policy is PrefetchPolicy.WAIT_COMPLETE
    if policy is PrefetchPolicy.BEST_EFFORT:
        assert m.load_node is None  # nothing on host yet; the prefetch serves next time
        cache.cache_finished_req(req, insert=False)
        req = Request("r2")
        m = cache.match_prefix(tokens, req=req)
        assert m.host_hit_len == tokens.size
    assert cache.load_back(m.load_node, req=req)
    engine.verify_prefix(req, tokens, req.prefix_len)
    cache.cache_finished_req(req)
    cache.check_invariants()


def test_remote_pages_beyond_the_tree_are_found_and_loaded():
    """Pages another engine backed up (or a previous life of this one) are hits even when
    this tree has never seen them."""
    cache, engine, ctrl, tokens = demoted_cache("full+swa+mamba", 4)
    fresh = make_cache("full+swa+mamba", page_size=4, window=6, full_slots=256, controller=ctrl)
    eng2 = MarkerEngine(fresh)
    req = Request("r")
    m = fresh.match_prefix(tokens, req=req)
    assert m.host_hit_len == tokens.size
    assert fresh.load_back(m.load_node, req=req)
    eng2.verify_prefix(req, tokens, req.prefix_len)
    fresh.cache_finished_req(req)
    fresh.check_invariants()


def test_host_only_nodes_are_bounded_and_forgotten_when_their_pages_are_gone():
    ctrl = FakeController()
    cache = make_cache(
        "full", page_size=4, full_slots=256, controller=ctrl, max_host_only_tokens=40
    )
    engine = MarkerEngine(cache)
    prompts = [seq(16, base=100 * i) for i in range(6)]
    for p in prompts:
        engine.run(p)
        cache.evict(full_tokens=10**6)
        cache.check_invariants()
        assert cache.stats().host_only_tokens <= 40
    # The oldest were forgotten by the tree, yet the controller still finds them.
    assert cache.match_prefix(prompts[0]).host_hit_len == 16
    # A page the controller lost makes its host-only node go away at the next lookup.
    newest = prompts[-1]
    assert cache.match_prefix(newest).host_hit_len == 16
    ctrl.pages.clear()
    m = cache.match_prefix(newest)
    assert m.host_hit_len == 0 and m.load_node is None
    cache.check_invariants()
    assert cache.stats().host_only_tokens < 40


@pytest.mark.parametrize("mix", ["full", "full+swa+mamba"])
@pytest.mark.parametrize("ps", [1, 4])
def test_room_made_for_a_load_back_never_forgets_the_prefix_being_loaded(mix, ps):
    """Making room for a load evicts device prefixes to the host tier; the record of
    host-only prefixes then overflows and its least recently used leaves are forgotten.
    The prefix being loaded is such a leaf: it must survive, load and be exact."""
    ctrl = FakeController()
    cache = make_cache(
        mix,
        page_size=ps,
        window=max(1, ps // 2),
        full_slots=ps * 8,
        controller=ctrl,
        max_host_only_tokens=6 * ps,
    )
    engine = MarkerEngine(cache)
    a, b = seq(6 * ps), seq(6 * ps, base=400)
    engine.run(a)
    cache.flush_backups()
    cache.evict(full_tokens=10**6)  # a: host-only, the oldest record
    engine.run(b)  # b: on the device, backed up
    cache.flush_backups()
    cache.check_invariants()
    scribble(cache)
    req = Request("r")
    m = cache.match_prefix(a, req=req)
    assert m.prefix_len == 0 and m.host_hit_len == a.size
    # The load needs 6 pages of 8 with b holding 6: b goes to the host, the host-only
    # record reaches 12 pages of 6 allowed, and a is the least recently used leaf.
    assert cache.load_back(m.load_node, req=req)
    cache.check_invariants()
    assert req.prefix_len == a.size
    engine.verify_prefix(req, a, req.prefix_len)
    cache.cache_finished_req(req)
    cache.check_invariants()
    cache.reset()
    assert cache.pools.free_counts() == {p.name: p.capacity for p in cache.pools.all()}


@pytest.mark.parametrize("mix", list(MIXES))
def test_a_prepare_that_raises_after_allocating_keeps_nothing(mix, monkeypatch):
    cache, engine, ctrl, tokens = demoted_cache(mix, 4)
    req = Request("r")
    m = cache.match_prefix(tokens, req=req)
    before = cache.pools.free_counts()

    def broken(*args, **kwargs):
        raise RuntimeError("injected: page refs failed")

    for comp in cache.tree.components:
        monkeypatch.setattr(comp, "page_refs", broken)
        monkeypatch.setattr(comp, "state_ref", broken, raising=False)
    assert cache.load_back(m.load_node, req=req) is False
    assert cache.counters["load_back_failed_RuntimeError"] == 1
    assert cache.pools.free_counts() == before
    assert not ctrl.pins
    cache.check_invariants()


def test_a_prefix_dropped_while_room_is_made_fails_the_load_cleanly(monkeypatch):
    cache, engine, ctrl, tokens = demoted_cache("full+mamba", 4)
    req = Request("r")
    m = cache.match_prefix(tokens, req=req)
    before = cache.pools.free_counts()
    make_room = cache.loader.make_room
    top = m.load_node
    while top.parent.parent is not None and top.parent.base.value is None:
        top = top.parent

    def make_room_and_drop(need):  # as if the controller reported the pages lost
        make_room(need)
        cache.tree.remove_subtree(top)

    monkeypatch.setattr(cache.loader, "make_room", make_room_and_drop)
    assert cache.load_back(m.load_node, req=req) is False
    assert cache.counters["load_back_failed_evicted"] == 1
    assert cache.pools.free_counts() == before
    assert not ctrl.pins
    cache.check_invariants()


@pytest.mark.parametrize("mix", ["full", "full+swa+mamba"])
def test_a_hit_beyond_the_tree_larger_than_the_host_only_record_still_loads(mix):
    """After a restart the tree is empty and the controller holds a prefix longer than
    the tree may record as host-only: the match must not forget the node it returns."""
    ps = 4
    ctrl = FakeController()
    engine = MarkerEngine(
        make_cache(mix, page_size=ps, window=6, full_slots=ps * 64, controller=ctrl)
    )
    tokens = seq(6 * ps)
    engine.run(tokens)
    engine.cache.flush_backups()
    cache = make_cache(
        mix,
        page_size=ps,
        window=6,
        full_slots=ps * 64,
        controller=ctrl,
        max_host_only_tokens=2 * ps,
    )
    engine = MarkerEngine(cache)
    req = Request("r")
    m = cache.match_prefix(tokens, req=req)
    assert m.prefix_len == 0 and m.host_hit_len == tokens.size
    assert cache.load_back(m.load_node, req=req)
    cache.check_invariants()
    engine.verify_prefix(req, tokens, req.prefix_len)
    cache.cache_finished_req(req)
    cache.check_invariants()


def test_a_load_node_forgotten_after_the_match_is_a_clean_miss():
    """Between a request's match and its load-back, another match (or the controller)
    may make the tree forget the host-only prefix: the load-back is a miss, no error."""
    cache, engine, ctrl, tokens = demoted_cache("full+mamba", 4)
    req = Request("r")
    m = cache.match_prefix(tokens, req=req)
    top = m.load_node
    while top.parent.parent is not None and top.parent.data[0].value is None:
        top = top.parent
    cache.tree.remove_subtree(top)
    before = cache.pools.free_counts()
    assert cache.load_back(m.load_node, req=req) is False
    assert cache.counters["load_back_failed_evicted"] == 1
    assert cache.pools.free_counts() == before and not ctrl.pins
    assert req.prefix_len == 0
    cache.check_invariants()
    engine.compute(req, tokens, tokens.size)  # the request recomputes and finishes
    cache.cache_finished_req(req)
    cache.check_invariants()
