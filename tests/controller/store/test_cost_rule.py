"""The cost rule: a lookup offers pages only a lower tier holds where loading them is
faster than the engine's prefill of them (a throttled disk tier makes it recompute, a
fast one load), counted as ``slower_than_recompute`` misses; off by a setting."""

from __future__ import annotations

import pytest

from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.local import LocalController
from hicache.controller_api import P_ABSENT, P_DISK, P_HOST
from hicache.types import ComponentType, Tier
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


def _slower(ctl: LocalController) -> float:
    return ctl.stats().get("miss_reasons", {}).get("slower_than_recompute", {}).get("disk", {})


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
    load_into(ctl, engine, chain, only=first)  # the first pages back on host
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
