"""The reference model's shape: its own dimensions, and layouts that fit it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hicache.apps.engine import exact
from hicache.layout import LayerKind, ModelLayout
from hicache.types import ConfigError

DEFAULT_KINDS: tuple[str, ...] = ("full", "swa", "mamba", "full")


@dataclass(frozen=True)
class ModelConfig:
    """The model's own dimensions; the cache-relevant ones live in :class:`ModelLayout`.

    ``sliding_window`` (tokens) is required when the layout has sliding-window layers and
    must equal the cache's ``CacheConfig.sliding_window``. ``max_positions`` bounds the
    sequence length (the rotary table is built for it).
    """

    vocab_size: int = 256
    d_model: int = 32
    q_heads_per_kv_head: int = 2
    sliding_window: int | None = None
    max_positions: int = 32768
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dt_min: float = 0.001
    dt_max: float = 0.1
    seed: int = 0

    def validate(self, layout: ModelLayout) -> None:
        """Raise ConfigError naming the first value that does not fit ``layout``."""
        for name in ("vocab_size", "d_model", "q_heads_per_kv_head"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.max_positions < 1:
            raise ConfigError(f"max_positions must be >= 1, got {self.max_positions}")
        if not 0 < self.dt_min < self.dt_max:
            raise ConfigError(f"need 0 < dt_min < dt_max, got {self.dt_min}, {self.dt_max}")
        if layout.has_swa and (self.sliding_window is None or self.sliding_window < 1):
            raise ConfigError(
                "the layout has sliding-window layers: set ModelConfig.sliding_window (tokens)"
            )
        if layout.has_attention and layout.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {layout.head_dim}")
        # Every sum in the model is exact only up to a number of terms (see exact.py).
        q_dim = layout.num_kv_heads * self.q_heads_per_kv_head * layout.head_dim
        limits = [
            ("d_model", self.d_model, exact.max_terms(exact.NORM, exact.NORM)),
            ("linear input width", max(self.d_model, q_dim), _LINEAR_LIMIT),
            ("head_dim", layout.head_dim, exact.max_terms(exact.QUERY_KEY, exact.QUERY_KEY)),
            (
                "max_positions",
                self.max_positions,
                exact.max_terms(exact.PROBABILITY, exact.VALUE),
            ),
        ]
        if layout.has_mamba:
            heads, head_dim, state_size = mamba_dims(layout)
            limits.append(("Mamba heads*head_dim", heads * head_dim, _LINEAR_LIMIT))
            limits.append(
                (
                    "Mamba state size",
                    state_size,
                    exact.max_terms(exact.SSM_STATE, exact.SSM_READOUT),
                )
            )
        for what, value, limit in limits:
            if value > limit:
                raise ConfigError(
                    f"{what}={value} exceeds {limit}, the most terms the reference model "
                    "can sum exactly; use smaller dimensions"
                )


_LINEAR_LIMIT = exact.max_terms(exact.ACTIVATION, exact.WEIGHT)


def mamba_dims(layout: ModelLayout) -> tuple[int, int, int]:
    """``(heads, head_dim, state_size)`` of the layout's Mamba2 layers.

    The SSM state is ``[heads, head_dim, state_size]`` and the conv runs over
    ``x, B, C``, so ``conv_dim == heads * head_dim + 2 * state_size``.
    """
    shape = layout.ssm_state_shape
    if len(shape) != 3:
        raise ConfigError(
            f"the reference model needs ssm_state_shape (heads, head_dim, state_size), got {shape}"
        )
    heads, head_dim, state_size = shape
    if layout.conv_dim != heads * head_dim + 2 * state_size:
        raise ConfigError(
            f"conv_dim must be heads*head_dim + 2*state_size = "
            f"{heads * head_dim + 2 * state_size} for ssm_state_shape {shape}, "
            f"got {layout.conv_dim}"
        )
    return heads, head_dim, state_size


def tiny_hybrid_layout(
    kinds: Sequence[str | LayerKind] = DEFAULT_KINDS,
    *,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    ssm_heads: int = 4,
    ssm_head_dim: int = 8,
    ssm_state_size: int = 8,
    conv_kernel: int = 4,
    dtype: torch.dtype | str = torch.bfloat16,
    state_dtype: torch.dtype | str = torch.float32,
    model_id: str = "hicache-tiny-hybrid",
) -> ModelLayout:
    """A small layout of the given layer kinds, consistent with the reference model."""
    has_mamba = any(LayerKind(k) is LayerKind.MAMBA for k in kinds)
    return ModelLayout(
        tuple(kinds),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        conv_dim=ssm_heads * ssm_head_dim + 2 * ssm_state_size if has_mamba else 0,
        conv_kernel=conv_kernel if has_mamba else 0,
        ssm_state_shape=(ssm_heads, ssm_head_dim, ssm_state_size) if has_mamba else (),
        state_dtype=state_dtype,
        model_id=model_id,
    )
