"""PrefixCachedLM with layer-wise load-back (real transformers models, tiny configs, fp32):
a host or disk hit is loaded while the suffix's first chunk computes, each decoder layer
waiting only for its own part, and the continuation is bit-identical to the one from the
live cache object; a load that fails at any layer leaves no trace and the request
recomputes, exactly as a request with no hit would."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from hicache.config import PrefetchPolicy
from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.local import LocalController
from hicache.integrations.transformers_layerwise import decoder_layers
from hicache.integrations.transformers_models import FAMILIES
from tests.integrations.test_transformers_exact import (
    NEW_TOKENS,
    PREFIX,
    assert_same,
    build,
    ctl_config,
    model_of,
    tokens,
)


def cached_on_host(family: str, ctrl: LocalController, **config):
    """A layer-wise PrefixCachedLM whose prefix ``a`` lies on the host tier only."""
    lm = build(model_of(family), ctrl, layerwise=True, **config)
    a = tokens(1, PREFIX)
    lm.generate([*a, 5], 1)
    lm.cache.flush_backups()
    assert ctrl.flush(30.0)
    lm.cache.evict(full_tokens=10**6)
    return lm, a


@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_wise_host_and_disk_hit_is_bit_identical(family, tmp_path):
    disk = tmp_path / "lmdb"
    ctrl = LocalController(ctl_config(disk))
    try:
        lm, a = cached_on_host(family, ctrl)
        assert lm.layer_groups.num_layers == len(decoder_layers(lm.model))
        cont = a + tokens(3, 7)
        r = lm.generate(cont, NEW_TOKENS)
        assert (r.device_hit_tokens, r.host_hit_tokens) == (0, PREFIX)
        assert r.computed_tokens == len(cont) - PREFIX + NEW_TOKENS - 1
        assert_same(r, lm.reference(cont, NEW_TOKENS, PREFIX))
        lm.cache.check_invariants()
        ctrl.check_invariants()
        lm.cache.flush_backups()
        assert ctrl.flush(30.0)
        ctrl.close()
        ctrl = LocalController(ctl_config(disk))
        lm = build(
            model_of(family), ctrl, layerwise=True, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE
        )
        cont = a + tokens(4, 7)
        r = lm.generate(cont, NEW_TOKENS)
        assert r.disk_hit_tokens == PREFIX
        assert_same(r, lm.reference(cont, NEW_TOKENS, PREFIX))
        lm.cache.check_invariants()
        lm.cache.reset()
        assert all(p.available() == p.capacity for p in lm.cache.pools.all())
    finally:
        ctrl.close()


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text", "llama"])
def test_a_failure_at_any_layer_leaves_no_trace_and_the_request_recomputes(family, tmp_path):
    ctrl = LocalController(ctl_config(tmp_path / "lmdb"))
    try:
        lm, a = cached_on_host(family, ctrl)
        for failing in range(lm.layer_groups.num_layers):
            free = lm.cache.pools.free_counts()
            ctrl.faults = FaultPlan(copy_at_layer=failing)
            cont = a + tokens(10 + failing, 5)
            r = lm.generate(cont, NEW_TOKENS, use_cache=True)
            assert ctrl.faults.fired == {"copy_at_layer": 1}
            assert r.host_hit_tokens == 0 and r.computed_tokens == len(cont) + NEW_TOKENS - 1
            assert_same(r, lm.reference(cont, NEW_TOKENS, 0))
            lm.cache.check_invariants()
            ctrl.check_invariants()
            assert ctrl.stats()["pins_active"] == 0
            lm.cache.evict(full_tokens=10**6)  # the recomputed prefix off the device again
            assert lm.cache.pools.free_counts() == free
        ctrl.faults = None
        cont = a + tokens(99, 5)
        r = lm.generate(cont, NEW_TOKENS)
        assert r.host_hit_tokens == PREFIX
        assert_same(r, lm.reference(cont, NEW_TOKENS, PREFIX))
    finally:
        ctrl.close()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
def test_layer_wise_load_back_is_the_default_on_a_gpu_only_and_a_host_hit_stays_exact(
    device, tmp_path
):
    """Left unset, ``layerwise`` is on where the model runs on a GPU (measured faster than a
    whole load there) and off on a CPU; asked for either way, it is what was asked."""
    ctrl = LocalController(ctl_config(tmp_path / "lmdb"))
    try:
        model = model_of("llama")
        if device != "cpu":  # a copy: the cached model stays on the CPU for the other tests
            model = copy.deepcopy(model).to(device)
        lm = build(model, ctrl)
        assert (lm.layer_groups is not None) == (device == "cuda")
        assert build(model, ctrl, layerwise=False).layer_groups is None
        assert build(model, ctrl, layerwise=True).layer_groups is not None
        a = tokens(1, PREFIX)
        lm.generate([*a, 5], 1)
        lm.cache.flush_backups()
        assert ctrl.flush(30.0)
        lm.cache.evict(full_tokens=10**6)
        cont = a + tokens(7, 5)
        r = lm.generate(cont, NEW_TOKENS)
        assert r.host_hit_tokens == PREFIX
        assert_same(r, lm.reference(cont, NEW_TOKENS, PREFIX))
        lm.cache.check_invariants()
        ctrl.check_invariants()
    finally:
        ctrl.close()
