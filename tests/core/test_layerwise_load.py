"""Layer-wise load-back over a real LocalController: started for every layer at once,
waited on layer by layer in order (a copy thread on a CPU), with the whole load's
guarantees — the bytes of each layer are the prefix's, and a failure at any layer leaves
the tree, the pools, the pins and the request as they were, and the request recomputes."""

from __future__ import annotations

import numpy as np
import pytest

from hicache import Request
from hicache.controller.store.faults import FaultPlan
from hicache.controller_api import LayerGroups
from hicache.layout import LayerKind
from hicache.types import ComponentType
from tests.core.test_tiers_e2e import PS, controller, scribble, seq, settle, tiered
from tests.support.cache import MIXES, kv_marker, state_marker

MIX = "full+swa+mamba"  # model layers: 0 full attention, 1 sliding window, 2 Mamba


def host_prefix(tmp_path, mix: str = MIX, pages: int = 6, device_pages: int = 2, **config):
    """A cache whose ``tokens`` lie ``device_pages`` on the device, the rest on host."""
    ctrl = controller(tmp_path / "lmdb")
    cache, engine = tiered(mix, ctrl, **config)
    tokens = seq(pages * PS)
    engine.run(tokens)
    engine.run(tokens[: device_pages * PS])
    settle(cache, ctrl)
    cache.evict(full_tokens=10**6)
    scribble(cache)  # what is loaded must be the prefix's, not what the slots held
    if device_pages:
        engine.run(tokens[: device_pages * PS])  # a device prefix of its own again
    settle(cache, ctrl)
    return ctrl, cache, engine, tokens


def layer_holds_prefix(cache, load, before: np.ndarray, tokens: np.ndarray, layer: int) -> bool:
    """Whether model layer ``layer`` of the load's view holds ``tokens``' state."""
    layout, pools = cache.layout, cache.pools
    n = load.prefix_len
    slots = np.concatenate([before, *load.view.full_slots])
    assert slots.size == n
    kind = layout.layer_kinds[layer]
    if kind is LayerKind.FULL:
        i = layout.full_layers.index(layer)
        got = pools.full.buffer[0, i, slots, 0, 0].cpu()  # read after the wait, in order
        return bool((got == kv_marker(tokens[:n], 0)).all())
    if kind is LayerKind.SWA:
        i = layout.swa_layers.index(layer)
        lo = max(0, n - cache.config.sliding_window)
        pages = slots[lo:n] // PS
        swa = [load.view.swa_pages.get(p, int(pools.full_to_swa[p])) for p in pages.tolist()]
        swa_slots = np.asarray(swa) * PS + slots[lo:n] % PS
        got = pools.swa.buffer[0, i, swa_slots, 0, 0].cpu()
        return bool((got == kv_marker(tokens[lo:n], lo)).all())
    i = layout.mamba_layers.index(layer)
    conv = pools.mamba.conv[i, load.view.state_slot].cpu()
    return bool((conv == state_marker(tokens[:n])).all())


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("device_pages", [0, 2])
def test_each_layer_is_the_prefix_once_waited_for_and_finish_installs_it(
    mix, device_pages, tmp_path
):
    ctrl, cache, engine, tokens = host_prefix(tmp_path, mix, device_pages=device_pages)
    req = Request("layered")
    m = cache.match_prefix(tokens, req=req)
    assert m.prefix_len == device_pages * PS and m.load_node is not None
    before = req.kv_slots.copy()
    load = cache.start_load_back(m.load_node, req=req)
    assert load is not None and load.prefix_len == tokens.size
    assert len(load.groups) == len(cache.layout.layer_kinds)
    for layer in range(len(cache.layout.layer_kinds)):
        assert load.wait_layer(layer)
        assert layer_holds_prefix(cache, load, before, tokens, layer)
    assert req.prefix_len == device_pages * PS  # nothing is installed before finish
    assert load.finish() and load.finish()  # a second call gives the first's answer
    assert req.prefix_len == tokens.size
    assert np.array_equal(req.kv_slots, np.concatenate([before, *load.view.full_slots]))
    engine.verify_prefix(req, tokens, tokens.size)
    cache.check_invariants()
    ctrl.check_invariants()
    assert ctrl.stats()["pins_active"] == 0
    engine.compute(req, np.concatenate([tokens, seq(PS, base=7)]), tokens.size + PS)
    cache.cache_finished_req(req)
    cache.check_invariants()
    ctrl.close()


def test_groups_of_several_layers_follow_the_model_order(tmp_path):
    ctrl, cache, engine, tokens = host_prefix(tmp_path)
    groups = LayerGroups.of_layout(cache.layout, size=2)
    assert groups.spans == (
        {ComponentType.FULL: (0, 1), ComponentType.SWA: (0, 1)},
        {ComponentType.MAMBA: (0, 1)},
    )
    assert [groups.group_of(j) for j in range(3)] == [0, 0, 1]
    req = Request("pairs")
    m = cache.match_prefix(tokens, req=req)
    before = req.kv_slots.copy()
    load = cache.start_load_back(m.load_node, req=req, groups=groups)
    for layer in range(3):
        assert load.wait_layer(layer)
        assert layer_holds_prefix(cache, load, before, tokens, layer)
    assert load.finish()
    engine.verify_prefix(req, tokens, tokens.size)
    cache.cache_finished_req(req)
    cache.check_invariants()
    ctrl.close()


@pytest.mark.parametrize("failing", [0, 1, 2])
@pytest.mark.parametrize("device_pages", [0, 2])
def test_a_failure_at_layer_k_leaves_no_trace_and_the_request_recomputes(
    failing, device_pages, tmp_path
):
    ctrl, cache, engine, tokens = host_prefix(tmp_path, device_pages=device_pages)
    req = Request("r")
    m = cache.match_prefix(tokens, req=req)
    before = (cache.pools.free_counts(), req.kv_slots.copy(), req.mamba_slot, req.prefix_len)
    amounts = ("evictable", "protected", "total_tokens", "host_only_tokens", "quarantined_pages")
    stats_before = [getattr(cache.stats(), a) for a in amounts]
    ctrl.faults = FaultPlan(copy_at_layer=failing)
    load = cache.start_load_back(m.load_node, req=req)
    assert load is not None
    for layer in range(failing):
        assert load.wait_layer(layer)
        assert layer_holds_prefix(cache, load, before[1], tokens, layer)
    assert not load.wait_layer(failing)
    for later in range(failing, 3):
        assert not load.wait_layer(later)
    assert load.finish() is False and load.finish() is False
    assert ctrl.faults.fired == {"copy_at_layer": 1}
    cache.check_invariants()
    ctrl.check_invariants()
    assert ctrl.stats()["pins_active"] == 0
    assert cache.pools.free_counts() == before[0]
    assert np.array_equal(req.kv_slots, before[1])
    assert (req.mamba_slot, req.prefix_len) == before[2:]
    # What was on host only still is (a node may have been cut where the load cut it).
    assert [getattr(cache.stats(), a) for a in amounts] == stats_before
    assert cache.counters["load_back_failed_copy"] == 1
    # The request recomputes what it could not load, exactly.
    engine.verify_prefix(req, tokens, req.prefix_len)
    engine.compute(req, tokens, tokens.size)
    engine.verify_prefix(req, tokens, tokens.size, state=False)
    cache.cache_finished_req(req)
    cache.check_invariants()
    # And the next request loads the same prefix layer-wise without a fault.
    ctrl.faults = None
    req = Request("again")
    m = cache.match_prefix(tokens, req=req)
    if m.load_node is not None:
        load = cache.start_load_back(m.load_node, req=req)
        assert all(load.wait_layer(j) for j in range(3)) and load.finish()
    engine.verify_prefix(req, tokens, tokens.size)
    cache.cache_finished_req(req)
    cache.check_invariants()
    ctrl.close()


def test_a_failure_before_any_copy_returns_none_with_nothing_changed(tmp_path):
    ctrl, cache, engine, tokens = host_prefix(tmp_path)
    req = Request("r")
    m = cache.match_prefix(tokens, req=req)
    before = (cache.pools.free_counts(), req.kv_slots.copy(), req.mamba_slot)
    ctrl.faults = FaultPlan(pin=1)
    assert cache.start_load_back(m.load_node, req=req) is None
    cache.check_invariants()
    ctrl.check_invariants()
    assert cache.pools.free_counts() == before[0]
    assert np.array_equal(req.kv_slots, before[1]) and req.mamba_slot == before[2]
    cache.cache_finished_req(req, insert=False)
    cache.check_invariants()
    ctrl.close()


def test_a_controller_without_layer_wise_copies_loads_whole(tmp_path):
    """A controller that only loads whole (a test double, a sidecar over TCP) serves the
    same calls: every layer is ready once its one load has ended."""
    ctrl, cache, engine, tokens = host_prefix(tmp_path)

    class WholeOnly:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            if name == "start_layer_load":
                raise AttributeError(name)
            return getattr(self._inner, name)

    cache.loader.controller = WholeOnly(ctrl)
    req = Request("whole")
    m = cache.match_prefix(tokens, req=req)
    load = cache.start_load_back(m.load_node, req=req)
    assert all(load.wait_layer(j) for j in range(3)) and load.finish()
    engine.verify_prefix(req, tokens, tokens.size)
    cache.cache_finished_req(req)
    cache.check_invariants()
    ctrl.check_invariants()
    ctrl.close()
