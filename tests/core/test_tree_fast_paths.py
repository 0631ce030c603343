"""The tree's fast paths give what the plain ones give: a walk and an insert over a byte
view of the tokens against ones over their key bytes, the whole-page check of an engine's
insert, which stays on when the pools' debug checks are off, and a match's hits and slots."""

from __future__ import annotations

import numpy as np
import pytest

import hicache.cache
import hicache.tree_insert
from hicache import CacheConfig, DevicePools, ModelLayout, UnifiedRadixCache, pools
from hicache.eviction import LRULeafPolicy
from hicache.keys import VIEW_MIN_KEY_BYTES, token_view, walk_key

LONG = VIEW_MIN_KEY_BYTES // 8 + 512  # tokens: a query long enough to walk over a view


def make(page_size: int, slots: int) -> UnifiedRadixCache:
    layout = ModelLayout(("full",), num_kv_heads=1, head_dim=1, dtype="float32")
    cfg = CacheConfig(page_size=page_size, full_slots=slots)
    return UnifiedRadixCache(layout, cfg, DevicePools.allocate(layout, cfg))


def insert(cache: UnifiedRadixCache, tokens: np.ndarray) -> None:
    m = cache.match_prefix(tokens)
    pools_ = cache.pools
    fresh = pools_.full.pages_to_slots(
        pools_.alloc_kv_pages((tokens.size - m.prefix_len) // cache.page_size)
    )
    cache.insert(tokens, np.concatenate([m.device_slots, fresh]), prev_prefix_len=m.prefix_len)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_walk_over_a_view_finds_what_a_walk_over_the_key_finds(page_size):
    rng = np.random.default_rng(3)
    cache = make(page_size, 8 * LONG)
    shared = rng.integers(1, 32000, LONG)
    first = np.concatenate([shared, rng.integers(1, 32000, 4 * page_size)])
    insert(cache, first)
    insert(cache, np.concatenate([shared[: LONG // 2], rng.integers(1, 32000, LONG // 2)]))
    cache.check_invariants()
    root = cache.tree.namespace_root(None)
    diverging = first.copy()
    diverging[LONG - 3 * page_size] = 0  # inside a node: a partial match, cut to pages
    queries = [first, first[: LONG - page_size], diverging, rng.integers(1, 32000, LONG)]
    for query in queries:
        key = query.tobytes()
        assert isinstance(walk_key(query), memoryview)
        by_key = cache.tree.walk(root, key)
        by_view = cache.tree.walk(root, token_view(query))
        assert by_view == by_key
        # and from inside the tree, as a match beyond the device continues a walk
        if by_key[0]:
            start = by_key[0][0]
            pos = start.end * 8
            assert cache.tree.walk(start, token_view(query), pos) == cache.tree.walk(
                start, key, pos
            )
    assert cache.match_prefix(diverging).prefix_len == LONG - 3 * page_size - (
        (LONG - 3 * page_size) % page_size
    )
    cache.check_invariants()


@pytest.mark.parametrize("debug_checks", [True, False])
def test_an_engine_insert_of_slots_that_are_not_whole_pages_is_refused(monkeypatch, debug_checks):
    monkeypatch.setattr(pools, "DEBUG_CHECKS", debug_checks)
    cache = make(4, 64)
    tokens = np.arange(1, 9, dtype=np.int64)
    slots = cache.pools.full.pages_to_slots(cache.pools.alloc_kv_pages(2))
    free_before = cache.pools.full.available()
    for bad in (slots[[1, 0, 2, 3, 4, 5, 6, 7]], np.concatenate([slots[:4] + 1, slots[4:]])):
        with pytest.raises(ValueError, match="not whole pages"):
            cache.insert(tokens, bad)
        assert cache.pools.full.available() == free_before
        assert cache.stats().total_tokens == 0
    cache.insert(tokens, slots)
    assert cache.match_prefix(tokens).prefix_len == 8
    cache.check_invariants()


@pytest.mark.parametrize("page_size", [1, 16])
def test_an_insert_over_a_view_builds_the_tree_an_insert_over_the_key_builds(
    monkeypatch, page_size
):
    """Long inserts walk a byte view of the tokens; the same inserts over key bytes (the
    plain path, forced here) must leave the same nodes, slots and free pages: shared
    prefixes, a divergence inside a node (a split), a full duplicate and a longer one."""
    rng = np.random.default_rng(11)
    shared = rng.integers(1, 32000, LONG)
    prompts = [
        np.concatenate([shared, rng.integers(1, 32000, 8 * page_size)]),
        np.concatenate([shared[: LONG // 2], rng.integers(1, 32000, LONG // 2)]),
        shared[: LONG - LONG % page_size],
        np.concatenate([shared, rng.integers(1, 32000, LONG)]),
    ]
    prompts = [p[: p.size - p.size % page_size] for p in prompts]

    def build() -> tuple[list, int, list]:
        cache = make(page_size, 16 * LONG)
        for tokens in prompts:
            insert(cache, tokens)
            cache.check_invariants()
        nodes = sorted((n.start, n.key, n.base.value.tolist()) for n in cache.tree.iter_nodes())
        hits = [cache.match_prefix(p).device_slots.tolist() for p in prompts]
        return nodes, cache.pools.full.available(), hits

    by_view = build()

    def key_bytes(arr):
        return arr.tobytes()

    monkeypatch.setattr(hicache.tree_insert, "walk_key", key_bytes)
    monkeypatch.setattr(hicache.cache, "walk_key", key_bytes)
    assert build() == by_view


def test_a_match_counts_a_hit_on_each_device_node_and_hands_out_its_own_slots():
    """Every node of the matched device prefix gets one hit and, for a policy that
    listens, one ``on_hit``; the slots are the nodes' slots in order, in a fresh array
    the caller may write to without touching the tree's."""

    class Listening(LRULeafPolicy):
        def __init__(self) -> None:
            super().__init__()
            self.heard: list[int] = []

        def on_hit(self, node) -> None:
            self.heard.append(node.id)

    layout = ModelLayout(("full",), num_kv_heads=1, head_dim=1, dtype="float32")
    cfg = CacheConfig(page_size=4, full_slots=256)
    policy = Listening()
    cache = UnifiedRadixCache(layout, cfg, DevicePools.allocate(layout, cfg), leaf_policy=policy)
    rng = np.random.default_rng(5)
    head = rng.integers(1, 32000, 16)
    first = np.concatenate([head, rng.integers(1, 32000, 8)])
    insert(cache, first)
    insert(cache, np.concatenate([head, rng.integers(1, 32000, 8)]))  # splits at 16
    insert(cache, np.concatenate([first, rng.integers(1, 32000, 12)]))
    cache.check_invariants()
    policy.heard.clear()
    counts = {n.id: n.hit_count for n in cache.tree.iter_nodes()}
    query = np.concatenate([first, rng.integers(1, 32000, 4)])
    m = cache.match_prefix(query)
    path = cache.tree.path_to_root(m.last_node)
    assert m.prefix_len == first.size and len(path) == 2
    assert policy.heard == [n.id for n in path]
    hit = {n.id for n in path}
    assert all(n.hit_count == counts[n.id] + (n.id in hit) for n in cache.tree.iter_nodes())
    assert m.device_slots.tolist() == np.concatenate([n.base.value for n in path]).tolist()
    before = [n.base.value.copy() for n in path]
    m.device_slots[:] = -1
    assert all((n.base.value == b).all() for n, b in zip(path, before))
    cache.check_invariants()
