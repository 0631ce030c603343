"""Two SGLang instances on one node share pages through one sidecar; the pages outlive a
sidecar restart (from disk); a corrupt page is a miss, counted; a killed sidecar gives
misses within the documented bound, never an exception into SGLang's threads."""

from __future__ import annotations

import time

import lmdb
import pytest
import torch
from sglang_support import (
    PAGE_SIZE,
    ControllerShim,
    fill_pages,
    hicache_backend,
    host_page_bytes,
    mha_host_pool,
    page_keys,
)

from hicache.controller.client.channel import RemoteLayoutMismatch
from hicache.controller.tiers.lmdb_tier import HEADER_BYTES
from hicache.controller.wire.protocol import Verb
from hicache.controller_api import Presence
from hicache.types import ComponentType
from tests.support.sidecar import wait_for

PAGES = 6
TOKENS = list(range(PAGES * PAGE_SIZE))


def _instance(sidecar, allocator: str = "default", **overrides):
    pool = mha_host_pool(allocator=allocator)
    return pool, hicache_backend(sidecar.endpoint, pool, **overrides), ControllerShim


@pytest.mark.parametrize(("writer", "reader"), [("shm", "default"), ("default", "shm")])
def test_a_page_one_instance_stores_is_a_hit_with_the_same_bytes_for_another(
    sidecar, writer, reader
):
    # one instance zero-copy (its host pool in a memfd the sidecar maps), one through the
    # staging pages: the same layout, the same pages
    pool_a, a, shim = _instance(sidecar, writer)
    pool_b, b, _ = _instance(sidecar, reader)
    try:
        assert (a.zero_copy, b.zero_copy) == (writer == "shm", reader == "shm")
        src = fill_pages(pool_a, PAGES, seed=3)
        assert shim(a, pool_a, True).backup(src, TOKENS) == len(TOKENS)
        dst = pool_b.alloc(PAGES * PAGE_SIZE)
        found, loaded = shim(b, pool_b, True).prefetch(TOKENS, dst)
        assert found == loaded == len(TOKENS)
        assert host_page_bytes(pool_b, dst, PAGES) == host_page_bytes(pool_a, src, PAGES)
    finally:
        a.close()
        b.close()


def test_another_namespace_is_refused_at_attach_and_never_reads_a_page(sidecar):
    pool_a, a, shim = _instance(sidecar)
    try:
        src = fill_pages(pool_a, PAGES, seed=3)
        assert shim(a, pool_a, True).backup(src, TOKENS) == len(TOKENS)
        assert a.batch_exists(page_keys(TOKENS)) == PAGES
        # The sidecar serves one layout; another namespace (a salt here; another model,
        # dtype or rank the same way) is another layout: SGLang's attach fails, saying so.
        with pytest.raises(RemoteLayoutMismatch, match="one sidecar per layout"):
            _instance(sidecar, hicache_namespace="tenant-b")
        fp16_pool = mha_host_pool(dtype=torch.float16)
        with pytest.raises(RemoteLayoutMismatch):
            hicache_backend(sidecar.endpoint, fp16_pool)
    finally:
        a.close()


def test_pages_come_back_from_disk_after_a_sidecar_restart(sidecar):
    pool, backend, shim = _instance(sidecar)
    src = fill_pages(pool, PAGES, seed=5)
    want = host_page_bytes(pool, src, PAGES)
    assert shim(backend, pool, True).backup(src, TOKENS) == len(TOKENS)
    backend.close()
    assert sidecar.stop() == 0  # drains: every queued disk write is committed
    sidecar.start()

    pool, backend, _ = _instance(sidecar)
    try:
        hashes = [backend.hasher.page_hash(k) for k in page_keys(TOKENS)]
        where = backend.controller.lookup(hashes, [ComponentType.FULL]).presence
        assert list(where[ComponentType.FULL]) == [Presence.DISK] * PAGES  # host tier is new
        dst = pool.alloc(PAGES * PAGE_SIZE)
        found, loaded = shim(backend, pool, True).prefetch(TOKENS, dst)
        assert found == loaded == len(TOKENS)
        assert host_page_bytes(pool, dst, PAGES) == want
    finally:
        backend.close()


@pytest.mark.parametrize("read_ahead", [True, False])
def test_a_hit_query_starts_reading_its_disk_pages_to_host_before_the_get(sidecar, read_ahead):
    """After a restart the pages are on disk only: SGLang's hit query (``batch_exists``)
    answers the hit and, with ``hicache_read_ahead``, has the sidecar read the leading
    hit's pages to host before any get asks (nothing past the first miss); the get then
    loads them from host, the bytes the backup wrote. Without it they stay on disk until
    the get reads them."""
    pool, backend, shim = _instance(sidecar)
    src = fill_pages(pool, PAGES, seed=9)
    want = host_page_bytes(pool, src, PAGES)
    assert shim(backend, pool, True).backup(src, TOKENS) == len(TOKENS)
    backend.close()
    assert sidecar.stop() == 0
    sidecar.start()

    pool, backend, _ = _instance(sidecar, hicache_read_ahead=read_ahead)
    try:
        keys = page_keys(TOKENS)
        hashes = [backend.hasher.page_hash(k) for k in keys]

        def where() -> list[int]:
            rows = backend.controller.lookup(hashes, [ComponentType.FULL]).presence
            return [int(p) for p in rows[ComponentType.FULL]]

        assert where() == [Presence.DISK] * PAGES
        gap = page_keys(list(range(10_000, 10_000 + PAGE_SIZE)))[0]  # never stored
        assert backend.batch_exists([*keys[:3], gap, *keys[4:]]) == 3
        if read_ahead:
            wait_for(lambda: where()[:3] == [Presence.HOST] * 3, 10, "the hit read to host")
            assert backend.counters["read_ahead_pages"] == 3
        time.sleep(0.2)  # a read that would come comes by now
        assert where()[3:] == [Presence.DISK] * (PAGES - 3)  # past the first miss: not read
        assert where()[:3] == [Presence.HOST if read_ahead else Presence.DISK] * 3
        dst = pool.alloc(PAGES * PAGE_SIZE)
        assert all(backend.batch_get_v1(keys, dst))
        assert host_page_bytes(pool, dst, PAGES) == want
    finally:
        backend.close()


def test_a_zero_copy_instance_registers_its_pool_again_after_a_sidecar_restart(sidecar):
    pool, backend, shim = _instance(sidecar, "shm")
    try:
        assert backend.zero_copy
        src = fill_pages(pool, PAGES, seed=21)
        want = host_page_bytes(pool, src, PAGES)
        assert shim(backend, pool, True).backup(src, TOKENS) == len(TOKENS)
        assert sidecar.stop() == 0
        assert backend.batch_exists(page_keys(TOKENS)) == 0  # down: a miss, no exception
        sidecar.start()
        # the client reconnects on its own, handing the memfd over again; until it has,
        # its calls are misses
        wait_for(
            lambda: backend.batch_exists(page_keys(TOKENS)) == PAGES,
            30.0,
            "the backend to reconnect and see its pages on disk",
        )
        dst = pool.alloc(PAGES * PAGE_SIZE)
        found, loaded = shim(backend, pool, True).prefetch(TOKENS, dst)
        assert found == loaded == len(TOKENS)
        assert host_page_bytes(pool, dst, PAGES) == want
    finally:
        backend.close()


def test_a_corrupt_page_is_a_miss_and_is_counted(sidecar):
    pool, backend, shim = _instance(sidecar)
    src = fill_pages(pool, PAGES, seed=9)
    want = host_page_bytes(pool, src, PAGES)
    assert shim(backend, pool, True).backup(src, TOKENS) == len(TOKENS)
    bad = backend.hasher.page_hash(page_keys(TOKENS)[2])
    backend.close()
    assert sidecar.stop() == 0
    db = lmdb.open(str(sidecar.disk), map_size=1 << 30, subdir=True)
    with db.begin(write=True) as txn:
        key = bad + bytes((int(ComponentType.FULL),))
        value = bytearray(txn.get(key))
        value[HEADER_BYTES + 5] ^= 0xFF  # one flipped byte in the payload
        txn.put(key, bytes(value))
    db.close()
    sidecar.start()

    pool, backend, _ = _instance(sidecar)
    try:
        dst = pool.alloc(PAGES * PAGE_SIZE)
        found, loaded = shim(backend, pool, True).prefetch(TOKENS, dst)
        assert loaded == 2 * PAGE_SIZE  # the pages before the corrupt one, never it
        assert host_page_bytes(pool, dst, 2) == want[:2]
        admin = sidecar.admin()
        try:
            stats = admin.call(Verb.STATS)
        finally:
            admin.close()
        assert _corrupt_count(stats) >= 1, stats
    finally:
        backend.close()


def _corrupt_count(stats: dict) -> int:
    disk = stats.get("disk", {})
    failures = stats.get("failures", {})
    return int(disk.get("invalid_dropped", 0)) + int(failures.get("checksum", 0))


def test_a_killed_sidecar_gives_misses_within_the_bound(sidecar):
    pool, backend, shim = _instance(sidecar)
    src = fill_pages(pool, PAGES, seed=13)
    keys = page_keys(TOKENS)
    assert shim(backend, pool, True).backup(src, TOKENS) == len(TOKENS)
    sidecar.kill()
    opts = backend.options
    try:
        t0 = time.monotonic()
        assert backend.batch_exists(keys) == 0
        exists_s = time.monotonic() - t0
        t0 = time.monotonic()
        assert backend.batch_get_v1(keys, pool.alloc(PAGES * PAGE_SIZE)) == [False] * PAGES
        get_s = time.monotonic() - t0
        t0 = time.monotonic()
        assert backend.batch_set_v1(keys, src) == [False] * PAGES
        set_s = time.monotonic() - t0
        # the documented bound (docs/integrations/sglang.md): one lookup timeout for an
        # existence check, one load timeout plus margin for a read, one backup timeout for
        # a write; scheduling slack on a loaded machine on top
        slack_s = 2.0
        assert exists_s < opts["hicache_lookup_timeout_s"] + slack_s
        assert get_s < opts["hicache_lookup_timeout_s"] + opts["hicache_load_timeout_s"] + slack_s
        assert set_s < opts["hicache_backup_timeout_s"] + slack_s
        assert not backend.controller.available  # the breaker is open: later calls are free
        t0 = time.monotonic()
        assert backend.batch_exists(keys) == 0
        assert time.monotonic() - t0 < slack_s
    finally:
        backend.close()
