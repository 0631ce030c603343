"""The remote tier when the cluster misbehaves (real ``redis-server`` processes).

A master killed without replicas: its pages miss fast, the others hit, lookups stay
within their deadline. With replicas: hits resume after the failover. A hung master
(SIGSTOP): every call returns within 1.5 x its deadline. A cluster absent at start: the
node serves from its own tiers and uses the cluster once it appears. A full cluster:
under allkeys-lru a chain is served up to its first hole, under noeviction refused
writes are dropped and counted. Whatever happens, a load serves the right bytes or none.
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from hicache import Request
from hicache.config import PrefetchPolicy
from hicache.controller.config import ControllerConfig
from hicache.controller.store.local import LocalController
from hicache.controller.store.page_codec import encode_value
from hicache.controller.tiers.remote_cluster import ClusterSettings, ClusterStore, parse_remote_url
from hicache.controller.tiers.remote_store import KeyStatus, remote_key, split_value
from hicache.keys import chain_page_hashes, namespace_hash
from hicache.types import ComponentType
from tests.support.cache import MarkerEngine, make_cache
from tests.support.cluster import LocalCluster

PS = 4
MIX = "full"


class Node:
    """A controller with its own host and disk tiers, a cache and a marker engine."""

    def __init__(self, tmp_path, name: str, url: str, page_size: int = PS, **remote) -> None:
        # A generous probe deadline unless a test measures it: on a loaded 2-core machine
        # a late node is a miss, and these tests assert what is served.
        remote.setdefault("remote_lookup_timeout_s", 2.0)
        self.ctrl = LocalController(
            ControllerConfig(
                host_pool_bytes=8 << 20, disk_path=tmp_path / name, disk_budget_bytes=64 << 20,
                remote_url=url, **remote,
            )
        )  # fmt: skip
        self.cache = make_cache(
            MIX, page_size=page_size, window=None, full_slots=page_size * 160,
            controller=self.ctrl, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
        )  # fmt: skip
        self.engine = MarkerEngine(self.cache)

    def compute(self, prompts: list[np.ndarray]) -> None:
        for p in prompts:
            self.engine.run(p)
        self.cache.flush_backups()
        assert self.ctrl.flush(30.0)

    def page_hashes(self, prompt: np.ndarray) -> list[bytes]:
        """The chain of ``prompt``'s whole pages (in the default namespace)."""
        h0 = namespace_hash(self.cache.layout.fingerprint(self.cache.page_size), None)
        return chain_page_hashes(h0, prompt.astype(np.int64).tobytes(), self.cache.page_size)

    def fetch(self, prompt: np.ndarray) -> tuple[int, float]:
        """Match and load ``prompt``: (tokens loaded from remote, seconds of the match);
        whatever was loaded is checked against the markers."""
        req = Request(f"r{len(self.cache.requests)}")
        t0 = time.perf_counter()
        m = self.cache.match_prefix(prompt, req=req)
        seconds = time.perf_counter() - t0
        if m.load_node is not None:
            self.cache.load_back(m.load_node, req=req)
        self.engine.verify_prefix(req, prompt, req.prefix_len)
        got = m.remote_hit_len if req.prefix_len == m.remote_hit_len else 0
        self.cache.cache_finished_req(req, insert=False)
        self.cache.check_invariants()
        return got, seconds

    def remote_stats(self) -> dict:
        return self.ctrl.stats()["remote_tier"]

    def close(self) -> None:
        self.ctrl.close()


def one_page_prompts(n: int, base: int = 0) -> list[np.ndarray]:
    return [np.arange(PS, dtype=np.int64) + 1 + PS * (i + base) for i in range(n)]


def owner(cluster: LocalCluster, page_hash: bytes) -> int:
    """The port of the master that owns the page's FULL key now."""
    from redis.cluster import key_slot

    slot = key_slot(remote_key("hicache", page_hash, ComponentType.FULL))
    for port in cluster.master_ports:
        for lo, hi in _slot_ranges(cluster, port):
            if lo <= slot <= hi:
                return port
    raise AssertionError(f"slot {slot} has no owner")


def _slot_ranges(cluster: LocalCluster, port: int) -> list[tuple[int, int]]:
    me = cluster.client(port).execute_command("CLUSTER MYID")
    me = me.decode() if isinstance(me, bytes) else me
    ranges = []
    for start, end, master, *_ in cluster.client(port).execute_command("CLUSTER SLOTS"):
        node_id = master[2].decode() if isinstance(master[2], bytes) else master[2]
        if node_id == me:
            ranges.append((int(start), int(end)))
    return ranges


@pytest.fixture
def cluster_factory(tmp_path):
    started: list[LocalCluster] = []

    def make(**kw) -> LocalCluster:
        c = LocalCluster(tmp_path / f"cluster{len(started)}", **kw)
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop()


def test_killed_master_without_replicas_misses_fast_the_rest_hit(cluster_factory, tmp_path):
    cluster = cluster_factory(masters=3).start()
    prompts = one_page_prompts(24)
    a = Node(tmp_path, "a", cluster.url)
    a.compute(prompts)
    owners = [owner(cluster, a.page_hashes(p)[0]) for p in prompts]
    a.close()
    victim = cluster.ports[0]
    assert 0 < owners.count(victim) < len(prompts)
    cluster.signal(victim, signal.SIGKILL)
    deadline_s = 0.2
    b = Node(tmp_path, "b", cluster.url, remote_lookup_timeout_s=deadline_s)
    seconds = []
    for prompt, port in zip(prompts, owners, strict=True):
        got, s = b.fetch(prompt)
        seconds.append(s)
        assert got == (0 if port == victim else PS), f"page on {port}"
    assert np.quantile(seconds, 0.99) <= deadline_s + 0.2, seconds
    assert b.remote_stats()["breaker_state"] == "closed"  # one dead node does not open it
    b.ctrl.check_invariants()
    b.close()


def test_killed_master_with_replicas_hits_resume_after_failover(cluster_factory, tmp_path):
    node_timeout_s = 2.0
    cluster = cluster_factory(masters=3, replicas=1, node_timeout_ms=int(node_timeout_s * 1000))
    cluster.start()
    prompts = one_page_prompts(18)
    a = Node(tmp_path, "a", cluster.url)
    a.compute(prompts)
    owners = [owner(cluster, a.page_hashes(p)[0]) for p in prompts]
    a.close()
    for port in cluster.master_ports:  # every write on its replica before the kill
        assert cluster.client(port).execute_command("WAIT", 1, 5000) == 1
    victim = cluster.ports[0]
    on_victim = [p for p, o in zip(prompts, owners, strict=True) if o == victim]
    assert on_victim
    b = Node(tmp_path, "b", cluster.url, remote_lookup_timeout_s=0.2)
    cluster.signal(victim, signal.SIGKILL)
    killed = time.monotonic()
    pending = list(on_victim)
    while pending:
        assert time.monotonic() - killed < node_timeout_s + 6.0, f"{len(pending)} still miss"
        pending = [p for p in pending if b.fetch(p)[0] != PS]
        time.sleep(0.1)
    for prompt in prompts:  # every page back, and right (fetch checks the bytes)
        assert b.fetch(prompt)[0] in (0, PS)
    b.ctrl.check_invariants()
    b.close()


def test_hung_master_every_call_returns_within_one_and_a_half_deadlines(cluster_factory, tmp_path):
    cluster = cluster_factory(masters=3).start()
    deadline_s = 0.3
    seeds, _, _ = parse_remote_url(cluster.url)
    timeouts = {f"{op}_timeout_s": deadline_s for op in ("lookup", "read", "write")}
    store = ClusterStore(ClusterSettings(seeds, failure_hint_s=0.5, **timeouts))
    rng = np.random.default_rng(3)
    items = []
    for _ in range(30):
        value = encode_value(ComponentType.FULL, bytes(16), bytes(16), rng.bytes(1024))
        key = remote_key("hicache", rng.bytes(16), ComponentType.FULL)
        items.append((key, *split_value(value)))
    assert store.put(items, 5.0) == [KeyStatus.OK] * len(items)
    keys = [it[0] for it in items]
    cluster.signal(cluster.ports[1], signal.SIGSTOP)
    try:
        calls = {
            "exists": lambda: store.exists(keys, deadline_s),
            "get": lambda: [f.status for f in store.get(keys, deadline_s)],
            "put": lambda: store.put(items, deadline_s),
            "delete": lambda: store.delete(keys[:3], deadline_s),
        }
        for _round in range(3):  # the first call meets the hang; later ones the hint
            for op, call in calls.items():
                t0 = time.monotonic()
                statuses = call()
                took = time.monotonic() - t0
                assert took <= 1.5 * deadline_s, f"{op} took {took:.3f} s"
                assert KeyStatus.OK in statuses or op == "delete", (op, statuses)
            time.sleep(0.3)
        # The controller's lookups keep their deadline too.
        a = Node(tmp_path, "a", cluster.url, remote_lookup_timeout_s=deadline_s)
        for prompt in one_page_prompts(8):
            _, s = a.fetch(prompt)
            assert s <= 1.5 * deadline_s
        a.close()
    finally:
        cluster.signal(cluster.ports[1], signal.SIGCONT)
        store.close()


def test_cluster_absent_at_start_then_used_once_it_appears(cluster_factory, tmp_path):
    cluster = cluster_factory(masters=3)
    a = Node(tmp_path, "a", cluster.url, remote_breaker_cooldown_s=0.2)
    first = one_page_prompts(4)
    a.compute(first)  # served from its own tiers throughout
    assert all(a.cache.match_prefix(p).prefix_len == PS for p in first)
    dropped = a.ctrl.stats()["remote"]["write_dropped"]
    assert sum(dropped.values()) >= len(first)
    assert a.remote_stats()["breaker_state"] in ("open", "half_open")
    cluster.start()
    later = one_page_prompts(6, base=100)
    deadline = time.monotonic() + 15
    while a.ctrl.stats()["transfer"].get("host_to_remote", {}).get("pages", 0) < len(later):
        assert time.monotonic() < deadline, a.remote_stats()
        a.compute(later)  # backups after the breaker closed reach the cluster
        later = [p + 1000 for p in later]
        time.sleep(0.2)
    assert a.remote_stats()["breaker_state"] == "closed"
    a.ctrl.check_invariants()
    a.close()


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_full_cluster_serves_up_to_the_first_hole(cluster_factory, tmp_path, policy):
    cluster = cluster_factory(masters=3, policy=policy).start()
    page = 64
    page_bytes = 2 * 2 * page * 2 * 4 * 4  # K and V of two full layers
    pages = 160
    # Room for about 135 of the chain's pages: 45 pages a master, so that the clients' own
    # connection buffers (counted as used memory) leave most of the margin to pages.
    for port in cluster.master_ports:
        used = cluster.client(port).info("memory")["used_memory"]
        cluster.client(port).config_set("maxmemory", used + 45 * page_bytes)
    chain = np.arange(pages * page, dtype=np.int64) % 997 + 1
    # Small batches: a batch's bytes sit in the server's query buffer, which counts as
    # used memory until the batch is stored.
    # A generous write deadline: on a loaded 2-core machine a batch that times out is
    # dropped too, and this test is about what a full cluster refuses.
    a = Node(
        tmp_path, "a", cluster.url, page_size=page, remote_write_batch_pages=4,
        remote_write_timeout_s=10.0,
    )  # fmt: skip
    a.compute([chain])
    stats = a.ctrl.stats()
    if policy == "noeviction":
        assert stats["remote"]["write_dropped"]["full"] > 0  # refused, counted
    keys = [remote_key("hicache", h, ComponentType.FULL) for h in a.page_hashes(chain)]
    a.close()
    seeds, _, _ = parse_remote_url(cluster.url)
    store = ClusterStore(ClusterSettings(seeds))
    present = [s is KeyStatus.OK for s in store.exists(keys, 5.0)]
    store.close()
    assert not all(present)  # the cluster could not hold the whole chain
    hole = present.index(False)
    b = Node(tmp_path, "b", cluster.url, page_size=page)
    b.cache.pools.full.buffer.fill_(-3.0)
    got, _ = b.fetch(chain)  # checks every byte it loaded
    assert got == hole * page  # served up to the first hole, nothing after it
    if policy == "noeviction":
        assert hole > 0, present[:12]
    b.ctrl.check_invariants()
    b.close()
