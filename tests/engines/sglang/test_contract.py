"""hicache's backend against SGLang's reference file backend, driven by SGLang's own
controller methods over SGLang's own host pools: the same hits and the same bytes."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang_support import (
    PAGE_SIZE,
    ControllerShim,
    HybridControllerShim,
    file_backend,
    fill_pages,
    hicache_backend,
    host_page_bytes,
    mamba_host_pool,
    mha_host_pool,
    page_keys,
)

from hicache import ComponentType

STORED_PAGES = 6
QUERY_PAGES = 9  # three pages past what was stored: the hit must stop there


def _run_controller(backend, pool, zero_copy: bool, tokens: list[int], query: list[int]):
    """Back up ``tokens`` from host pages, then prefetch ``query`` into fresh host pages,
    through SGLang's controller methods; returns what the run saw."""
    ctl = ControllerShim(backend, pool, zero_copy)
    src = fill_pages(pool, STORED_PAGES, seed=7)
    written = ctl.backup(src, tokens)
    dst = pool.alloc(QUERY_PAGES * PAGE_SIZE)
    found, loaded = ctl.prefetch(query, dst)
    return {
        "written": written,
        "found": found,
        "loaded": loaded,
        "stored_bytes": host_page_bytes(pool, src, STORED_PAGES),
        "loaded_bytes": host_page_bytes(pool, dst, loaded // PAGE_SIZE),
    }


@pytest.mark.parametrize("engine_copies", [True, False])
@pytest.mark.parametrize(
    ("layout", "allocator", "zero_copy"),
    [
        ("layer_first", "shm", True),  # the sidecar maps SGLang's memfd pool
        ("layer_first", "default", True),  # interface_v1 through the staging pages
        ("page_first", "default", True),
        ("layer_first", "default", False),  # SGLang's generic batch_get / batch_set
        ("page_first", "shm", False),
    ],
)
def test_kv_pages_same_hits_and_bytes_as_the_file_backend(
    sidecar_per_layout, token_base, tmp_path, layout, allocator, zero_copy, engine_copies
):
    sidecar = sidecar_per_layout(layout)
    tokens = list(range(token_base, token_base + STORED_PAGES * PAGE_SIZE))
    query = tokens + [900_000_000 + t for t in range((QUERY_PAGES - STORED_PAGES) * PAGE_SIZE)]

    oracle_pool = mha_host_pool(layout)
    oracle = _run_controller(
        file_backend(str(tmp_path / "file"), oracle_pool), oracle_pool, False, tokens, query
    )
    pool = mha_host_pool(layout, allocator)
    backend = hicache_backend(sidecar.endpoint, pool, hicache_engine_copies=engine_copies)
    try:
        assert backend.zero_copy == (layout == "layer_first" and allocator == "shm")
        # the sidecar's host pages are mapped at registration, not in SGLang's first call
        assert (backend.controller.mapped_session() is not None) == engine_copies
        # every layout's KV pages are copied by the backend itself when it may
        assert (backend.pages.copies(ComponentType.FULL) is not None) == engine_copies
        ours = _run_controller(backend, pool, zero_copy, tokens, query)
    finally:
        backend.close()

    assert oracle["written"] == ours["written"] == STORED_PAGES * PAGE_SIZE
    assert oracle["found"] == ours["found"] == STORED_PAGES * PAGE_SIZE
    assert oracle["loaded"] == ours["loaded"] == STORED_PAGES * PAGE_SIZE
    assert ours["loaded_bytes"] == ours["stored_bytes"] == oracle["stored_bytes"]
    assert oracle["loaded_bytes"] == oracle["stored_bytes"]


def _hybrid_run(backend, kv_pool, mamba_pool, state_pages: list[int], zero_copy: bool, base: int):
    """KV for six pages, Mamba states only at ``state_pages`` (as the hybrid controller
    writes them: KV through the controller's backup, each state a MAMBA PoolTransfer);
    then the existence checks the hybrid controller makes, under both hit policies, and a
    read of the last state."""
    tokens = list(range(base, base + STORED_PAGES * PAGE_SIZE))
    keys = page_keys(tokens)
    ctl = ControllerShim(backend, kv_pool, zero_copy)
    assert ctl.backup(fill_pages(kv_pool, STORED_PAGES, seed=11), tokens) == len(tokens)
    stored = {}
    for p in state_pages:
        slot = fill_pages(mamba_pool, 1, seed=100 + p)
        stored[p] = host_page_bytes(mamba_pool, slot, 1)[0]
        res = backend.batch_set_v2(
            [PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=[keys[p]])]
        )
        assert res[PoolName.MAMBA] == [True]
    seen = {}
    for policy, trailing in (
        (PoolHitPolicy.TRAILING_PAGES, 1),
        (PoolHitPolicy.TRAILING_PAGES, 2),
        (PoolHitPolicy.ALL_PAGES, 1),
    ):
        r = backend.batch_exists_v2(
            keys, [PoolTransfer(name=PoolName.MAMBA, keys=keys[-trailing:], hit_policy=policy)]
        )
        seen[(policy.value, trailing)] = (
            r.kv_hit_pages,
            dict(r.extra_pool_hit_pages),
            r.restorable_prefix_pages,
        )
    last = max(state_pages)
    slot = mamba_pool.alloc(2)
    got = backend.batch_get_v2(
        [PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=[keys[last], keys[0]])]
    )
    seen["get"] = got[PoolName.MAMBA]
    seen["bytes"] = host_page_bytes(mamba_pool, slot[:1], 1)[0] == stored[last]
    return seen


@pytest.mark.parametrize("engine_copies", [True, False])
@pytest.mark.parametrize("state_pages", [[2, 5], [1, 2, 3], [0, 1, 2, 3, 4, 5]])
def test_hybrid_hit_policies_match_the_file_backend(
    sidecar_per_layout, token_base, tmp_path, state_pages, engine_copies
):
    sidecar = sidecar_per_layout("hybrid")
    kv, mamba = mha_host_pool(), mamba_host_pool()
    oracle = file_backend(str(tmp_path / "file"), kv, {PoolName.MAMBA: mamba})
    expected = _hybrid_run(oracle, kv, mamba, state_pages, False, token_base)

    kv, mamba = mha_host_pool(), mamba_host_pool()
    backend = hicache_backend(
        sidecar.endpoint, kv, {PoolName.MAMBA: mamba}, hicache_engine_copies=engine_copies
    )
    try:
        assert (backend.pages.copies(ComponentType.MAMBA) is not None) == engine_copies
        got = _hybrid_run(backend, kv, mamba, state_pages, True, token_base)
    finally:
        backend.close()
    assert got == expected
    assert got["bytes"] is True
    # the rule itself, not only agreement: a trailing-1 hit ends at the last state
    assert got[("trailing_pages", 1)][0] == max(state_pages) + 1


def _hybrid_controller_run(backend, kv, mamba, zero_copy: bool, state_at: list[int], base: int):
    """SGLang's hybrid controller writes a 6-page prefix in two steps (its first
    ``state_at[0]`` pages, then all six), each with a Mamba state for its last page when
    that step is in ``state_at``; then prefetches 8 pages (6 stored) into fresh pages."""
    ctl = HybridControllerShim(backend, kv, {PoolName.MAMBA: mamba}, zero_copy)
    tokens = list(range(base, base + STORED_PAGES * PAGE_SIZE))
    kv_idx = fill_pages(kv, STORED_PAGES, seed=17)
    states = {}
    for pages in (3, STORED_PAGES):
        slot = fill_pages(mamba, 1, seed=pages)
        states[pages] = host_page_bytes(mamba, slot, 1)[0]
        extra = {PoolName.MAMBA: slot} if pages in state_at else {}
        assert (
            ctl.backup(kv_idx[: pages * PAGE_SIZE], tokens[: pages * PAGE_SIZE], extra)
            == pages * PAGE_SIZE
        )
    query = tokens + [900_000_000 + t for t in range((QUERY_PAGES - STORED_PAGES) * PAGE_SIZE)]
    dst_slot = mamba.alloc(1)
    seen = ctl.prefetch(query, kv.alloc(QUERY_PAGES * PAGE_SIZE), {PoolName.MAMBA: dst_slot})
    hit = seen["hit_tokens"] // PAGE_SIZE
    seen["state_bytes_match"] = (
        hit in states and host_page_bytes(mamba, dst_slot, 1)[0] == states[hit]
    )
    return seen


@pytest.mark.parametrize("state_at", [[3, STORED_PAGES], [3], [STORED_PAGES]])
def test_hybrid_controller_calls_match_the_file_backend(
    sidecar_per_layout, token_base, tmp_path, state_at
):
    sidecar = sidecar_per_layout("hybrid")
    kv, mamba = mha_host_pool(), mamba_host_pool()
    oracle = file_backend(str(tmp_path / "file"), kv, {PoolName.MAMBA: mamba})
    expected = _hybrid_controller_run(oracle, kv, mamba, False, state_at, token_base)
    kv, mamba = mha_host_pool(allocator="shm"), mamba_host_pool()
    backend = hicache_backend(sidecar.endpoint, kv, {PoolName.MAMBA: mamba})
    try:
        got = _hybrid_controller_run(backend, kv, mamba, True, state_at, token_base)
    finally:
        backend.close()
    assert got == expected
    # the trailing-pages rule itself: the hit ends at the last page with a state
    assert got["hit_tokens"] == max(state_at) * PAGE_SIZE
    assert got["state_bytes_match"] is True


def _swa_run(backend, kv_pool, swa_pool, window_pages: int, base: int):
    """KV for six pages through the controller's backup, and SWA pages for only the last
    ``window_pages`` (what a hybrid full + sliding-window stack keeps of a prefix: the
    window); then the existence checks under the trailing-pages rule (the window, and one
    page more than was stored) and all pages, and a read of the window into fresh pages."""
    tokens = list(range(base, base + STORED_PAGES * PAGE_SIZE))
    keys = page_keys(tokens)
    ctl = ControllerShim(backend, kv_pool, False)
    assert ctl.backup(fill_pages(kv_pool, STORED_PAGES, seed=21), tokens) == len(tokens)
    src = fill_pages(swa_pool, window_pages, seed=31 + window_pages)
    res = backend.batch_set_v2(
        [PoolTransfer(name=PoolName.SWA, host_indices=src, keys=keys[-window_pages:])]
    )
    assert res[PoolName.SWA] == [True] * window_pages
    seen = {}
    for policy, trailing in ((PoolHitPolicy.TRAILING_PAGES, window_pages),
                             (PoolHitPolicy.TRAILING_PAGES, window_pages + 1),
                             (PoolHitPolicy.ALL_PAGES, 1)):  # fmt: skip
        r = backend.batch_exists_v2(
            keys, [PoolTransfer(name=PoolName.SWA, keys=keys[-trailing:], hit_policy=policy)]
        )
        seen[(policy.value, trailing)] = (
            r.kv_hit_pages,
            dict(r.extra_pool_hit_pages),
            r.restorable_prefix_pages,
        )
    dst = swa_pool.alloc(window_pages * PAGE_SIZE)
    got = backend.batch_get_v2(
        [PoolTransfer(name=PoolName.SWA, host_indices=dst, keys=keys[-window_pages:])]
    )
    seen["get"] = got[PoolName.SWA]
    seen["bytes"] = host_page_bytes(swa_pool, dst, window_pages) == host_page_bytes(
        swa_pool, src, window_pages
    )
    return seen


@pytest.mark.parametrize("engine_copies", [True, False])
@pytest.mark.parametrize("window_pages", [1, 3])
def test_sliding_window_pages_match_the_file_backend(
    sidecar_per_layout, token_base, tmp_path, window_pages, engine_copies
):
    """SGLang's full + SWA stack keeps its sliding-window layers in a second
    MHATokenToKVPoolHost, registered as the SWA pool: hicache answers its existence
    checks and moves its pages as SGLang's file backend does."""
    sidecar = sidecar_per_layout("swa")
    kv, swa = mha_host_pool(), mha_host_pool()
    oracle = file_backend(str(tmp_path / "file"), kv, {PoolName.SWA: swa})
    expected = _swa_run(oracle, kv, swa, window_pages, token_base)
    kv, swa = mha_host_pool(), mha_host_pool()
    backend = hicache_backend(
        sidecar.endpoint, kv, {PoolName.SWA: swa}, hicache_engine_copies=engine_copies
    )
    try:
        assert (backend.pages.copies(ComponentType.SWA) is not None) == engine_copies
        got = _swa_run(backend, kv, swa, window_pages, token_base)
    finally:
        backend.close()
    assert got == expected
    assert got["get"] == [True] * window_pages and got["bytes"] is True
    # the rule itself: a window of stored SWA pages hits the whole prefix; asking one page
    # more than was stored does not
    assert got[("trailing_pages", window_pages)][0] == STORED_PAGES
    assert got[("trailing_pages", window_pages + 1)][0] < STORED_PAGES


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_pages_copied_by_the_engine_are_the_pages_of_the_other_paths(
    sidecar_per_layout, token_base, layout
):
    """An instance that copies its pages itself and one that goes through staging pages
    store the same bytes under the same hashes: each reads what the other wrote, KV and
    Mamba state alike, and a page SGLang holds at another host index lands there."""
    sidecar = sidecar_per_layout(f"interop-{layout}")
    pools = {}
    backends = {}
    try:
        for copies in (True, False):
            kv, mamba = mha_host_pool(layout), mamba_host_pool()
            pools[copies] = (kv, mamba)
            backends[copies] = hicache_backend(
                sidecar.endpoint, kv, {PoolName.MAMBA: mamba}, hicache_engine_copies=copies
            )
            assert (backends[copies].pages.copies(ComponentType.FULL) is not None) == copies
        for writer in (True, False):
            reader = not writer
            base = token_base + (0 if writer else 500)
            keys = page_keys(list(range(base, base + STORED_PAGES * PAGE_SIZE)))
            kv, mamba = pools[writer]
            src = fill_pages(kv, STORED_PAGES, seed=41 + writer)
            slot = fill_pages(mamba, 1, seed=43 + writer)
            assert backends[writer].batch_set_v1(keys, src) == [True] * STORED_PAGES
            done = backends[writer].batch_set_v2(
                [PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=keys[-1:])]
            )
            assert done[PoolName.MAMBA] == [True]
            rkv, rmamba = pools[reader]
            rkv.alloc(3 * PAGE_SIZE)  # the reader's pages sit elsewhere in its pool
            dst, dst_slot = rkv.alloc(STORED_PAGES * PAGE_SIZE), rmamba.alloc(1)
            assert backends[reader].batch_get_v1(keys, dst) == [True] * STORED_PAGES
            got = backends[reader].batch_get_v2(
                [PoolTransfer(name=PoolName.MAMBA, host_indices=dst_slot, keys=keys[-1:])]
            )
            assert got[PoolName.MAMBA] == [True]
            assert host_page_bytes(rkv, dst, STORED_PAGES) == host_page_bytes(kv, src, STORED_PAGES)
            assert host_page_bytes(rmamba, dst_slot, 1) == host_page_bytes(mamba, slot, 1)
    finally:
        for b in backends.values():
            b.close()


def test_a_page_missing_from_a_copied_get_is_a_miss_and_the_rest_still_load(
    sidecar_per_layout, token_base
):
    """The engine-copied get of pages of which one was never stored: the stored ones load
    (their bytes exact), the missing one is a miss."""
    sidecar = sidecar_per_layout("layer_first")
    kv = mha_host_pool()
    backend = hicache_backend(sidecar.endpoint, kv)
    try:
        assert backend.pages.copies(ComponentType.FULL) is not None
        keys = page_keys(list(range(token_base, token_base + STORED_PAGES * PAGE_SIZE)))
        src = fill_pages(kv, STORED_PAGES, seed=5)
        stored = [k for i, k in enumerate(keys) if i != 2]
        idx = src.view(STORED_PAGES, PAGE_SIZE)
        kept = torch.cat([idx[i] for i in range(STORED_PAGES) if i != 2])
        assert backend.batch_set_v1(stored, kept) == [True] * (STORED_PAGES - 1)
        dst = kv.alloc(STORED_PAGES * PAGE_SIZE)
        got = backend.batch_get_v1(keys, dst)
        assert got == [i != 2 for i in range(STORED_PAGES)]
        d = dst.view(STORED_PAGES, PAGE_SIZE)
        for i in (0, 1, 3, 4, 5):
            assert host_page_bytes(kv, d[i], 1) == host_page_bytes(kv, idx[i], 1)
        assert backend.counters["load_failed"] == 1  # the first try, of all six, failed
    finally:
        backend.close()
