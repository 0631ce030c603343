"""Scenarios of the unified radix tree, for every component mix, page size and window."""

from __future__ import annotations

import numpy as np
import pytest

from hicache import ComponentType, Request
from tests.support.cache import MIXES, MarkerEngine, make_cache

PAGE_SIZES = [1, 4, 16, 64]


def windows_for(page_size: int) -> list[int]:
    """A window smaller than, equal to and larger than a page (where that exists)."""
    return sorted({max(1, page_size // 2), page_size, page_size * 2 + 1})


CASES = [
    (mix, ps, w)
    for mix in MIXES
    for ps in PAGE_SIZES
    for w in (windows_for(ps) if "swa" in mix else [None])
]
IDS = [f"{m}-p{ps}-w{w}" for m, ps, w in CASES]


def seq(n: int, base: int = 0) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7 + base) % 997 + 1


@pytest.fixture(params=CASES, ids=IDS)
def case(request):
    mix, ps, w = request.param
    cache = make_cache(mix, page_size=ps, window=w, full_slots=ps * 96, mamba_slots=48)
    return cache, MarkerEngine(cache)


def capacity(cache) -> dict[str, int]:
    return {p.name: p.capacity for p in cache.pools.all()}


def assert_all_free_after_reset(cache):
    cache.reset()
    cache.check_invariants()
    assert cache.pools.free_counts() == capacity(cache)


def test_insert_then_match_whole_and_prefix(case):
    cache, engine = case
    ps = cache.page_size
    tokens = seq(6 * ps + ps // 2)  # an unaligned tail (for pages > 1)
    engine.run(tokens)
    cache.check_invariants()
    aligned = tokens.size - tokens.size % ps
    assert cache.stats().total_tokens == aligned  # the tail was not cached
    req = engine.start(tokens)
    assert req.prefix_len == aligned
    cache.cache_finished_req(req, insert=False)
    cache.check_invariants()
    # A query diverging after three pages matches three pages where every component can
    # end there: a Mamba state exists only at the end of what was inserted.
    query = np.concatenate([tokens[: 3 * ps], seq(ps, base=500)])
    m = cache.match_prefix(query)
    expect = 0 if cache.mamba is not None else 3 * ps
    assert m.prefix_len == expect
    assert m.device_indices.numel() == expect
    cache.check_invariants()
    assert_all_free_after_reset(cache)


def test_split_keeps_values_and_locks(case):
    cache, engine = case
    ps = cache.page_size
    tokens = seq(8 * ps)
    engine.run(tokens)
    holder = engine.start(tokens)  # locks the whole path
    assert holder.prefix_len == 8 * ps
    other = np.concatenate([tokens[: 4 * ps], seq(4 * ps, base=300)])
    engine.run(other)  # splits the locked node after 4 pages
    cache.check_invariants()
    assert cache.stats().protected[ComponentType.FULL] == 8 * ps
    engine.verify_prefix(holder, tokens, holder.prefix_len)
    cache.cache_finished_req(holder, insert=False)
    cache.check_invariants()
    assert cache.stats().protected[ComponentType.FULL] == 0
    # Both sequences are now fully cached, sharing their first four pages.
    for t in (tokens, other):
        assert cache.match_prefix(t).prefix_len == 8 * ps
    assert cache.stats().total_tokens == 12 * ps
    assert_all_free_after_reset(cache)


def test_shared_prefix_insert_frees_duplicate_slots(case):
    cache, engine = case
    ps = cache.page_size
    tokens = seq(5 * ps)
    a = engine.start(tokens)
    b = engine.start(tokens)  # both miss: nothing cached yet
    engine.compute(a, tokens, tokens.size)
    engine.compute(b, tokens, tokens.size)
    used = cache.pools.full.capacity - cache.pools.full.available()
    assert used == 10 * ps
    cache.cache_finished_req(a)
    cache.cache_finished_req(b)  # b's slots duplicate a's: freed
    cache.check_invariants()
    assert cache.pools.full.capacity - cache.pools.full.available() == 5 * ps
    assert cache.stats().total_tokens == 5 * ps
    assert_all_free_after_reset(cache)


def test_chunked_prefill_caches_progress(case):
    cache, engine = case
    ps = cache.page_size
    tokens = seq(7 * ps + 1)
    engine.run(tokens, chunk=2 * ps)
    cache.check_invariants()
    assert cache.match_prefix(tokens).prefix_len == tokens.size - tokens.size % ps
    assert_all_free_after_reset(cache)


def test_eviction_is_lru_across_chains_and_tail_first(case):
    cache, engine = case
    ps = cache.page_size
    old = seq(4 * ps, base=1)
    extended = np.concatenate([old, seq(4 * ps, base=2)])
    engine.run(old)
    engine.run(extended)  # extends the old chain
    new = seq(4 * ps, base=3)
    engine.run(new)
    cache.match_prefix(new)
    # The least recently used leaf is the tail of the first chain. Eviction takes what
    # is asked (whole pages) from its end, then the rest of it; its head survives. With
    # Mamba, whose state lives only at a node's end, a leaf goes whole.
    piece = ps if cache.tree.cut_tails else 4 * ps
    before = cache.pools.full.available()
    freed = cache.evict(full_tokens=1)
    cache.check_invariants()
    assert freed.full_tokens == piece == cache.pools.full.available() - before
    assert cache.stats().total_tokens == 12 * ps - piece
    cache.evict(full_tokens=4 * ps - piece)
    cache.check_invariants()
    assert cache.stats().total_tokens == 8 * ps
    assert cache.match_prefix(extended).prefix_len == 4 * ps
    assert cache.match_prefix(new).prefix_len == 4 * ps
    # Now `old` was touched after `new`: new goes next, from its tail.
    cache.match_prefix(old)
    assert cache.evict(full_tokens=1).full_tokens == piece
    cache.check_invariants()
    assert cache.match_prefix(old).prefix_len == 4 * ps
    if cache.pools.swa is None:  # (with SWA, the window may not end inside the chain)
        assert cache.match_prefix(new).prefix_len == 4 * ps - piece
    cache.match_prefix(old)
    cache.evict(full_tokens=4 * ps - piece)
    cache.check_invariants()
    assert cache.match_prefix(new).prefix_len == 0
    assert cache.match_prefix(old).prefix_len == 4 * ps
    assert_all_free_after_reset(cache)


def test_locked_path_survives_eviction(case):
    cache, engine = case
    ps = cache.page_size
    kept = seq(6 * ps, base=10)
    engine.run(kept)
    engine.run(seq(6 * ps, base=20))
    req = engine.start(kept)
    freed = cache.evict(full_tokens=10**6, swa_tokens=10**6, mamba_states=10**6)
    cache.check_invariants()
    assert freed.full_tokens == 6 * ps
    assert cache.stats().total_tokens == 6 * ps
    engine.verify_prefix(req, kept, req.prefix_len)
    cache.cache_finished_req(req)
    cache.check_invariants()
    assert cache.evict(full_tokens=10**6).full_tokens == 6 * ps
    cache.check_invariants()
    assert cache.pools.free_counts() == capacity(cache)


def test_extra_key_namespaces_are_separate(case):
    cache, engine = case
    tokens = seq(4 * cache.page_size)
    engine.run(tokens, extra_key="tenant-a")
    assert cache.match_prefix(tokens, extra_key="tenant-b").prefix_len == 0
    assert cache.match_prefix(tokens).prefix_len == 0
    assert cache.match_prefix(tokens, extra_key="tenant-a").prefix_len == tokens.size
    cache.evict(full_tokens=10**6)
    cache.check_invariants()
    assert not cache.tree.roots  # the emptied namespace is forgotten
    assert cache.pools.free_counts() == capacity(cache)


def test_unfinished_then_finished_with_generated_tail(case):
    cache, engine = case
    ps = cache.page_size
    prompt = seq(3 * ps + 1)
    req = engine.start(prompt)
    engine.compute(req, prompt, prompt.size)
    cache.cache_unfinished_req(req)
    cache.check_invariants()
    assert req.prefix_len == prompt.size - prompt.size % ps
    full = np.concatenate([prompt, seq(2 * ps, base=50)])
    engine.compute(req, full, full.size)  # decode-like growth
    cache.cache_finished_req(req)
    cache.check_invariants()
    assert cache.match_prefix(full).prefix_len == (full.size // ps) * ps
    assert_all_free_after_reset(cache)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_mamba_cow_gives_the_request_its_own_equal_state(ps):
    cache = make_cache("full+mamba", page_size=ps, full_slots=ps * 32)
    engine = MarkerEngine(cache)
    tokens = seq(4 * ps)
    engine.run(tokens)
    node_state = cache.mamba.state_of(cache.match_prefix(tokens).last_node)
    req = engine.start(tokens)  # verifies the copied state equals the prefix's
    assert req.mamba_slot != node_state
    cache.pools.mamba.conv[:, req.mamba_slot] = -1.0  # the request's writes stay its own
    req2 = engine.start(tokens)
    assert req2.prefix_len == tokens.size
    cache.cache_finished_req(req, insert=False)
    cache.cache_finished_req(req2, insert=False)
    cache.check_invariants()
    assert_all_free_after_reset(cache)


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_mamba_tombstone_on_internal_node_and_leaf_cleanup(ps):
    cache = make_cache("full+mamba", page_size=ps, full_slots=ps * 64)
    engine = MarkerEngine(cache)
    head = seq(3 * ps)
    engine.run(head)
    engine.run(np.concatenate([head, seq(3 * ps, base=40)]))
    # Dropping one state takes the least recently used: the internal node's.
    freed = cache.evict(mamba_states=1)
    cache.check_invariants()
    assert freed.mamba_states == 1 and freed.full_tokens == 0
    assert cache.match_prefix(head).prefix_len == 0  # no state at the head's end now
    assert cache.match_prefix(np.concatenate([head, seq(3 * ps, base=40)])).prefix_len == 6 * ps
    # Dropping the leaf's state makes it a tombstone leaf: removed up the chain, so the
    # head (a tombstone too) goes with it.
    freed = cache.evict(mamba_states=1)
    cache.check_invariants()
    assert freed.mamba_states == 1 and freed.full_tokens == 6 * ps
    assert cache.stats().total_tokens == 0
    assert cache.pools.free_counts() == capacity(cache)


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_a_state_that_arrives_after_a_lock_is_evicted_without_the_held_pages(ps):
    """A lock taken on a node without a Mamba state holds its FULL pages only; a state
    that reaches the node later is evictable, and evicting it must leave the held FULL
    pages alone even though the node is a device leaf."""
    cache = make_cache("full+mamba", page_size=ps, full_slots=ps * 32)
    tokens = seq(4 * ps)
    slots = cache.pools.full.pages_to_slots(cache.pools.alloc_kv_pages(4))
    cache.insert(tokens, slots)  # no state: the end node holds FULL only
    path, _, _ = cache.tree.walk(cache.tree.namespace_root(None), tokens.tobytes())
    node = path[-1]
    receipt = cache.lock(node)
    assert node.data[0].lock_ref == 1 and node.data[cache.mamba.idx].value is None
    cache.insert(tokens, slots, mamba_slot=cache.pools.mamba.alloc_state(), prev_prefix_len=4 * ps)
    assert cache.mamba.state_of(node) is not None
    cache.check_invariants()
    freed = cache.evict(mamba_states=1)
    cache.check_invariants()
    assert freed.mamba_states == 1 and freed.full_tokens == 0
    assert node.data[0].value is not None and np.array_equal(node.data[0].value, slots)
    cache.unlock(receipt)
    cache.check_invariants()
    assert cache.evict(full_tokens=4 * ps).full_tokens == 4 * ps
    assert_all_free_after_reset(cache)


@pytest.mark.parametrize("ps,window", [(1, 3), (4, 2), (4, 4), (4, 9), (16, 8), (16, 40)])
def test_swa_match_needs_an_unbroken_window(ps, window):
    cache = make_cache("full+swa", page_size=ps, window=window, full_slots=ps * 128)
    engine = MarkerEngine(cache)
    a = seq(4 * ps)
    b = np.concatenate([a, seq(4 * ps, base=70)])
    engine.run(a)
    head = cache.match_prefix(a).last_node
    engine.run(b)
    assert head.end == 4 * ps and head.children
    # Tombstone SWA on the head (internal): matches ending far enough after it still hold.
    cache.evict(swa_tokens=1)
    cache.check_invariants()
    assert head.data[1].value is None
    assert cache.match_prefix(a).prefix_len == 0
    expect = b.size if window <= 4 * ps else 0
    assert cache.match_prefix(b).prefix_len == expect
    if expect:
        req = engine.start(b)
        cache.cache_finished_req(req, insert=False)
    cache.check_invariants()
    assert_all_free_after_reset(cache)


@pytest.mark.parametrize("ps,window", [(1, 5), (4, 6), (16, 20)])
def test_swa_pages_out_of_window_are_freed_and_cached_as_tombstones(ps, window):
    cache = make_cache("full+swa", page_size=ps, window=window, full_slots=ps * 64)
    engine = MarkerEngine(cache)
    tokens = seq(10 * ps)
    req = engine.start(tokens)
    engine.compute(req, tokens, tokens.size)
    freed = cache.release_swa_outside_window(req)
    assert freed > 0
    assert cache.pools.swa.available() == cache.pools.swa.capacity - (10 * ps - freed)
    cache.check_invariants()
    cache.cache_finished_req(req)
    cache.check_invariants()
    # The full sequence matches (its window is intact); an early prefix does not.
    assert cache.match_prefix(tokens).prefix_len == tokens.size
    short = ps * ((freed // ps) // 2 or 1)
    assert cache.match_prefix(tokens[:short]).prefix_len == 0
    assert_all_free_after_reset(cache)


def test_lock_receipts_replay_exactly_and_refuse_double_unlock(case):
    cache, engine = case
    ps = cache.page_size
    tokens = seq(6 * ps)
    engine.run(tokens)
    node = cache.match_prefix(tokens).last_node
    before = cache.stats()
    r1 = cache.lock(node)
    r2 = cache.lock(node)
    engine.run(np.concatenate([tokens[: 2 * ps], seq(ps, base=9)]))  # split under the lock
    cache.unlock(r1)
    cache.unlock(r2)
    cache.check_invariants()
    after = cache.stats()
    assert after.protected == before.protected
    with pytest.raises(RuntimeError):
        cache.unlock(r1)
    assert_all_free_after_reset(cache)


def test_unaligned_and_empty_inputs(case):
    cache, engine = case
    ps = cache.page_size
    m = cache.match_prefix([])
    assert m.prefix_len == 0 and m.device_indices.numel() == 0
    if ps > 1:
        req = engine.run(seq(ps - 1))
        assert req.finished
        assert cache.stats().total_tokens == 0
        with pytest.raises(ValueError, match="whole pages"):
            cache.insert(seq(ps + 1), np.arange(ps + 1))
    with pytest.raises(ValueError, match="one slot per token"):
        cache.insert(seq(ps), np.arange(ps + 1))
    cache.check_invariants()
    assert cache.pools.free_counts() == capacity(cache)


def test_request_slots_come_back_on_finish_without_insert(case):
    cache, engine = case
    tokens = seq(5 * cache.page_size + 2)
    req = engine.start(tokens)
    engine.compute(req, tokens, tokens.size)
    cache.cache_finished_req(req, insert=False)
    cache.check_invariants()
    assert cache.pools.free_counts() == capacity(cache)
    with pytest.raises(ValueError):
        cache.cache_finished_req(req)


def test_alloc_evicts_when_the_pool_is_short():
    cache = make_cache("full+swa+mamba", page_size=4, window=6, full_slots=64, mamba_slots=6)
    engine = MarkerEngine(cache)
    for base in range(6):
        engine.run(seq(12, base=base * 100))
    cache.check_invariants()
    req = Request("big")
    cache.match_prefix(seq(60, base=999), req=req)
    evicted_before = cache.evicted.full_tokens
    cache.alloc_tokens(req, 60)  # needs 15 pages: cached prefixes are evicted for it
    assert req.kv_slots.size == 60
    assert cache.evicted.full_tokens > evicted_before
    cache.check_invariants()
    cache.cache_finished_req(req, insert=False)
    cache.check_invariants()


@pytest.mark.parametrize("ps,window", [(1, 3), (4, 6), (16, 20)])
def test_insert_over_an_swa_tombstone_hands_the_request_s_pages_to_the_node(ps, window):
    cache = make_cache("full+swa", page_size=ps, window=window, full_slots=ps * 128)
    engine = MarkerEngine(cache)
    a = seq(4 * ps)
    engine.run(a)
    head = cache.match_prefix(a).last_node
    engine.run(np.concatenate([a, seq(4 * ps, base=70)]))
    cache.evict(swa_tokens=1)  # the head (internal, least recent) loses its SWA pages
    assert head.data[1].value is None and head.data[0].value is not None
    req = engine.start(a)
    assert req.prefix_len == 0  # the window at the head's end is broken
    engine.compute(req, a, a.size)
    cache.release_swa_outside_window(req)
    cache.cache_unfinished_req(req)  # the tree keeps its FULL slots, takes the SWA pages
    cache.check_invariants()
    assert req.prefix_len == a.size
    engine.verify_prefix(req, a, req.prefix_len, state=False)
    cache.cache_finished_req(req)
    cache.check_invariants()
    assert cache.match_prefix(a).prefix_len == a.size
    assert_all_free_after_reset(cache)


@pytest.mark.parametrize("ps,window", [(1, 2), (4, 2), (16, 20)])
def test_caching_a_request_that_released_pages_behind_its_window(ps, window):
    """A request decodes past its window, gives back the SWA pages behind it, then caches
    its progress: it keeps its own window, and nobody is served the released pages."""
    cache = make_cache("full+swa", page_size=ps, window=window, full_slots=ps * 64)
    engine = MarkerEngine(cache)
    tokens = seq(6 * ps + ps // 2 + 1, base=5)
    req = engine.start(tokens)
    engine.compute(req, tokens, tokens.size)
    assert cache.release_swa_outside_window(req) > 0
    cache.check_invariants()
    cache.cache_unfinished_req(req)
    cache.check_invariants()
    assert req.prefix_len == tokens.size - tokens.size % ps
    own = cache.pools.swa_slots_of(req.kv_slots[tokens.size - window :])
    assert (own >= 0).all(), "the request lost the window it decodes with"
    other = engine.start(tokens)  # verifies every FULL and SWA slot it was given
    released = (tokens.size - window) - (tokens.size - window) % ps
    whole = req.prefix_len - window >= released  # the window at the prefix's end survived
    assert other.prefix_len == (req.prefix_len if whole else 0)
    cache.cache_finished_req(other, insert=False)
    cache.cache_finished_req(req)
    cache.check_invariants()
    assert_all_free_after_reset(cache)
