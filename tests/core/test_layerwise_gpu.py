"""Layer-wise load-back on a CUDA device: each layer group's copy is queued on the load
stream with its own event, and ``wait_layer`` makes the reading stream wait for it (the
host does not); what is read after the wait is the prefix, and a failure at layer k leaves
no trace. Run on a GPU machine with ``pytest -m gpu``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache import Request
from hicache.controller.store.faults import FaultPlan
from tests.core.test_layerwise_load import host_prefix, layer_holds_prefix
from tests.support.cache import MIXES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("ahead", [1, 0], ids=["one-ahead", "all-at-start"])
@pytest.mark.parametrize("runs", [False, True], ids=["rows", "2d-runs"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_each_layer_read_after_its_wait_is_the_prefix(mix, runs, ahead, tmp_path, monkeypatch):
    """As rows (one DMA per page and row) and, ``layer_runs``, as 2-D copies over the runs
    of pages (counted: a load of pages handed out in order goes that way); its groups
    queued one ahead of the wait (``layer_ahead``), or all at the start."""
    import hicache.controller.store.transfer_engine as te

    issued: list[int] = []
    real = te.issue_2d_copies
    monkeypatch.setattr(te.TransferEngine, "layer_runs", runs)
    monkeypatch.setattr(te.TransferEngine, "layer_ahead", ahead)
    monkeypatch.setattr(
        te, "issue_2d_copies", lambda plan, s: (issued.append(len(plan)), real(plan, s))
    )
    ctrl, cache, engine, tokens = host_prefix(tmp_path, mix, pages=32, device="cuda")
    req = Request("gpu")
    m = cache.match_prefix(tokens, req=req)
    before = req.kv_slots.copy()
    load = cache.start_load_back(m.load_node, req=req)
    groups = len(load.groups)
    queued = load._copies.events  # one event per group issued
    assert len(queued) == (min(ahead, groups) if ahead else groups)
    for layer in range(len(cache.layout.layer_kinds)):
        assert load.wait_layer(layer)
        g = load.groups.group_of(layer)
        assert len(queued) == (min(g + 1 + ahead, groups) if ahead else groups)
        assert layer_holds_prefix(cache, load, before, tokens, layer)
    assert load.finish()
    engine.verify_prefix(req, tokens, tokens.size)
    assert bool(issued) == (runs and te.batched_copy_available())
    cache.cache_finished_req(req)
    cache.check_invariants()
    ctrl.check_invariants()
    ctrl.close()


@pytest.mark.parametrize("failing", [0, 2])
def test_a_failure_at_layer_k_on_the_gpu_leaves_no_trace(failing, tmp_path):
    ctrl, cache, engine, tokens = host_prefix(tmp_path, pages=32, device="cuda")
    req = Request("gpu")
    m = cache.match_prefix(tokens, req=req)
    before = (cache.pools.free_counts(), req.kv_slots.copy(), req.mamba_slot)
    ctrl.faults = FaultPlan(copy_at_layer=failing)
    load = cache.start_load_back(m.load_node, req=req)
    assert all(load.wait_layer(j) for j in range(failing))
    assert not load.wait_layer(failing) and load.finish() is False
    cache.check_invariants()
    ctrl.check_invariants()
    assert cache.pools.free_counts() == before[0]
    assert np.array_equal(req.kv_slots, before[1]) and req.mamba_slot == before[2]
    engine.compute(req, tokens, tokens.size)
    engine.verify_prefix(req, tokens, tokens.size, state=False)
    cache.cache_finished_req(req)
    cache.check_invariants()
    ctrl.close()
