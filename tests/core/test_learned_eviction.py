"""The learned leaf eviction policy: what it evicts first, what its history remembers, that
chains are cut from the tail, determinism, invariants, and hit ratios against LRU."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from hicache import CacheConfig, DevicePools, ModelLayout, Request, UnifiedRadixCache
from hicache.apps.replay import BlockShape, ReplaySettings, load_trace, replay, unique_blocks
from hicache.config import EvictionPolicyKind
from hicache.learned_eviction import LearnedLeafPolicy, LearnedPolicyParams
from tests.support.cache import MarkerEngine, make_cache

SHARED_TRACE = Path("/work/shared/data/mooncake_synthetic_trace.jsonl")
PS = 4
LAYOUT = ModelLayout(("full",), num_kv_heads=1, head_dim=1, dtype="float32", model_id="t")


def full_cache(pages: int, policy: LearnedLeafPolicy | None = None, controller=None):
    cfg = CacheConfig(page_size=PS, full_slots=pages * PS, mamba_slots=0)
    pools = DevicePools.allocate(LAYOUT, cfg)
    policy = policy or LearnedLeafPolicy(sample_size=64, seed=0)
    return UnifiedRadixCache(LAYOUT, cfg, pools, controller=controller, leaf_policy=policy)


def chain(n_pages: int, base: int) -> np.ndarray:
    return np.arange(base, base + n_pages * PS, dtype=np.int64)


def serve(cache: UnifiedRadixCache, tokens: np.ndarray) -> int:
    """One request the way an engine runs it; returns its device hit (tokens)."""
    req = Request("r")
    m = cache.match_prefix(tokens, req=req)
    if m.load_node is not None:
        cache.load_back(m.load_node, req=req)
    cache.alloc_tokens(req, tokens.size - req.prefix_len)
    req.append_tokens(tokens[req.prefix_len :])
    cache.cache_finished_req(req)
    cache.check_invariants()
    return m.prefix_len


def node_at(cache: UnifiedRadixCache, tokens: np.ndarray):
    path, partial, _ = cache.tree.walk(cache.tree.namespace_root(None), tokens.tobytes())
    assert partial is None and path
    return path[-1]


def test_a_leaf_never_used_goes_before_an_older_leaf_that_was():
    cache = full_cache(pages=12)
    a, b = chain(4, 0), chain(4, 1000)
    serve(cache, a)
    serve(cache, a)  # a used once since it was cached
    serve(cache, b)  # b is more recent, but nobody used it
    cache.evict(full_tokens=b.size)
    cache.check_invariants()
    assert serve(cache, a) == a.size
    assert cache.match_prefix(b).prefix_len == 0

    lru = make_cache("full", page_size=PS, full_slots=12 * PS)
    for tokens in (a, a, b):
        serve(lru, tokens)
    lru.evict(full_tokens=a.size)
    assert lru.match_prefix(a).prefix_len == 0  # LRU drops the older one


def test_history_brings_back_the_uses_of_an_evicted_prefix():
    policy = LearnedLeafPolicy(sample_size=64, seed=0)
    cache = full_cache(pages=16, policy=policy)
    a = chain(3, 0)
    serve(cache, a)
    serve(cache, a)
    serve(cache, a)
    assert policy.uses(node_at(cache, a)) == 2
    cache.evict(full_tokens=10**6)
    assert cache.stats().total_tokens == 0 and policy.history_size == 1
    serve(cache, a)  # inserted again: the history recognises it
    assert policy.uses(node_at(cache, a)) == 3
    assert policy.history_size == 0
    cache.check_invariants()


def test_an_evicted_chain_returns_with_each_piece_s_own_uses():
    """Eviction takes what is asked from a leaf's tail and the history remembers each
    piece; a request that brings the chain back gets nodes cut where the pieces were,
    each with its own count, so blocks nobody reused do not ride on a hot head."""
    policy = LearnedLeafPolicy(sample_size=64, seed=0)
    cache = full_cache(pages=16, policy=policy)
    head = chain(2, 0)
    whole = np.concatenate([head, chain(2, 100)])
    for _ in range(3):
        serve(cache, head)
    serve(cache, whole)  # the head's fourth use; the tail is new
    assert policy.uses(node_at(cache, head)) == 3
    assert policy.uses(node_at(cache, whole)) == 0
    assert cache.evict(full_tokens=PS).full_tokens == PS  # the tail's last page
    cache.evict(full_tokens=10**6)  # the rest of the tail, then the head
    cache.check_invariants()
    assert cache.stats().total_tokens == 0 and policy.history_size == 3
    serve(cache, whole)
    cache.check_invariants()
    assert policy.uses(node_at(cache, head)) == 4
    assert policy.uses(node_at(cache, whole[: 3 * PS])) == 1
    assert policy.uses(node_at(cache, whole)) == 1
    assert node_at(cache, whole).num_tokens == PS  # cut at every remembered piece
    assert policy.history_size == 0


def test_a_sampled_pick_evicts_a_quantum_and_a_full_scan_all_that_is_asked():
    params = LearnedPolicyParams(evict_quantum_tokens=PS)
    for sample, pieces in ((64, 1), (1, 2)):
        policy = LearnedLeafPolicy(sample_size=sample, seed=0, params=params)
        cache = full_cache(pages=16, policy=policy)
        serve(cache, chain(3, 0))
        serve(cache, chain(3, 1000))  # two leaves: a sample of 1 sees only one of them
        cache.evict(full_tokens=2 * PS)
        cache.check_invariants()
        assert cache.stats().total_tokens == 4 * PS
        assert policy.history_size == pieces


def test_a_leaf_cut_by_eviction_keeps_its_head_s_state():
    params = LearnedPolicyParams(evict_quantum_tokens=PS)
    policy = LearnedLeafPolicy(sample_size=64, seed=0, params=params)
    cache = full_cache(pages=16, policy=policy)
    a = chain(3, 0)
    for _ in range(3):
        serve(cache, a)
    assert cache.evict(full_tokens=1).full_tokens == PS  # one page, from the tail
    cache.check_invariants()
    head = node_at(cache, a[: 2 * PS])
    assert head.num_tokens == 2 * PS
    assert policy.uses(head) == 2  # the cut is not a return of the prefix
    assert cache.match_prefix(a).prefix_len == 2 * PS


@pytest.mark.parametrize("kind", [EvictionPolicyKind.LRU, EvictionPolicyKind.LEARNED])
def test_eviction_frees_what_is_asked_in_whole_pages(kind):
    cfg = CacheConfig(page_size=PS, full_slots=64 * PS, mamba_slots=0, eviction_policy=kind)
    cache = UnifiedRadixCache(LAYOUT, cfg, DevicePools.allocate(LAYOUT, cfg))
    rng = random.Random(3)
    for i in range(12):
        serve(cache, chain(rng.randrange(1, 6), 1000 * i))
        serve(cache, chain(rng.randrange(6, 9), 1000 * (i % 3)))
    for want in (1, PS, PS + 1, 3 * PS, 7 * PS - 1):
        held = cache.stats().total_tokens
        freed = cache.evict(full_tokens=want).full_tokens
        cache.check_invariants()
        assert freed == -(-want // PS) * PS == held - cache.stats().total_tokens


def test_history_is_bounded():
    policy = LearnedLeafPolicy(sample_size=8, seed=0, params=LearnedPolicyParams(history_entries=5))
    cache = full_cache(pages=8, policy=policy)
    for i in range(40):
        serve(cache, chain(3, 10_000 * (i + 1)))
        assert policy.history_size <= 5
    assert policy.history_size == 5


def test_chains_are_cut_from_the_tail_whatever_the_uses():
    policy = LearnedLeafPolicy(sample_size=64, seed=0)
    cache = full_cache(pages=16, policy=policy)
    tokens = chain(6, 0)
    # Cache the chain a page at a time (one node per page), then use only its head often:
    # the head's rate is far above the tail's, yet the tail must go first.
    for k in range(1, 7):
        serve(cache, tokens[: k * PS])
    for _ in range(5):
        serve(cache, tokens[:PS])
    cached = tokens.size
    while cached:
        cache.evict(full_tokens=PS)
        cache.check_invariants()
        now = cache.match_prefix(tokens).prefix_len
        assert now == cached - PS, "a page other than the chain's tail was evicted"
        assert cache.stats().total_tokens == now
        cached = now


def scan_trace(path: Path, rounds: int = 40) -> Path:
    """A hot set of short conversations used every round, between one-off long documents
    (a scan): LRU lets the scans flush the hot set, the learned policy should not."""
    rng = random.Random(0)
    rows, t, next_id = [], 0, 1000
    hot = [[d * 10 + j for j in range(3)] for d in range(8)]
    for _ in range(rounds):
        for h in rng.sample(hot, len(hot)):
            rows.append({"timestamp": t, "input_length": 48, "output_length": 1, "hash_ids": h})
            t += 1
            scan = list(range(next_id, next_id + 5))
            next_id += 5
            rows.append({"timestamp": t, "input_length": 80, "output_length": 1, "hash_ids": scan})
            t += 1
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_learned_keeps_a_hot_set_through_a_scan(tmp_path):
    trace = load_trace(scan_trace(tmp_path / "scan.jsonl"))
    shape = BlockShape(16, 16)
    results = {
        kind: replay(trace, ReplaySettings(30, shape=shape, policy=kind, check_invariants_every=50))
        for kind in (EvictionPolicyKind.LRU, EvictionPolicyKind.LEARNED)
    }
    lru, learned = results[EvictionPolicyKind.LRU], results[EvictionPolicyKind.LEARNED]
    # Per round 24 hot blocks and 40 scan blocks are asked for: at most 24/64 can hit.
    # The 8 hot chains (24 blocks) fit in 30 blocks next to a scan; LRU keeps few of them.
    best = 24 / 64
    assert lru.device_hit_ratio < 0.25 * best
    assert learned.device_hit_ratio > 0.7 * best


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="the shared trace is not here")
@pytest.mark.parametrize("percent", [5, 10])
def test_learned_is_not_worse_than_lru_on_a_slice_of_the_shared_trace(percent):
    trace = load_trace(SHARED_TRACE, max_requests=2000)
    capacity = round(unique_blocks(trace) * percent / 100)
    hits = {
        kind: replay(trace, ReplaySettings(capacity, policy=kind)).device_hit_ratio
        for kind in (EvictionPolicyKind.LRU, EvictionPolicyKind.LEARNED)
    }
    assert hits[EvictionPolicyKind.LEARNED] >= hits[EvictionPolicyKind.LRU]


def evictions_of(seed: int, trace) -> list[int]:
    order: list[int] = []
    cache_policy = LearnedLeafPolicy(sample_size=4, seed=seed)
    pop = cache_policy.pop

    def recording_pop():
        node = pop()
        if node is not None:
            order.append(node.start * 1_000_003 + int(node.key[:8].hex(), 16) % 1_000_003)
        return node

    cache_policy.pop = recording_pop
    cache = full_cache(pages=20, policy=cache_policy)
    for tokens in trace:
        serve(cache, tokens)
    return order


def test_equal_seeds_evict_equal_leaves():
    rng = np.random.default_rng(1)
    trace = [chain(int(rng.integers(1, 6)), 100 * int(rng.integers(0, 30))) for _ in range(200)]
    first = evictions_of(7, trace)
    assert first and first == evictions_of(7, trace)


@pytest.mark.parametrize("mix", ["full", "full+swa", "full+swa+mamba"])
def test_invariants_hold_after_every_mutation(mix):
    cache = make_cache(
        mix,
        page_size=PS,
        window=6,
        full_slots=40 * PS,
        mamba_slots=24,
        eviction_policy="learned",
        eviction_sample_size=3,
        seed=5,
    )
    engine = MarkerEngine(cache)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 500, size=int(rng.integers(PS, 9 * PS))) for _ in range(12)]
    for i in range(120):
        base = prompts[int(rng.integers(0, len(prompts)))]
        tail = rng.integers(1, 500, size=int(rng.integers(0, 3 * PS)))
        engine.run(np.concatenate([base, tail]), chunk=2 * PS if i % 3 == 0 else None)
        cache.check_invariants()
        if i % 25 == 24:
            cache.evict(full_tokens=int(rng.integers(1, 30)) * PS)
            cache.check_invariants()
    assert cache.stats().total_tokens > 0


def test_a_load_back_from_the_host_tier_counts_as_a_use():
    from hicache.controller.config import ControllerConfig, HostPinning
    from hicache.controller.store.local import LocalController

    ctl = LocalController(
        ControllerConfig(host_pool_bytes=1 << 20, host_pinning=HostPinning.PAGEABLE)
    )
    policy = LearnedLeafPolicy(sample_size=64, seed=0)
    cache = full_cache(pages=8, policy=policy, controller=ctl)
    try:
        a = chain(3, 0)
        serve(cache, a)
        cache.flush_backups()
        cache.evict(full_tokens=10**6)  # backed: stays in the tree as a host-only node
        assert cache.stats().host_only_tokens == a.size
        node = node_at(cache, a)
        assert policy.uses(node) == 0
        req = Request("r")
        m = cache.match_prefix(a, req=req)
        assert m.prefix_len == 0 and m.host_hit_len == a.size
        assert cache.load_back(m.load_node, req=req)
        cache.cache_finished_req(req)
        cache.check_invariants()
        assert policy.uses(node_at(cache, a)) == 1
    finally:
        ctl.close()


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="sample_size"):
        LearnedLeafPolicy(sample_size=0)
    with pytest.raises(ValueError, match="prior_uses"):
        LearnedPolicyParams(prior_uses=0)
    with pytest.raises(ValueError, match="history_entries"):
        LearnedPolicyParams(history_entries=0)
