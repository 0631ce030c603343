"""How a ``transformers`` model's layers map onto hicache's FULL, SWA and MAMBA layers.

transformers 5.x keeps one cache layer per decoder layer, typed by ``config.layer_types``:

* ``full_attention`` → a FULL layer; ``sliding_attention`` → an SWA layer;
* ``linear_attention`` (Mamba, Mamba2, gated delta-net) and ``conv`` (LFM2's short
  convolution) → a MAMBA layer with conv and recurrent states;
* ``hybrid`` (Falcon-H1, Zamba2's shared-attention layers) → both a FULL and a MAMBA
  layer; ``hybrid_sliding`` → an SWA and a MAMBA layer;
* ``mlp`` / ``moe`` / ``dummy`` layers keep nothing.

The state tensors of a Mamba layer are named ``conv{i}`` / ``recurrent{i}`` for the
layer's i-th conv and recurrent state (transformers keeps ``conv_kernel`` columns of a
conv window, not ``conv_kernel - 1``). Their shapes follow each family's mixer; the
engine (:class:`~hicache.integrations.transformers.PrefixCachedLM`) checks them, and takes
their dtypes, from one probe forward of the real model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hicache import ConfigError, LayerKind, ModelLayout, StateTensor, parse_dtype
from hicache.integrations.transformers_identity import model_identity

_KINDS: dict[str, tuple[LayerKind, ...]] = {
    "full_attention": (LayerKind.FULL,),
    "sliding_attention": (LayerKind.SWA,),
    "linear_attention": (LayerKind.MAMBA,),
    "conv": (LayerKind.MAMBA,),
    "hybrid": (LayerKind.FULL, LayerKind.MAMBA),
    "hybrid_sliding": (LayerKind.SWA, LayerKind.MAMBA),
    "mlp": (),
    "moe": (),
    "dummy": (),
}


@dataclass(frozen=True)
class HFLayerMap:
    """The layout of a transformers model and where each pool layer lives in its cache.

    ``full``, ``swa`` and ``mamba`` are the transformers layer index of each pool layer of
    that kind, in pool order; ``hf_sliding_window`` is the config's window (the model
    attends to the ``hf_sliding_window - 1`` tokens before each token, which is the
    cache's ``sliding_window``).
    """

    layout: ModelLayout
    full: tuple[int, ...]
    swa: tuple[int, ...]
    mamba: tuple[int, ...]
    hf_sliding_window: int | None

    @property
    def cache_sliding_window(self) -> int | None:
        """``CacheConfig.sliding_window`` for this model: past tokens an SWA layer reads."""
        return None if self.hf_sliding_window is None else self.hf_sliding_window - 1


def _mamba2(
    intermediate: int, heads: int, head_dim: int, groups: int, d_state: int, kernel: int
) -> list[tuple[int, ...]]:
    return [(intermediate + 2 * groups * d_state, kernel), (heads, head_dim, d_state)]


def _jamba(c: Any) -> list[tuple[int, ...]]:
    inner = c.mamba_expand * c.hidden_size
    return [(inner, c.mamba_d_conv), (inner, c.mamba_d_state)]


def _bamba(c: Any) -> list[tuple[int, ...]]:
    inner = int(c.mamba_expand * c.hidden_size)
    return _mamba2(
        inner, c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state, c.mamba_d_conv
    )


def _falcon_h1(c: Any) -> list[tuple[int, ...]]:
    inner = c.mamba_d_ssm or int(c.mamba_expand * c.hidden_size)
    return _mamba2(
        inner, c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state, c.mamba_d_conv
    )


def _zamba2(c: Any) -> list[tuple[int, ...]]:
    inner = int(c.mamba_expand * c.hidden_size)
    return _mamba2(
        inner, c.n_mamba_heads, c.mamba_headdim, c.mamba_ngroups, c.mamba_d_state, c.mamba_d_conv
    )


def _nemotron_h(c: Any) -> list[tuple[int, ...]]:
    inner = c.mamba_num_heads * c.mamba_head_dim
    return _mamba2(
        inner, c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size, c.conv_kernel
    )


def _qwen3_next(c: Any) -> list[tuple[int, ...]]:
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    value_dim = c.linear_num_value_heads * c.linear_value_head_dim
    return [
        (2 * key_dim + value_dim, c.linear_conv_kernel_dim),
        (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
    ]


def _lfm2(c: Any) -> list[tuple[int, ...]]:
    return [(c.hidden_size, c.conv_L_cache)]  # a short convolution: no recurrent state


#: Per family: the shapes of one Mamba layer's (conv, recurrent) states, batch dim left out.
STATE_SHAPES: dict[str, Callable[[Any], list[tuple[int, ...]]]] = {
    "jamba": _jamba,
    "bamba": _bamba,
    "granitemoehybrid": _bamba,
    "falcon_h1": _falcon_h1,
    "zamba2": _zamba2,
    "nemotron_h": _nemotron_h,
    "qwen3_next": _qwen3_next,
    "lfm2": _lfm2,
}

_STATE_NAMES = ("conv0", "recurrent0")


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def hf_layer_types(config: Any) -> list[str]:
    """``config.layer_types`` with layers that keep nothing named ``dummy``."""
    c = _text_config(config)
    types = getattr(c, "layer_types", None)
    if types is None:
        if getattr(c, "sliding_window", None) is not None:
            raise ConfigError(
                f"{c.model_type}: a sliding window without layer_types is not mapped; give "
                "the config layer_types"
            )
        types = ["full_attention"] * c.num_hidden_layers
    return ["dummy" if t in ("mlp", "moe") else t for t in types]


def hf_layout(
    config: Any,
    dtype: torch.dtype | str | None = None,
    model_id: str | None = None,
    state_dtypes: dict[str, torch.dtype] | None = None,
) -> HFLayerMap:
    """The hicache layout of the transformers model built from ``config``.

    ``dtype`` is the KV dtype (default: the config's ``dtype``, else float32);
    ``state_dtypes`` the dtype of each named Mamba state tensor (default: ``dtype``);
    ``model_id`` the layout's model id (default: the identity of ``config`` alone, see
    :func:`~hicache.integrations.transformers_identity.model_identity`; a model's own
    layout, with its weights digest, is :func:`~hicache.integrations.transformers.probe_layout`'s).
    Raises ConfigError for a layer type or family hicache does not map.
    """
    c = _text_config(config)
    kv_dtype = parse_dtype(dtype if dtype is not None else _config_dtype(c))
    full: list[int] = []
    swa: list[int] = []
    mamba: list[int] = []
    kinds: list[LayerKind] = []
    for i, t in enumerate(hf_layer_types(c)):
        if t not in _KINDS:
            raise ConfigError(
                f"{c.model_type}: layer {i} is {t!r}, which hicache does not map; mapped "
                f"types: {', '.join(sorted(_KINDS))}"
            )
        for kind in _KINDS[t]:
            kinds.append(kind)
            {LayerKind.FULL: full, LayerKind.SWA: swa, LayerKind.MAMBA: mamba}[kind].append(i)
    tensors: tuple[StateTensor, ...] = ()
    if mamba:
        shapes = STATE_SHAPES.get(c.model_type)
        if shapes is None:
            raise ConfigError(
                f"{c.model_type}: no state shapes known for its Mamba/linear-attention "
                f"layers; known families: {', '.join(sorted(STATE_SHAPES))}"
            )
        if getattr(c, "number_of_conv_states", 1) != 1:
            raise ConfigError(f"{c.model_type}: layers with several conv states are not mapped")
        dtypes = state_dtypes or {}
        tensors = tuple(
            StateTensor(name, shape, dtypes.get(name, kv_dtype))
            for name, shape in zip(_STATE_NAMES, shapes(c))
        )
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    window = getattr(c, "sliding_window", None) if swa else None
    if swa and not window:
        raise ConfigError(f"{c.model_type}: sliding-window layers but no sliding_window")
    layout = ModelLayout(
        tuple(kinds),
        num_kv_heads=int(heads),
        head_dim=int(head_dim),
        dtype=kv_dtype,
        model_id=model_id or model_identity(config, c.model_type),
        state_tensors=tensors,
    )
    return HFLayerMap(layout, tuple(full), tuple(swa), tuple(mamba), window)


def _config_dtype(c: Any) -> torch.dtype:
    d = getattr(c, "dtype", None)
    if d is None:
        return torch.float32
    return d if isinstance(d, torch.dtype) else parse_dtype(str(d).removeprefix("torch."))


def layout_from_hf_config(
    config: Any, dtype: torch.dtype | str | None = None, model_id: str | None = None
) -> ModelLayout:
    """The :class:`~hicache.layout.ModelLayout` of the transformers causal LM built from
    ``config`` (a ``PretrainedConfig``; transformers itself is not imported): see
    :func:`hf_layout` for the families and how their layers map onto FULL, SWA and MAMBA."""
    return hf_layout(config, dtype=dtype, model_id=model_id).layout
