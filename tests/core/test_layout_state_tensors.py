"""ModelLayout with several state tensors per Mamba layer, and the transformers layer map
read from a config (no transformers needed: a config is read as plain attributes)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from hicache import CacheConfig, DevicePools, ModelLayout
from hicache.integrations.transformers_layout import hf_layout
from hicache.layout import LayerKind, StateTensor
from hicache.types import ConfigError

CONV = StateTensor("conv0", (6, 4), "bfloat16")
REC = StateTensor("recurrent0", (2, 3, 5), "float32")


def packed(*tensors: StateTensor, **kw) -> ModelLayout:
    return ModelLayout(
        ("full", "mamba", "mamba"), num_kv_heads=2, head_dim=4, state_tensors=tensors, **kw
    )


def test_state_tensors_are_stored_packed_as_bytes():
    lay = packed(CONV, REC)
    assert lay.state_dtype is torch.uint8
    assert lay.conv_state_shape == (CONV.nbytes, 1)
    assert lay.ssm_state_shape == (REC.nbytes,)
    assert lay.mamba_state_bytes == 2 * (CONV.nbytes + REC.nbytes)
    assert [off for _, off in lay.state_byte_offsets()] == [0, CONV.nbytes]
    lone = packed(CONV)  # a lone tensor is split in two halves
    assert lone.conv_dim + lone.ssm_state_shape[0] == CONV.nbytes


def test_packed_layout_round_trips_and_allocates():
    lay = packed(CONV, REC, model_id="m")
    d = json.loads(json.dumps(lay.to_dict()))  # JSON/msgpack safe
    assert ModelLayout.from_dict(d) == lay
    pools = DevicePools.allocate(lay, CacheConfig(page_size=4, full_slots=64, mamba_slots=3))
    assert pools.mamba.conv.dtype is torch.uint8
    assert tuple(pools.mamba.conv.shape) == (2, 3, CONV.nbytes, 1)
    assert tuple(pools.mamba.ssm.shape) == (2, 3, REC.nbytes)


def test_state_tensors_enter_the_fingerprint():
    other = StateTensor("recurrent0", (2, 3, 5), "bfloat16")
    assert packed(CONV, REC).fingerprint(4) != packed(CONV, other).fingerprint(4)


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"conv_dim": 5}, "conv_dim=5 conflicts"),
        ({"state_dtype": "bfloat16"}, "state_dtype"),
        ({"ssm_state_shape": (3,)}, "ssm_state_shape"),
    ],
)
def test_derived_fields_that_conflict_are_refused(kw, words):
    with pytest.raises(ConfigError, match=words):
        packed(CONV, REC, **kw)


def test_bad_state_tensors_are_refused():
    with pytest.raises(ConfigError, match="distinct"):
        packed(CONV, StateTensor("conv0", (1,), "float32"))
    with pytest.raises(ConfigError, match="positive shape"):
        StateTensor("x", (0, 2), "float32")


def _config(**kw) -> SimpleNamespace:
    base = dict(
        model_type="lfm2",
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        conv_L_cache=3,
        layer_types=["conv", "full_attention", "mlp", "full_attention"],
        dtype=torch.float32,
    )
    return SimpleNamespace(**{**base, **kw})


def test_layer_map_from_a_config():
    m = hf_layout(_config())
    assert m.layout.layer_kinds == (LayerKind.MAMBA, LayerKind.FULL, LayerKind.FULL)
    assert (m.full, m.swa, m.mamba) == ((1, 3), (), (0,))
    assert [t.shape for t in m.layout.state_tensors] == [(32, 3)]  # conv_kernel columns
    hybrid = _config(model_type="llama", layer_types=["full_attention", "sliding_attention"])
    hybrid.sliding_window = 9
    h = hf_layout(hybrid)
    assert (h.full, h.swa, h.cache_sliding_window) == ((0,), (1,), 8)


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"layer_types": ["chunked_attention"] * 4}, "does not map"),
        ({"model_type": "mystery"}, "no state shapes known"),
        ({"layer_types": ["conv"] * 4}, "full-attention layer"),
    ],
)
def test_unmapped_models_get_a_clear_error(kw, words):
    with pytest.raises(ConfigError, match=words):
        hf_layout(_config(**kw))
