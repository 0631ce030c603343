"""A load-back fills the SWA tombstones of the window it loads; the SWA pages the window
already holds above a tombstone must survive the eviction that makes room for it, or the
request gets a prefix whose window has a hole (the engine would read unwritten slots)."""

from __future__ import annotations

import numpy as np
import pytest

from hicache import ComponentType, Request
from tests.support.cache import MarkerEngine, make_cache
from tests.support.fake_controller import FakeController

PS, WINDOW = 4, 12


def seq(n: int, base: int = 0) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 13 + base) % 991 + 1


def window_above_a_tombstone(other_evictable: bool):
    """P=[0,4) holds SWA, Q=[4,8) is an SWA tombstone on the device, R=[8,12) is host
    only: loading R needs SWA pages for Q and R while P's are the window's start. The SWA
    pool has one free page; with ``other_evictable`` an unrelated newer node T holds one
    more, which eviction may take (P, older, comes first in the SWA LRU list)."""
    cache = make_cache(
        "full+swa+mamba", page_size=PS, window=WINDOW, swa_slots=64, controller=FakeController()
    )
    engine = MarkerEngine(cache)
    pqr = seq(12)
    pqs = np.concatenate([pqr[:8], seq(12, base=500)])
    engine.run(pqr, chunk=PS)  # nodes P, Q, R, a state at each end
    engine.run(pqs)  # S=[8,20) under Q keeps Q an inner node
    cache.flush_backups()
    holds_s = engine.start(pqs)  # its window lies inside S: Q's SWA is not locked
    holds_p = engine.start(pqr[:PS])
    cache.evict(full_tokens=PS)  # R: host only
    cache.evict(swa_tokens=PS)  # Q: SWA (and state) tombstoned; P is held
    cache.cache_finished_req(holds_p)
    cache.evict(mamba_states=1)  # P's state: a match of P Q R now ends at the root
    if other_evictable:
        engine.run(seq(PS, base=900))
    hog = Request("hog")
    cache.match_prefix(np.zeros(0, dtype=np.int64), req=hog)
    cache.alloc_tokens(hog, cache.pools.swa.available() - PS)
    cache.check_invariants()
    swa = cache.tree.by_type[ComponentType.SWA]
    p_node = holds_s.last_node.parent.parent
    assert p_node.end == PS and p_node.data[swa.idx].value is not None
    assert p_node.children[pqr[PS : 2 * PS].tobytes()].data[swa.idx].value is None
    return cache, engine, pqr, p_node


def test_load_back_keeps_swa_pages_above_a_tombstone_in_the_window():
    cache, engine, pqr, p_node = window_above_a_tombstone(other_evictable=True)
    req = Request("r")
    m = cache.match_prefix(pqr, req=req)
    assert m.prefix_len == 0 and m.load_node is not None and m.load_node.end == 12
    assert cache.load_back(m.load_node, req=req)
    cache.check_invariants()
    assert req.prefix_len == 12
    engine.verify_prefix(req, pqr, 12)
    cache.cache_finished_req(req)
    cache.check_invariants()


def test_load_back_fails_cleanly_when_only_the_window_could_make_room():
    cache, engine, pqr, p_node = window_above_a_tombstone(other_evictable=False)
    req = Request("r")
    m = cache.match_prefix(pqr, req=req)
    before = cache.pools.free_counts()
    assert cache.load_back(m.load_node, req=req) is False
    cache.check_invariants()
    assert cache.pools.free_counts() == before and req.prefix_len == 0
    assert p_node.data[cache.tree.by_type[ComponentType.SWA].idx].value is not None
    engine.verify_prefix(req, pqr, 0)
    cache.cache_finished_req(req, insert=False)
    cache.check_invariants()


def test_load_back_without_request_loads_a_matchable_window():
    """Without a request the load starts at the window's start, not at the deepest device
    node: Q's tombstone is filled and P's SWA pages are kept, so the prefix hits."""
    cache, engine, pqr, p_node = window_above_a_tombstone(other_evictable=True)
    m = cache.match_prefix(pqr)
    assert cache.load_back(m.load_node)
    cache.check_invariants()
    req = Request("r")
    assert cache.match_prefix(pqr, req=req).prefix_len == 12
    cache.check_invariants()
    engine.verify_prefix(req, pqr, 12)
    cache.cache_finished_req(req)
    cache.check_invariants()


def test_invariants_catch_a_hole_in_a_request_window():
    cache = make_cache("full+swa", page_size=PS, window=WINDOW)
    engine = MarkerEngine(cache)
    tokens = seq(5 * PS)
    req = engine.start(tokens)
    engine.compute(req, tokens, tokens.size)
    cache.check_invariants()
    # Freeing a page that is still inside the window (as a too-eager release would).
    inside = req.kv_slots[tokens.size - WINDOW] // PS
    cache.pools.free_swa_of(np.array([inside]))
    with pytest.raises(AssertionError, match="SWA window"):
        cache.check_invariants()
