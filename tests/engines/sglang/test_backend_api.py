"""The rest of SGLang's storage interface on hicache's backend: the generic per-key calls,
clear, get_stats, bad input answered without an exception, and the prefill rate of its
extra config sent with its lookups."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang_support import (
    PAGE_SIZE,
    fill_pages,
    hicache_backend,
    host_page_bytes,
    mha_host_pool,
    page_keys,
)

from hicache.controller.wire.protocol import Verb


@pytest.fixture
def instance(sidecar_per_layout):
    pool = mha_host_pool()
    backend = hicache_backend(sidecar_per_layout("layer_first").endpoint, pool)
    yield pool, backend
    backend.close()


def test_generic_set_get_exists_by_key(instance):
    pool, backend = instance
    (key,) = page_keys(list(range(500, 500 + PAGE_SIZE)))
    idx = fill_pages(pool, 1, seed=31)
    (want,) = host_page_bytes(pool, idx, 1)
    assert not backend.exists(key)
    assert backend.get(key, pool.get_dummy_flat_data_page()) is None
    assert backend.set(key, pool.get_data_page(int(idx[0])))
    assert backend.exists(key)
    got = backend.get(key, pool.get_dummy_flat_data_page())
    assert bytes(got.view(torch.uint8).numpy()) == want


def test_get_stats_reports_the_pages_moved_since_the_last_call(instance):
    pool, backend = instance
    tokens = list(range(600, 600 + 3 * PAGE_SIZE))
    keys = page_keys(tokens)
    assert all(backend.batch_set_v1(keys, fill_pages(pool, 3, seed=1)))
    assert all(backend.batch_get_v1(keys, pool.alloc(3 * PAGE_SIZE)))
    first = backend.get_stats()
    assert (first.backup_pgs, first.prefetch_pgs) == ([3], [3])
    second = backend.get_stats()
    assert (second.backup_pgs, second.prefetch_pgs) == ([], [])
    assert backend.counters["set_pages"] == backend.counters["get_pages"] == 3


def test_clear_drops_this_namespaces_pages(instance):
    pool, backend = instance
    keys = page_keys(list(range(700, 700 + 4 * PAGE_SIZE)))
    assert all(backend.batch_set_v1(keys, fill_pages(pool, 4, seed=2)))
    assert backend.batch_exists(keys) == 4
    assert backend.clear() is True
    assert backend.batch_exists(keys) == 0


def test_bad_input_is_a_counted_failure_never_an_exception(instance):
    pool, backend = instance
    keys = page_keys(list(range(800, 800 + 2 * PAGE_SIZE)))
    short = pool.alloc(PAGE_SIZE)  # one page of indices for two keys
    assert backend.batch_set_v1(keys, short) == [False, False]
    assert backend.batch_get_v1(keys, short) == [False, False]
    assert backend.counters["bad_indices"] == 2
    # a pool hicache does not hold: its pages are misses, its writes fail
    unheld = PoolTransfer(name=PoolName.INDEXER, host_indices=short, keys=keys[:1])
    assert backend.batch_set_v2([unheld])[PoolName.INDEXER] == [False]
    assert all(backend.batch_set_v1(keys, pool.alloc(2 * PAGE_SIZE)))
    res = backend.batch_exists_v2(
        keys, [PoolTransfer(name=PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)]
    )
    assert res.kv_hit_pages == 0 and res.extra_pool_hit_pages == {PoolName.KV: 2}


def test_a_prefill_rate_given_in_the_extra_config_reaches_the_sidecars_cost_rule(
    sidecar_per_layout, token_base
):
    """SGLang's storage calls do not show its prefills: the rate is the operator's to give
    (``hicache_prefill_tokens_per_s``), and the backend's lookups carry it."""
    sidecar = sidecar_per_layout("layer_first")
    pool = mha_host_pool()
    backend = hicache_backend(sidecar.endpoint, pool, hicache_prefill_tokens_per_s=900)
    try:
        assert backend.controller.prefill_rate == 900.0
        backend.batch_exists(page_keys(list(range(token_base, token_base + PAGE_SIZE))))
        admin = sidecar.admin()
        try:
            rates = admin.call(Verb.STATS)["cost_rule"]["prefill_tokens_per_s"]
        finally:
            admin.close()
        assert rates[backend.controller.engine_id] == 900
    finally:
        backend.close()
