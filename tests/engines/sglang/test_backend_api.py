"""The rest of SGLang's storage interface on hicache's backend: the generic per-key calls,
clear, get_stats, bad input answered without an exception, and the prefill rate of its
extra config sent with its lookups."""

from __future__ import annotations

import time

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
from hicache.types import ComponentType


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


def test_a_get_after_its_hit_query_copies_under_the_querys_pin(instance, monkeypatch):
    """SGLang's hit query pins its leading hit; the get that follows copies under that pin
    (no pin round trip first), a get of the hit's first pages too; the bytes are the ones
    stored. A get of other pages, a pin too old, or one let go for a newer query loads as
    usual, and as exactly. No more than ``MAX_HIT_PINS`` pins wait for their gets."""
    from hicache.integrations import sglang_hit_pins

    pool, backend = instance
    assert backend.pages.copies(ComponentType.FULL) is not None  # the engine-copies path
    keys = page_keys(list(range(900, 900 + 6 * PAGE_SIZE)))
    src = fill_pages(pool, 6, seed=41)
    want = host_page_bytes(pool, src, 6)
    assert all(backend.batch_set_v1(keys, src))
    counters = backend.pages.counters

    def get(n: int) -> list[bytes]:
        dst = pool.alloc(n * PAGE_SIZE)
        try:
            assert all(backend.batch_get_v1(keys[:n], dst))
            return host_page_bytes(pool, dst, n)
        finally:
            pool.free(dst)

    assert backend.batch_exists(keys) == 6
    assert get(6) == want and counters["get_under_hit_pin"] == 1
    assert backend.batch_exists(keys) == 6
    assert get(4) == want[:4] and counters["get_under_hit_pin"] == 2  # the hit's first pages
    assert get(6) == want and counters["get_under_hit_pin"] == 2  # taken already: as usual

    monkeypatch.setattr(sglang_hit_pins, "HIT_PIN_TTL_S", 0.2)
    assert backend.batch_exists(keys) == 6
    time.sleep(0.15)  # past half its time to live: let go, not used
    assert get(6) == want and counters["get_under_hit_pin"] == 2
    monkeypatch.setattr(sglang_hit_pins, "HIT_PIN_TTL_S", 10.0)

    monkeypatch.setattr(sglang_hit_pins, "MAX_HIT_PINS", 2)
    others = [page_keys(list(range(b, b + PAGE_SIZE))) for b in (5000, 6000, 7000)]
    for i, k in enumerate(others):
        assert all(backend.batch_set_v1(k, fill_pages(pool, 1, seed=50 + i)))
    for k in [keys, *others]:
        assert backend.batch_exists(k) == len(k)  # each a hit: the first pin goes first
    assert len(backend.pages.hit_pins._pins) == 2
    assert get(6) == want and counters["get_under_hit_pin"] == 2
