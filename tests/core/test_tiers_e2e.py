"""The tree over a real LocalController (pinned-or-plain host pool + LMDB in a temp folder):
a prefix's life across tiers, restarts, corruption, and faults at every load stage."""

from __future__ import annotations

import lmdb
import numpy as np
import pytest

from hicache import Request
from hicache.config import PrefetchPolicy, WritePolicy
from hicache.controller.admin import ops as admin_ops
from hicache.controller.config import ControllerConfig
from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.local import LocalController
from hicache.types import Tier
from tests.support.cache import MIXES, MarkerEngine, make_cache

PS = 4


def seq(n: int, base: int = 0) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 11 + base) % 983 + 1


def controller(disk, host_pool_bytes: int = 4 << 20) -> LocalController:
    return LocalController(
        ControllerConfig(
            host_pool_bytes=host_pool_bytes, disk_path=disk, disk_budget_bytes=32 << 20
        )
    )


def tiered(mix: str, ctrl: LocalController, **config):
    cache = make_cache(mix, page_size=PS, window=6, full_slots=PS * 64, controller=ctrl, **config)
    return cache, MarkerEngine(cache)


def scribble(cache) -> None:
    cache.pools.full.buffer.fill_(-3.0)
    if cache.pools.swa is not None:
        cache.pools.swa.buffer.fill_(-3.0)
    if cache.pools.mamba is not None:
        cache.pools.mamba.conv.fill_(-3.0)


def settle(cache, ctrl) -> None:
    cache.flush_backups()
    assert ctrl.flush(30.0)


@pytest.mark.parametrize("mix", list(MIXES))
def test_prefix_life_device_host_disk_and_back(mix, tmp_path):
    disk = tmp_path / "lmdb"
    ctrl = controller(disk)
    cache, engine = tiered(mix, ctrl)
    tokens = seq(6 * PS)
    engine.run(tokens)
    settle(cache, ctrl)
    nodes = list(cache.tree.iter_nodes())
    assert nodes and all(n.data[0].backed for n in nodes)
    # device-evicted: host-only nodes, then loaded back from host, bit-exact
    cache.evict(full_tokens=10**6)
    cache.check_invariants()
    assert cache.stats().total_tokens == 0 and cache.stats().host_only_tokens == tokens.size
    scribble(cache)
    req = Request("host")
    m = cache.match_prefix(tokens, req=req)
    assert (m.prefix_len, m.host_hit_len, m.disk_hit_len) == (0, tokens.size, 0)
    assert cache.load_back(m.load_node, req=req)
    engine.verify_prefix(req, tokens, req.prefix_len)
    cache.cache_finished_req(req)
    cache.check_invariants()
    ctrl.check_invariants()
    cache.reset()
    ctrl.close()
    # disk-only: everything restarted from the same folder
    ctrl = controller(disk)
    cache, engine = tiered(mix, ctrl, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    scribble(cache)
    req = Request("disk")
    m = cache.match_prefix(tokens, req=req)
    assert (m.prefix_len, m.host_hit_len, m.disk_hit_len) == (0, 0, tokens.size)
    assert cache.load_back(m.load_node, req=req)
    engine.verify_prefix(req, tokens, req.prefix_len)
    cache.cache_finished_req(req)
    cache.check_invariants()
    ctrl.check_invariants()
    ctrl.close()


def test_restart_keeps_every_committed_prefix(tmp_path):
    disk = tmp_path / "lmdb"
    ctrl = controller(disk)
    cache, engine = tiered("full+swa+mamba", ctrl)
    prompts = [seq(5 * PS, base=b) for b in range(6)]
    for p in prompts:
        engine.run(p)
    settle(cache, ctrl)
    ctrl.close()
    ctrl = controller(disk)
    cache, engine = tiered("full+swa+mamba", ctrl, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    for p in prompts:
        req = engine.start(p)  # loads back from disk and verifies the markers
        assert req.prefix_len == p.size
        cache.cache_finished_req(req)
    cache.check_invariants()
    ctrl.close()


def test_corrupt_value_is_never_served_and_the_request_recomputes(tmp_path):
    disk = tmp_path / "lmdb"
    ctrl = controller(disk)
    cache, engine = tiered("full", ctrl)
    tokens = seq(4 * PS)
    engine.run(tokens)
    settle(cache, ctrl)
    ctrl.close()
    env = lmdb.open(str(disk), subdir=True, max_dbs=8)
    with env.begin(write=True) as txn:
        keys = []
        for db_name in (None,):
            for key, value in txn.cursor(db=env.open_db(db_name) if db_name else None):
                keys.append((key, bytes(value)))
        flipped = 0
        for key, value in keys:
            if len(value) > 64:
                corrupt = bytearray(value)
                corrupt[-5] ^= 0xFF
                txn.put(key, bytes(corrupt))
                flipped += 1
    env.close()
    assert flipped
    ctrl = controller(disk)
    cache, engine = tiered("full", ctrl, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    scribble(cache)
    req = Request("r")
    m = cache.match_prefix(tokens, req=req)
    if m.load_node is not None:
        assert cache.load_back(m.load_node, req=req) is False
    assert req.prefix_len == 0
    engine.compute(req, tokens, tokens.size)  # recompute: markers written afresh
    cache.cache_finished_req(req)
    cache.check_invariants()
    assert ctrl.counters.get("failures", "checksum") >= 1
    ctrl.close()


FAULT_KINDS = ["pin", "disk_read", "copy_to_device", "evict_before_load", "timeout"]


@pytest.mark.parametrize("fault", FAULT_KINDS)
@pytest.mark.parametrize("mix", ["full+swa+mamba", "full+mamba"])
def test_load_fault_at_every_stage_leaves_everything_as_it_was(fault, mix, tmp_path):
    disk = tmp_path / "lmdb"
    ctrl = controller(disk)
    cache, engine = tiered(mix, ctrl)
    tokens = seq(6 * PS)
    engine.run(tokens)
    engine.run(tokens[: 2 * PS])
    settle(cache, ctrl)
    cache.evict(full_tokens=10**6)
    engine.run(tokens[: 2 * PS])  # a device prefix of its own again (recomputed)
    settle(cache, ctrl)
    if fault in ("disk_read", "timeout"):  # the rest must come from disk
        ctrl.close()
        ctrl = controller(disk)
        cache, engine = tiered(
            mix, ctrl, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, load_timeout_s=0.2
        )
        engine.run(tokens[: 2 * PS])
    plan = FaultPlan()
    if fault == "timeout":
        plan.disk_read_delay_s = 1.0
    else:
        setattr(plan, fault, 1)
    ctrl.faults = plan
    req = Request("r")
    m = cache.match_prefix(tokens, req=req)
    assert m.prefix_len == 2 * PS and m.load_node is not None
    before = (cache.pools.free_counts(), req.kv_slots.copy(), req.mamba_slot)
    assert cache.load_back(m.load_node, req=req) is False
    cache.check_invariants()
    ctrl.check_invariants()
    assert cache.pools.free_counts() == before[0]
    assert np.array_equal(req.kv_slots, before[1]) and req.mamba_slot == before[2]
    engine.verify_prefix(req, tokens, req.prefix_len)
    engine.compute(req, tokens, tokens.size)
    cache.cache_finished_req(req)
    cache.check_invariants()
    ctrl.faults = None
    ctrl.close()


def test_write_back_reaches_disk_only_at_eviction(tmp_path):
    disk = tmp_path / "lmdb"
    ctrl = controller(disk)
    cache, engine = tiered("full+mamba", ctrl, write_policy=WritePolicy.WRITE_BACK)
    tokens = seq(4 * PS)
    engine.run(tokens)
    settle(cache, ctrl)
    assert not any(n.data[0].backed for n in cache.tree.iter_nodes())
    cache.evict(full_tokens=1)
    settle(cache, ctrl)
    m = cache.match_prefix(tokens)
    assert m.host_hit_len == tokens.size
    cache.check_invariants()
    ctrl.close()


def test_a_timed_prefetch_counts_each_page_of_the_match_once_and_loads_it(tmp_path):
    """prefetch_policy=timeout: the match looks the pages up once; the prefetched disk
    pages are loaded without a second lookup (which counted every page twice in the hit
    metrics), and the load is exact."""
    ctrl = controller(tmp_path / "lmdb")
    cache, engine = tiered(
        "full", ctrl, prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch_timeout_s=10.0
    )
    tokens = seq(8 * PS)
    engine.run(tokens)
    settle(cache, ctrl)
    cache.evict(full_tokens=10**6)
    admin_ops.evict(ctrl, Tier.HOST, 1 << 30)  # on disk only now
    scribble(cache)
    before = ctrl.stats()["lookup"]
    query = np.concatenate([tokens, seq(8 * PS, base=500)])  # 8 known pages, 8 unknown
    req = Request("timed")
    m = cache.match_prefix(query, req=req)
    after = ctrl.stats()["lookup"]
    delta = {r: after[r]["full"] - before.get(r, {}).get("full", 0) for r in after}
    assert sum(delta.values()) == 16, f"16 pages asked for, counted {delta}"
    assert delta.get("disk", 0) + delta.get("host", 0) == 8, delta
    assert m.load_node is not None
    assert cache.load_back(m.load_node, req=req)
    assert req.prefix_len == tokens.size
    engine.verify_prefix(req, tokens, req.prefix_len)
    cache.cache_finished_req(req, insert=False)
    cache.check_invariants()
    ctrl.check_invariants()
    ctrl.close()
