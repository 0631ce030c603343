"""The remote tier over the in-memory store: its rules, with faults injected.

Two controllers sharing one :class:`MemoryStore` play two nodes. Covered: the store's
per-key contract (a property test against a plain dict), probes that stop at the first
hole, the breaker (opened by a dead store, not by failing keys), bounded hints, the
write policies, a bounded write queue that never holds host pages, and load-backs from
remote that fail cleanly (pools and request exactly as before).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache import Request
from hicache.config import PrefetchPolicy
from hicache.controller.config import ControllerConfig, RemoteWritePolicy
from hicache.controller.store.local import LocalController
from hicache.controller.tiers.remote_health import BreakerState, CircuitBreaker, PresenceHints
from hicache.controller.tiers.remote_store import KeyStatus, MemoryStore
from hicache.controller_api import P_ABSENT, P_REMOTE
from hicache.keys import chain_page_hashes, namespace_hash
from hicache.types import ComponentType
from tests.support.cache import MarkerEngine, make_cache

PS = 4
MIX = "full+swa+mamba"


class Node:
    def __init__(self, store: MemoryStore, host_pool_bytes: int = 4 << 20, **remote) -> None:
        config = ControllerConfig(host_pool_bytes=host_pool_bytes, disk_path=None, **remote)
        self.ctrl = LocalController(config, remote_store=store)
        self.cache = make_cache(
            MIX, page_size=PS, window=6, full_slots=PS * 64, controller=self.ctrl,
            prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
        )  # fmt: skip
        self.engine = MarkerEngine(self.cache)

    def compute(self, *prompts: np.ndarray) -> None:
        for p in prompts:
            self.engine.run(p)
        self.cache.flush_backups()
        assert self.ctrl.flush(10.0)

    def hashes(self, prompt: np.ndarray) -> list[bytes]:
        h0 = namespace_hash(self.cache.layout.fingerprint(PS), None)
        return chain_page_hashes(h0, prompt.astype(np.int64).tobytes(), PS)

    def remote(self) -> dict:
        return self.ctrl.stats()["remote"]


def seq(n: int, base: int = 0) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 13 + base) % 977 + 1


# -- the store's contract --------------------------------------------------------------------

KEYS = [bytes([65 + i]) for i in range(5)]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "exists", "delete"]),
            st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
            st.binary(max_size=8),
        ),
        max_size=30,
    )
)
def test_memory_store_answers_per_key_like_a_dict(ops):
    store, model = MemoryStore(), {}
    for op, keys, data in ops:
        if op == "put":
            assert store.put([(k, b"h" + data, data) for k in keys], 1.0) == [KeyStatus.OK] * len(
                keys
            )
            model.update({k: (b"h" + data, data) for k in keys})
        elif op == "delete":
            store.delete(keys, 1.0)
            for k in keys:
                model.pop(k, None)
        elif op == "exists":
            want = [KeyStatus.OK if k in model else KeyStatus.MISSING for k in keys]
            assert store.exists(keys, 1.0) == want
        else:
            for k, got in zip(keys, store.get(keys, 1.0), strict=True):
                if k in model:
                    assert (got.status, got.head, got.body) == (KeyStatus.OK, *model[k])
                else:
                    assert got.status is KeyStatus.MISSING
    assert sorted(store.keys()) == sorted(model)


def test_memory_store_faults_are_per_key_results_never_exceptions():
    store = MemoryStore(capacity_bytes=10, eviction="noeviction")
    assert store.put([(b"a", b"12345", b"123"), (b"b", b"12345", b"")], 1.0) == [
        KeyStatus.OK,
        KeyStatus.FULL,
    ]
    store.fail_keys = {b"a"}
    assert store.exists([b"a", b"b"], 1.0) == [KeyStatus.ERROR, KeyStatus.MISSING]
    store.fail_keys = set()
    store.delay_s = 0.2
    t0 = time.monotonic()
    assert store.exists([b"a"], 0.05) == [KeyStatus.ERROR]  # the deadline, not the delay
    assert time.monotonic() - t0 < 0.15
    store.delay_s, store.down = 0.0, True
    assert [f.status for f in store.get([b"a"], 1.0)] == [KeyStatus.ERROR]


# -- breaker and hints ----------------------------------------------------------------------


def test_breaker_opens_on_failed_calls_trials_after_cooldown_and_closes():
    breaker = CircuitBreaker(failures=2, cooldown_s=0.05)
    breaker.record(False)
    assert breaker.allow() and breaker.state is BreakerState.CLOSED
    breaker.record(False)
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    time.sleep(0.06)
    assert breaker.allow() and breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow()  # one trial at a time
    breaker.record(False)  # the trial failed: open again
    assert breaker.state is BreakerState.OPEN
    time.sleep(0.06)
    assert breaker.allow()
    breaker.record(True)
    assert breaker.state is BreakerState.CLOSED and breaker.opened == 2


def test_hints_are_bounded_and_expire():
    hints = PresenceHints(max_entries=3, ttl_s=0.05)
    for k in (b"a", b"b", b"c", b"d"):
        hints.add(k, None)
    assert len(hints) == 3 and hints.get(b"a") == (False, None)
    assert hints.get(b"d") == (True, None)
    time.sleep(0.06)
    assert hints.get(b"d") == (False, None)


# -- probes ---------------------------------------------------------------------------------


def test_probe_stops_at_the_first_hole_and_reports_nothing_after_it():
    store = MemoryStore()
    a = Node(store)
    tokens = seq(10 * PS)
    a.compute(tokens)
    hashes = a.hashes(tokens)
    from hicache.controller.tiers.remote_store import remote_key

    store.delete([remote_key("hicache", hashes[5], ComponentType.FULL)], 1.0)
    b = Node(MemoryStore(), remote_probe_chunk_pages=2)
    b.ctrl.store._tiers[-1].remote_store = store  # B reads the same store; probes counted below
    before = store.calls.get("exists", 0)
    res = b.ctrl.lookup(hashes, [ComponentType.FULL, ComponentType.SWA])
    full = res.presence[ComponentType.FULL]
    assert list(full[:5]) == [P_REMOTE] * 5 and (full[5:] == P_ABSENT).all()
    assert (res.presence[ComponentType.SWA][5:] == P_ABSENT).all()
    assert store.calls["exists"] - before == 3  # pages 0-1, 2-3, 4-5: nothing after
    b.ctrl.check_invariants()


def test_breaker_opens_when_the_store_is_down_and_one_failing_key_does_not(monkeypatch):
    store = MemoryStore()
    a = Node(store, remote_breaker_failures=2, remote_breaker_cooldown_s=0.1)
    tokens = seq(3 * PS)
    a.compute(tokens)
    hashes = a.hashes(tokens)
    b = Node(store, remote_breaker_failures=2, remote_breaker_cooldown_s=0.1)
    store.fail_keys = set(store.keys()[:1])
    for _ in range(5):
        b.ctrl.lookup(hashes, [ComponentType.FULL])
    assert b.ctrl.stats()["remote_tier"]["breaker_state"] == "closed"
    store.fail_keys, store.down = set(), True
    for _ in range(3):
        res = b.ctrl.lookup(hashes, [ComponentType.FULL])
        assert (res.presence[ComponentType.FULL] == P_ABSENT).all()
    assert b.ctrl.stats()["remote_tier"]["breaker_state"] == "open"
    calls = store.calls["exists"]
    b.ctrl.lookup(hashes, [ComponentType.FULL])
    assert store.calls["exists"] == calls  # open: the store is not asked
    store.down = False
    time.sleep(0.12)
    res = b.ctrl.lookup(hashes, [ComponentType.FULL])  # the trial call, which succeeds
    assert (res.presence[ComponentType.FULL] == P_REMOTE).all()
    assert b.ctrl.stats()["remote_tier"]["breaker_state"] == "closed"
    b.ctrl.check_invariants()


# -- load-back from remote ------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["down", "deleted", "slow"])
def test_failed_remote_load_back_leaves_pools_and_request_as_they_were(fault):
    store = MemoryStore()
    a = Node(store)
    tokens = seq(5 * PS, base=3)
    a.compute(tokens)
    b = Node(store, remote_read_timeout_s=0.1)
    req = Request("b")
    m = b.cache.match_prefix(tokens, req=req)
    assert m.remote_hit_len == tokens.size
    free_before = b.cache.pools.free_counts()
    if fault == "down":
        store.down = True
    elif fault == "deleted":
        store.delete(store.keys(), 1.0)
    else:
        store.delay_s = 0.5
    t0 = time.monotonic()
    assert not b.cache.load_back(m.load_node, req=req)
    assert time.monotonic() - t0 < 0.5 + 0.4  # the fill gave up at its read deadline
    assert b.cache.pools.free_counts() == free_before
    assert req.prefix_len == 0 and req.kv_slots.size == 0
    b.cache.check_invariants()
    b.ctrl.check_invariants()
    assert b.remote()["fills"][{"down": "error", "deleted": "missing", "slow": "error"}[fault]]
    store.delay_s, store.down = 0.0, False


# -- writes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(RemoteWritePolicy))
def test_write_policies(policy):
    store = MemoryStore()
    # A small host tier: the later prompts evict the first one's pages from host.
    a = Node(store, host_pool_bytes=8 << 10, remote_write_policy=policy)
    first = seq(3 * PS, base=1)
    a.compute(first)
    written = len(store.keys())
    if policy is RemoteWritePolicy.WRITE_THROUGH:
        assert written > 0
    else:
        assert written == 0
    if policy is RemoteWritePolicy.SELECTIVE:
        a.cache.evict(full_tokens=10**6)
        req = Request("again")
        m = a.cache.match_prefix(first, req=req)
        assert a.cache.load_back(m.load_node, req=req)  # served a load: now written
        a.cache.cache_finished_req(req)
        assert a.ctrl.flush(10.0) and len(store.keys()) > 0
    if policy is RemoteWritePolicy.ON_HOST_EVICTION:
        for i in range(20):
            a.compute(seq(3 * PS, base=100 + i))
        assert a.ctrl.stats()["evictions"]["host"]["full"] > 0
        assert len(store.keys()) > 0
    if policy is RemoteWritePolicy.OFF:
        assert store.calls.get("put", 0) == 0
    a.cache.check_invariants()
    a.ctrl.check_invariants()


def test_write_overload_queue_bound_holds_drops_counted_host_eviction_never_waits():
    store = MemoryStore()
    store.delay_s = 0.3  # a slow cluster: each write batch takes 0.3 s
    a = Node(store, host_pool_bytes=8 << 10, remote_write_queue_pages=6,
             remote_write_batch_pages=2, remote_write_timeout_s=5.0)  # fmt: skip
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, a.ctrl.stats()["remote_tier"]["write_queue_pages"])
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(30):
            a.engine.run(seq(3 * PS, base=10 * i))
            a.cache.flush_backups()
    finally:
        stop.set()
        watcher.join()
    stats = a.ctrl.stats()
    assert 0 < peak <= 6
    assert stats["remote"]["write_dropped"]["queue_full"] > 0
    # The host tier kept turning over while the writer was stuck: queued pages were
    # evictable, and no backup failed for want of a host page.
    assert stats["evictions"]["host"]["full"] > 0
    assert stats["failures"]["host_full"] == 0
    a.cache.check_invariants()
    a.ctrl.check_invariants()
