"""Miss reasons of the remote tier, produced for real: a killed master (a one-master
cluster of real ``redis-server`` processes) opens the breaker, and from then on a lookup
that misses counts ``breaker_open``; a selective write policy never wrote a page that
the host tier then evicted, so its miss counts ``write_policy``; a load-back from the
remote tier fails on a corrupted value (``checksum``), a store slower than the read
deadline (``deadline``) or a value gone since the lookup (``evicted``)."""

from __future__ import annotations

import signal

import pytest

from hicache import Request
from hicache.controller.config import RemoteWritePolicy
from hicache.controller.tiers.remote_store import MemoryStore
from hicache.types import ComponentType, Tier
from tests.controller.tiers.test_remote_faults import Node, one_page_prompts
from tests.controller.tiers.test_remote_tier import Node as MemoryNode
from tests.controller.tiers.test_remote_tier import seq
from tests.support.cluster import LocalCluster

FULL = ComponentType.FULL


def _misses(ctrl) -> dict[tuple[str, str], float]:
    out = {}
    for reason, tiers in ctrl.stats().get("miss_reasons", {}).items():
        for tier, comps in tiers.items():
            out[reason, tier] = comps.get("full", 0)
    return out


@pytest.fixture
def one_master(tmp_path):
    """One master on loopback, stopped by its PID after the test."""
    c = LocalCluster(tmp_path / "cluster", masters=1).start()
    yield c
    c.stop()


def test_a_killed_master_opens_the_breaker_and_misses_count_breaker_open(one_master, tmp_path):
    prompts = one_page_prompts(3)
    a = Node(tmp_path, "a", one_master.url)
    a.compute(prompts)
    a.close()
    one_master.signal(one_master.ports[0], signal.SIGKILL)
    b = Node(
        tmp_path, "b", one_master.url, remote_lookup_timeout_s=0.2, remote_breaker_failures=2,
        remote_breaker_cooldown_s=60.0,
    )  # fmt: skip
    hashes = b.page_hashes(prompts[0])
    for _ in range(2):  # every call fails on every key: the breaker opens
        b.ctrl.lookup(hashes, [FULL])
    assert b.remote_stats()["breaker_state"] == "open"
    before = _misses(b.ctrl).get(("breaker_open", "remote"), 0)
    assert b.ctrl.lookup(hashes, [FULL]).leading(FULL) == 0
    assert _misses(b.ctrl)[("breaker_open", "remote")] == before + 1
    runs = b.ctrl.store.explain(hashes, [FULL])
    assert runs[0]["why"]["full"]["reason"] == "breaker_open"
    b.ctrl.check_invariants()
    b.close()


def test_a_page_the_selective_policy_never_wrote_misses_as_write_policy_once_evicted():
    node = MemoryNode(MemoryStore(), remote_write_policy=RemoteWritePolicy.SELECTIVE)
    tokens = seq(3 * 4)
    node.compute(tokens)  # on host; never served, so never written to the remote tier
    hashes = node.hashes(tokens)
    assert node.ctrl.lookup(hashes, [FULL]).leading(FULL) == 3
    node.ctrl.store.evict(Tier.HOST, 1 << 30)
    assert node.ctrl.lookup(hashes, [FULL]).leading(FULL) == 0
    assert _misses(node.ctrl)[("write_policy", "remote")] == 1
    assert node.ctrl.store.explain(hashes, [FULL])[0]["why"]["full"]["tier"] == "remote"
    node.ctrl.check_invariants()
    node.ctrl.close()


@pytest.mark.parametrize(
    "fault, reason",
    [("corrupt", "checksum"), ("slow", "deadline"), ("deleted", "evicted")],
)
def test_a_remote_load_back_that_fails_counts_why(fault, reason):
    """Another node's pages, read from the remote tier: a value corrupted in the store
    fails its checksum, a store slower than the read deadline misses it, a value gone
    (evicted there) since the lookup found it is missing."""
    store = MemoryStore()
    a = MemoryNode(store)
    tokens = seq(5 * 4, base=3)
    a.compute(tokens)
    b = MemoryNode(store, remote_read_timeout_s=0.1)
    req = Request("b")
    m = b.cache.match_prefix(tokens, req=req)
    assert m.remote_hit_len == tokens.size
    if fault == "corrupt":
        for key, (head, body) in list(store._values.items()):
            # The payload's last byte (its tail travels after the header): one bit off.
            store._values[key] = (head[:-1] + bytes([head[-1] ^ 0x10]), body)
    elif fault == "slow":
        store.delay_s = 0.5
    else:
        store.delete(store.keys(), 1.0)
    assert not b.cache.load_back(m.load_node, req=req)
    store.delay_s = 0.0
    assert _misses(b.ctrl)[(reason, "remote")] >= 1
    b.cache.check_invariants()
    b.ctrl.check_invariants()
    b.ctrl.close()
    a.ctrl.close()
