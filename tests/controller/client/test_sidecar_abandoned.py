"""Transfers the engine gave up on: a load or a backup that got no answer in time may still
run in the sidecar, so its device pages stay the engine's (a failed load's slots in the
cache's quarantine, a backup's nodes locked) until the sidecar's reply, or until a newer
session's registration, which the sidecar answers only once the old session's copies
have ended. Each test holds a copy inside the sidecar's controller at a gate, so the
order of events is fixed, and fails on a client that frees the pages at its deadline."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from hicache import CacheConfig, DevicePools, Request
from hicache.config import WritePolicy
from hicache.controller.client.sidecar_client import SidecarClientConfig, SidecarController
from hicache.controller.config import ControllerConfig
from hicache.controller.store.local import LocalController
from hicache.controller.wire.protocol import Verb
from hicache.controller_api import PageRef, unsettled_load
from hicache.keys import namespace_hash, page_hashes
from hicache.types import ComponentType
from tests.support.cache import MarkerEngine, make_cache, make_layout
from tests.support.sidecar import GatedCopy, ServerThread, wait_for

PAGE = 4
FULL = ComponentType.FULL
CLIENT = SidecarClientConfig(
    request_timeout_s=5.0,
    lookup_timeout_s=5.0,
    connect_timeout_s=5.0,
    reconnect_interval_s=0.05,
    load_timeout_margin_s=0.05,
    backup_timeout_s=0.2,
)


class GatedSidecar:
    """An in-process sidecar whose controller holds each load or backup at a gate: a load
    on a worker waits at the gate before it starts; a load begun on the I/O thread and
    every backup start at once, and their copies do not end while the gate is shut."""

    def __init__(self, workdir, **sidecar) -> None:
        self.controller = LocalController(ControllerConfig(host_pool_bytes=4 << 20))
        self.endpoint = "ipc://" + str(workdir / "s.sock")
        self.served = ServerThread(self.controller, workdir / "s.sock", **sidecar)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)
        self.calls = {"load": 0, "backup": 0}
        real_load = self.controller.load

        def gated(*a, **kw):
            self.calls["load"] += 1
            self.entered.release()
            assert self.gate.wait(30), "the test never opened the gate"
            return real_load(*a, **kw)

        self.controller.load = gated
        # A backup may begin on the I/O thread (inline_copies.py), which must never block:
        # its copy is "held" by a handle that does not end before the gate opens.
        real_backup = self.controller.backup

        def gated_backup(*a, **kw):
            self.calls["backup"] += 1
            self.entered.release()
            return GatedCopy(real_backup(*a, **kw), self.gate)

        self.controller.backup = gated_backup
        # A small load of pages on host is begun on the I/O thread (inline_copies.py): its
        # copy is "held" by a load that does not report its end before the gate opens.
        real_start = self.controller.start_load

        def gated_start(*a, **kw):
            load = real_start(*a, **kw)
            if load is None or isinstance(load, bool):
                return load
            self.calls["load"] += 1
            self.entered.release()
            return GatedCopy(load, self.gate)

        self.controller.start_load = gated_start

    def hold(self) -> None:
        self.gate.clear()

    def wait_entered(self) -> None:
        assert self.entered.acquire(timeout=10), "the copy never reached the controller"

    def stop(self) -> None:
        self.gate.set()
        self.served.stop()
        self.controller.close()


@pytest.fixture
def side(workdir):
    s = GatedSidecar(workdir)
    yield s
    s.stop()


def _engine(endpoint: str):
    layout = make_layout("full")
    cfg = CacheConfig(page_size=PAGE, full_slots=64 * PAGE, shared_memory=True)
    pools = DevicePools.allocate(layout, cfg)
    client = SidecarController(endpoint, "engine-a", CLIENT)
    client.register(layout, PAGE, pools)
    return layout, pools, client


def _chain(layout, pools, n: int = 4) -> list[PageRef]:
    fp = layout.fingerprint(PAGE)
    hashes = page_hashes(np.arange(n * PAGE) + 77, fp, PAGE)
    parents = [namespace_hash(fp, None), *hashes[:-1]]
    pages = pools.alloc_kv_pages(n)
    slots = torch.from_numpy(pools.full.pages_to_slots(pages))
    pools.full.buffer[:, :, slots] = torch.randn(pools.full.buffer[:, :, slots].shape)
    return [PageRef(FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, pages)]


def test_an_abandoned_load_stays_pending_until_the_sidecar_has_finished_it(side):
    layout, pools, client = _engine(side.endpoint)
    try:
        refs = _chain(layout, pools)
        assert client.backup(refs).wait(10)
        pin = client.pin([r.key for r in refs], 60)
        assert pin is not None
        dst = pools.alloc_kv_pages(len(refs))
        into = [PageRef(FULL, r.page_hash, r.parent_hash, int(p)) for r, p in zip(refs, dst)]
        side.hold()
        result = client.load(into, pin, 0.05)
        side.wait_entered()
        assert not result, "a load that got no answer cannot have succeeded"
        pending = unsettled_load(result)
        assert pending is not None, "the client gave up on a copy that may still write"
        # The breaker opened, so the client reconnects; the new registration must wait
        # for the load still held inside the sidecar.
        time.sleep(0.5)
        assert not pending.done(), "settled while the sidecar's copy could still write"
        assert not client.available
        side.gate.set()
        wait_for(pending.done, 10, "the abandoned load settled")
        wait_for(lambda: client.available, 10, "the new session")
        assert client.stats()["client"]["unsettled_transfers"] == 0
    finally:
        side.gate.set()
        client.close()
        pools.close()


def test_an_abandoned_backup_is_not_done_while_its_copy_may_read(side):
    layout, pools, client = _engine(side.endpoint)
    try:
        refs = _chain(layout, pools)
        side.hold()
        handle = client.backup(refs)
        side.wait_entered()
        assert not handle.wait(), "the backup's deadline passed: its outcome is a failure"
        time.sleep(0.3)
        assert not handle.done(), "done while the sidecar may still read the pages"
        side.gate.set()
        wait_for(handle.done, 10, "the abandoned backup settled")
    finally:
        side.gate.set()
        client.close()
        pools.close()


def test_requests_of_a_dropped_session_that_had_not_started_are_refused(one_worker_side):
    side = one_worker_side  # one worker: the second load queues behind the first
    layout, pools, client = _engine(side.endpoint)
    try:
        refs = _chain(layout, pools)
        assert client.backup(refs).wait(10)
        pin = client.pin([r.key for r in refs], 60)
        dst = pools.alloc_kv_pages(len(refs))
        into = [PageRef(FULL, r.page_hash, r.parent_hash, int(p)) for r, p in zip(refs, dst)]
        side.hold()
        first = client.load(into, pin, 0.05)
        side.wait_entered()
        # Sent on the same session before the client noticed: queued behind the first.
        second = client._channel.send(
            Verb.LOAD, {"refs": {}, "pin_id": pin.pin_id, "timeout_s": 1.0}, 5.0
        )
        assert second
        time.sleep(0.3)  # the reconnect's hello drops the old session meanwhile
        side.gate.set()
        wait_for(unsettled_load(first).done, 10, "the first load settled")
        wait_for(lambda: client.available, 10, "the new session")
        assert side.calls["load"] == 1, "a request of a dropped session ran"
    finally:
        side.gate.set()
        client.close()
        pools.close()


@pytest.fixture
def one_worker_side(workdir):
    s = GatedSidecar(workdir, worker_threads=1)
    yield s
    s.stop()


def _sidecar_cache(side):
    client = SidecarController(side.endpoint, "engine-cache", CLIENT)
    cache = make_cache(
        "full", page_size=PAGE, full_slots=32 * PAGE, controller=client, shared_memory=True
    )
    return cache, client


def test_a_failed_load_back_keeps_its_slots_until_the_copy_has_ended(side):
    cache, client = _sidecar_cache(side)
    eng = MarkerEngine(cache)
    try:
        a = np.arange(1, 4 * PAGE + 1, dtype=np.int64)
        eng.run(a)
        cache.flush_backups()
        cache.evict(full_tokens=10**6)
        cache.check_invariants()
        free_before = cache.pools.full.available()
        req = eng.start(a, load=False)
        m = cache.match_prefix(a)
        assert m.load_node is not None and m.host_hit_len == a.size
        side.hold()
        cache.config.load_timeout_s = 0.05
        assert not cache.load_back(m.load_node, req=req)
        cache.check_invariants()
        held = cache.stats().quarantined_pages
        assert held == a.size // PAGE, "the failed load's slots went back to the pool"
        assert cache.pools.full.available() == free_before - a.size
        # Another request takes every free slot and writes its own KV into them.
        b = np.arange(500, 500 + cache.pools.full.available(), dtype=np.int64)
        other = eng.start(b)
        eng.compute(other, b, b.size)
        side.gate.set()  # the late copy writes into the quarantined slots only
        wait_for(
            lambda: (cache.poll_transfers(), cache.stats().quarantined_pages)[1] == 0,
            10,
            "the quarantine released",
        )
        eng.verify_prefix(other, b, b.size, state=False)
        cache.check_invariants()
        cache.cache_finished_req(other)
        cache.cache_finished_req(req)
        cache.check_invariants()
        assert cache.pools.full.available() + cache.stats().total_tokens >= free_before
    finally:
        side.gate.set()
        client.close()


def test_a_backup_that_timed_out_keeps_its_nodes_until_it_settles(side):
    cache, client = _sidecar_cache(side)
    eng = MarkerEngine(cache)
    try:
        a = np.arange(1, 4 * PAGE + 1, dtype=np.int64)
        side.hold()
        eng.run(a)  # write-through: a backup of a's pages, held in the sidecar
        side.wait_entered()
        cache.flush_backups(timeout_s=0.3)
        cache.check_invariants()
        cache.evict(full_tokens=10**6)
        cache.check_invariants()
        m = cache.match_prefix(a)
        assert m.prefix_len == a.size, "a's pages were freed while the copy could read them"
        side.gate.set()
        cache.flush_backups()
        cache.check_invariants()
        cache.evict(full_tokens=10**6)
        cache.check_invariants()
        assert cache.pools.full.available() == cache.pools.full.capacity
    finally:
        side.gate.set()
        client.close()


def test_a_flush_with_a_stalled_sidecar_takes_one_settling_budget_not_one_per_backup(side):
    cache, client = _sidecar_cache(side)
    eng = MarkerEngine(cache)
    try:
        side.hold()
        n = 6
        for i in range(n):  # write-through: one backup per request, all held
            eng.run(np.arange(1, 2 * PAGE + 1, dtype=np.int64) + 1000 * (i + 1))
        side.wait_entered()
        assert len(cache.backups.pending) == n
        cache.config.load_timeout_s = 0.5
        t0 = time.monotonic()
        cache.flush_backups()
        took = time.monotonic() - t0
        assert took < CLIENT.backup_timeout_s + 2 * cache.config.load_timeout_s, (
            f"flush_backups held the engine {took:.2f}s for {n} backups"
        )
        cache.check_invariants()
        side.gate.set()
        wait_for(lambda: (cache.poll_transfers(), not cache.backups.pending)[1], 10, "settled")
        cache.check_invariants()
    finally:
        side.gate.set()
        client.close()


def test_write_back_pages_kept_in_quarantine_do_not_count_as_freed(side):
    client = SidecarController(side.endpoint, "engine-wb", CLIENT)
    cache = make_cache(
        "full",
        page_size=PAGE,
        full_slots=8 * PAGE,
        controller=client,
        shared_memory=True,
        write_policy=WritePolicy.WRITE_BACK,
        load_timeout_s=0.3,
    )
    eng = MarkerEngine(cache)
    try:
        for i in range(4):  # four cached prefixes of two pages: the pool is full
            eng.run(np.arange(1, 2 * PAGE + 1, dtype=np.int64) + 1000 * (i + 1))
        assert cache.pools.full.available() == 0
        side.hold()  # the first write-back gets no answer in time
        req = Request(rid=99)
        cache.match_prefix(np.arange(5000, 5000 + 2 * PAGE), req=req)
        cache.alloc_tokens(req, 2 * PAGE)  # 6 more evictable pages: this must fit
        cache.check_invariants()
        assert cache.stats().quarantined_pages == 2
        side.gate.set()
        wait_for(
            lambda: (cache.poll_transfers(), cache.stats().quarantined_pages)[1] == 0,
            10,
            "the quarantine released",
        )
        cache.cache_finished_req(req, insert=False)
        cache.check_invariants()
    finally:
        side.gate.set()
        client.close()


def test_a_slow_prefetch_neither_drops_the_session_nor_stays_unsettled(side):
    gate = threading.Event()
    real = side.controller.prefetch

    def slow_prefetch(*a, **kw):  # a slow disk read
        gate.wait(30)
        return real(*a, **kw)

    side.controller.prefetch = slow_prefetch
    layout = make_layout("full")
    cfg = CacheConfig(page_size=PAGE, full_slots=64 * PAGE, shared_memory=True)
    pools = DevicePools.allocate(layout, cfg)
    client = SidecarController(
        side.endpoint, "engine-p", dataclasses.replace(CLIENT, request_timeout_s=0.5)
    )
    client.register(layout, PAGE, pools)
    try:
        refs = _chain(layout, pools)
        assert client.backup(refs).wait(10)
        handle = client.prefetch([r.key for r in refs])
        assert not handle.wait()  # no answer by its deadline: a failed prefetch
        assert handle.done(), "a prefetch never touches the engine's pages"
        assert client.available, "one slow prefetch opened the breaker"
        gate.set()
        client.prefetch([r.key for r in refs])  # answered at once, handle dropped
        time.sleep(0.3)
        assert client.stats()["client"]["unsettled_transfers"] == 0
        # Nobody will take the dropped prefetch's reply: the channel keeps none of them
        # (an engine prefetching best-effort on every match would grow it without end).
        for _ in range(5):
            client.prefetch([r.key for r in refs])
        assert client.lookup([r.page_hash for r in refs], [ComponentType.FULL]).presence
        time.sleep(0.3)
        client.lookup([r.page_hash for r in refs], [ComponentType.FULL])  # replies read in
        assert not client._channel._replies and not client._channel._expected
    finally:
        gate.set()
        client.close()
        pools.close()
