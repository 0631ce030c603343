"""The cost rule: a lookup offers pages only a lower tier holds where loading them is
faster than the engine's prefill of them (a throttled disk or remote tier makes it
recompute, a fast one load), counted as ``slower_than_recompute`` misses of that tier;
a rate the engine reports overrides one measured for it; a tier cut for long is let
through once per ``cost_rule_recheck_s`` to be measured again (a clock injected); off by
a setting."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.local import LocalController
from hicache.controller.tiers.remote_store import MemoryStore
from hicache.controller_api import P_ABSENT, P_DISK, P_HOST, P_REMOTE
from hicache.types import ComponentType, Tier
from tests.controller.tiers.test_remote_tier import Node as RemoteNode
from tests.controller.tiers.test_remote_tier import seq
from tests.support.controller import (
    PAGE,
    assert_same_bytes,
    controller_config,
    load_into,
    registered_controller,
)

FULL = ComponentType.FULL
ALL = (FULL, ComponentType.SWA, ComponentType.MAMBA)
FAST_ENGINE = 1e12  # tokens per second: any read is slower
SLOW_ENGINE = 1e-3  # any read is faster


def _on_disk_only(tmp_path, read_delay_s: float, **config):
    """A chain stored, the controller restarted (pages on disk only), one load from disk
    measured (a disk tier throttled by ``read_delay_s``), and the host tier cleared."""
    layout, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(6 * PAGE))
    assert ctl.backup(chain.refs()).wait(10.0)
    snap = engine.snapshot(chain)
    ctl.close()
    ctl = LocalController(controller_config(tmp_path, **config))
    ctl.register(layout, PAGE, engine.pools)
    ctl.faults = FaultPlan(disk_read_delay_s=read_delay_s)  # the throttle
    load_into(ctl, engine, chain)  # measures the tier
    ctl.faults.disk_read_delay_s = 0.0
    ctl.store.clear([Tier.HOST])
    ctl.check_invariants()
    return engine, ctl, chain, snap


def _slower(ctl: LocalController, tier: str = "disk") -> dict:
    return ctl.stats().get("miss_reasons", {}).get("slower_than_recompute", {}).get(tier, {})


def _full_row(ctl: LocalController, chain) -> list[int]:
    return ctl.lookup(chain.hashes, ALL).presence[FULL].tolist()


def test_a_throttled_disk_is_recomputed_and_counted(tmp_path):
    engine, ctl, chain, snap = _on_disk_only(tmp_path, read_delay_s=0.05)
    assert _full_row(ctl, chain) == [P_DISK] * 6  # no rate reported: offered
    ctl.report_prefill_rate(FAST_ENGINE)
    assert _full_row(ctl, chain) == [P_ABSENT] * 6
    assert _slower(ctl)["full"] == 6
    ctl.report_prefill_rate(SLOW_ENGINE)  # the same tier, an engine slower than it
    assert _full_row(ctl, chain) == [P_DISK] * 6
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.check_invariants(deep=True)
    ctl.close()


def test_host_pages_are_offered_and_only_the_disk_run_is_cut(tmp_path):
    engine, ctl, chain, _ = _on_disk_only(tmp_path, read_delay_s=0.05)
    first = set(chain.page_keys()) - set(chain.page_keys()[len(chain.page_keys()) // 2 :])
    assert ctl.prefetch(list(first)).wait(10.0)  # the first pages back on host
    ctl.report_prefill_rate(FAST_ENGINE)
    row = _full_row(ctl, chain)
    held = row.index(P_ABSENT)
    assert held > 0 and row[:held] == [P_HOST] * held and row[held:] == [P_ABSENT] * (6 - held)
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_measured_fast_disk_is_loaded(tmp_path):
    engine, ctl, chain, snap = _on_disk_only(tmp_path, read_delay_s=0.0)
    cost = ctl.store.read_cost(Tier.DISK)
    assert cost is not None and cost.seconds_per_byte is not None
    # An engine that takes far longer per token than this tier takes per page.
    ctl.report_prefill_rate(PAGE / (1000 * cost.seconds(1 << 20)))
    assert _full_row(ctl, chain) == [P_DISK] * 6
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.close()


@pytest.mark.parametrize("through", ["setting", "session"])
def test_the_rule_turns_off_with_its_setting(tmp_path, through):
    if through == "setting":
        engine, ctl, chain, _ = _on_disk_only(tmp_path, read_delay_s=0.05, cost_rule=False)
        ctl.report_prefill_rate(FAST_ENGINE)
    else:  # on, but the engine reports no rate (an engine session's own call)
        engine, ctl, chain, _ = _on_disk_only(tmp_path, read_delay_s=0.05)
        ctl.session("local").report_prefill_rate(None)
    assert _full_row(ctl, chain) == [P_DISK] * 6
    assert not _slower(ctl)
    ctl.close()


def test_a_reported_rate_overrides_a_measured_one(tmp_path):
    engine, ctl, chain, _ = _on_disk_only(tmp_path, read_delay_s=0.05)
    ctl.report_prefill_rate(FAST_ENGINE, measured=True)  # what an integration measured
    assert _full_row(ctl, chain) == [P_ABSENT] * 6
    ctl.report_prefill_rate(SLOW_ENGINE)  # the engine's own figure wins
    assert _full_row(ctl, chain) == [P_DISK] * 6
    ctl.report_prefill_rate(FAST_ENGINE / 2, measured=True)
    assert _full_row(ctl, chain) == [P_DISK] * 6
    assert ctl.stats()["cost_rule"]["prefill_tokens_per_s"] == {"local": round(SLOW_ENGINE)}
    ctl.report_prefill_rate(None)  # reported no more: the measured one again
    assert _full_row(ctl, chain) == [P_ABSENT] * 6
    ctl.close()


def test_a_tier_cut_for_long_is_let_through_once_per_interval(tmp_path):
    engine, ctl, chain, snap = _on_disk_only(tmp_path, read_delay_s=0.05)
    cost = ctl.store.read_cost(Tier.DISK)
    now = [cost.read_at]
    cost.clock = lambda: now[0]
    ctl.report_prefill_rate(FAST_ENGINE)
    assert _full_row(ctl, chain) == [P_ABSENT] * 6
    now[0] += ctl.config.cost_rule_recheck_s  # no read for an interval
    assert _full_row(ctl, chain) == [P_DISK] * 6  # offered once, to be measured again
    assert _full_row(ctl, chain) == [P_ABSENT] * 6  # cut again until the next interval
    now[0] += ctl.config.cost_rule_recheck_s / 2
    assert _full_row(ctl, chain) == [P_ABSENT] * 6
    now[0] += ctl.config.cost_rule_recheck_s / 2
    assert _full_row(ctl, chain) == [P_DISK] * 6
    # The offered run loaded: measured again (as fast now), and loaded from then on.
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.store.clear([Tier.HOST])
    ctl.report_prefill_rate(PAGE / (1000 * cost.seconds(1 << 20)))
    assert cost.read_at == now[0]
    assert _full_row(ctl, chain) == [P_DISK] * 6
    ctl.check_invariants(deep=True)
    ctl.close()


# -- the remote tier ---------------------------------------------------------------------


def _remote_only() -> tuple[MemoryStore, RemoteNode, np.ndarray]:
    """Node a computed a prompt and wrote it to the shared store; node b (nothing local)
    loaded another of a's prompts from it through a throttled store (measured) and is
    left with ``tokens`` on the remote tier only."""
    store = MemoryStore()
    a = RemoteNode(store)
    tokens, other = seq(6 * 4, base=1), seq(6 * 4, base=500)
    a.compute(tokens, other)
    a.ctrl.close()
    b = RemoteNode(store)
    store.delay_s = 0.05  # the throttle: every call, probe and read
    req = b.engine.run(other)  # measures the tier (latency and bytes per second)
    assert req.prefix_len == other.size
    store.delay_s = 0.0
    b.cache.check_invariants()
    b.ctrl.check_invariants()
    return store, b, tokens


def test_a_throttled_remote_tier_is_recomputed_and_counted():
    store, b, tokens = _remote_only()
    cost = b.ctrl.store.read_cost(Tier.REMOTE)
    assert cost.latency_s > 0 and cost.seconds_per_byte is not None
    hashes = b.hashes(tokens)
    assert b.ctrl.lookup(hashes, ALL).presence[FULL].tolist() == [P_REMOTE] * 6  # no rate
    b.ctrl.report_prefill_rate(FAST_ENGINE)
    assert b.ctrl.lookup(hashes, ALL).presence[FULL].tolist() == [P_ABSENT] * 6
    assert _slower(b.ctrl, "remote")["full"] == 6
    req = b.engine.start(tokens)  # the engine's own match: nothing to load
    assert req.prefix_len == 0
    b.cache.cache_finished_req(req, insert=False)
    b.cache.check_invariants()
    b.ctrl.check_invariants()
    b.ctrl.close()


def test_a_remote_tier_faster_than_the_engine_is_loaded_exactly():
    store, b, tokens = _remote_only()
    b.ctrl.report_prefill_rate(SLOW_ENGINE)
    fills = b.remote()["fills"]["ok"]
    req = b.engine.start(tokens)  # matched, loaded from remote and checked by its markers
    assert req.prefix_len == tokens.size
    assert b.remote()["fills"]["ok"] > fills
    assert not _slower(b.ctrl, "remote")
    b.cache.cache_finished_req(req)
    b.cache.check_invariants()
    b.ctrl.check_invariants()
    b.ctrl.close()


def test_a_tier_read_in_fixed_batches_costs_a_round_trip_per_round_of_batches():
    """The remote tier's shape: batches of ``batch_pages`` pages, one per reader at a
    time; a run of fewer batches than readers is read at the rate of those it has."""
    from hicache.controller.store.cost_rule import ReadCost

    cost = ReadCost(readers=4, batch_pages=16)
    cost.observe_round_trip(0.01)
    cost.observe(1 << 20, 0.01 + 0.1)  # one reader: 1 MiB in 0.1 s past the latency
    assert cost.seconds_per_byte == pytest.approx(0.1 / (1 << 20))
    assert cost.seconds(1 << 20, pages=16) == pytest.approx(0.01 + 0.1)  # one batch
    assert cost.seconds(4 << 20, pages=64) == pytest.approx(0.01 + 0.1)  # four at once
    assert cost.seconds(8 << 20, pages=128) == pytest.approx(2 * 0.01 + 0.2)  # two rounds
    spread = ReadCost(readers=4)  # the disk tier's shape: one batch per reader
    spread.observe(1 << 20, 0.1)
    assert spread.seconds(1 << 20, pages=1) == pytest.approx(0.1 / 4)
