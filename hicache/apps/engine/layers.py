"""The reference model's mixers: attention over pooled KV, and a Mamba2-style conv + SSM.

Both work on a *group*: ``B`` requests that each bring ``n`` new tokens, as tensors
``[B, n, ...]``. Every operation is per token and batch-invariant (see
:mod:`hicache.apps.engine.exact`): sums are exact, so a token's bits depend neither on ``B``,
nor on ``n``, nor on how many masked or padded keys sit beside its real ones.

Attention reads every key and value back from the pool, including those of the tokens it
has just written, so a prefix computed now and a prefix loaded from the cache are read
through the same rounding to the pool's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache.apps.engine import exact
from hicache.apps.engine.exact import PROBABILITY, QUERY_KEY, SSM_READOUT, SSM_STATE, VALUE


@dataclass(frozen=True)
class AttentionWeights:
    """One attention layer: a fused Q/K/V projection (the softmax scale folded into its
    Q columns) and the output projection."""

    qkv: exact.Linear
    out: exact.Linear


@dataclass(frozen=True)
class MambaWeights:
    """One Mamba2-style layer (one group of B and C shared by all heads).

    ``w_in`` projects to ``[z (d_inner) | xBC (conv_dim) | dt (heads)]``; ``a`` holds the
    (negative) per-head decay rates.
    """

    w_in: exact.Linear
    conv_weight: torch.Tensor  # [conv_dim, K]
    conv_bias: torch.Tensor
    dt_bias: torch.Tensor
    a: torch.Tensor
    d_skip: torch.Tensor
    w_out: exact.Linear


@dataclass(frozen=True)
class KeyAddressing:
    """Where one layer kind writes and reads K/V for a group.

    ``write_slots`` ``[B*n]``: pool slots of the new tokens, in group order.
    ``key_slots`` ``[B, Lk]``: pool slots of each request's keys (padded with a valid
    slot). ``query_mask`` ``[B, 1, n*group, Lk]``: which keys each query head attends to
    (a KV head's query heads token-major, as :func:`attention` lays them out).
    """

    write_slots: torch.Tensor
    key_slots: torch.Tensor
    query_mask: torch.Tensor


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding with a table computed once per model."""

    cos: torch.Tensor  # [max_positions, head_dim // 2]
    sin: torch.Tensor

    @classmethod
    def build(cls, head_dim: int, max_positions: int, theta: float, device: torch.device) -> Rope:
        half = head_dim // 2
        inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq
        return cls(cos=angles.cos().to(device), sin=angles.sin().to(device))

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[B, n, heads, head_dim]`` by the angles of ``positions [B, n]``."""
        cos = self.cos[positions].unsqueeze(2)
        sin = self.sin[positions].unsqueeze(2)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


_DENSE_FLOAT64 = {"dtype": torch.float64, "memory_format": torch.contiguous_format}


def _gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``pool[slots]`` for a 2-D ``slots``; ``index_select`` is several times faster on
    the CPU than advanced indexing."""
    return pool.index_select(0, slots.reshape(-1)).view(*slots.shape, *pool.shape[1:])


def attention(
    x: torch.Tensor,
    weights: AttentionWeights,
    kv_buffer: torch.Tensor,
    layer: int,
    keys: KeyAddressing,
    positions: torch.Tensor,
    rope: Rope,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Attention of the group's tokens; writes their K/V into ``kv_buffer[:, layer]``.

    ``x`` is the normalised input ``[B, n, d_model]``; returns ``[B, n, d_model]``.
    """
    batch, n, _ = x.shape
    kv_dim = num_kv_heads * head_dim
    qkv = weights.qkv(x)
    qk = rope.apply(qkv[..., :-kv_dim].reshape(batch, n, -1, head_dim), positions)
    q_heads = qk.shape[2] - num_kv_heads
    k = qk[:, :, q_heads:].reshape(-1, num_kv_heads, head_dim)
    v = qkv[..., -kv_dim:].reshape(-1, num_kv_heads, head_dim)

    # K and V go to the pool on their grids (see Fixed.round_to_grid), so everything read
    # back -- written now, earlier, or loaded from the cache -- is on the grid already.
    k_pool, v_pool = kv_buffer[0, layer], kv_buffer[1, layer]
    k_pool.index_copy_(0, keys.write_slots, QUERY_KEY.round_to_grid(k).to(k_pool.dtype))
    v_pool.index_copy_(0, keys.write_slots, VALUE.round_to_grid(v).to(v_pool.dtype))
    # Read back through the pool's dtype: [B, kv_heads, Lk, head_dim], made contiguous
    # by the conversion (a strided batch makes matmul several times slower).
    k_all = _gather(k_pool, keys.key_slots).transpose(1, 2).to(**_DENSE_FLOAT64)
    v_all = _gather(v_pool, keys.key_slots).transpose(1, 2).to(**_DENSE_FLOAT64)

    # [B, kv_heads, n * group, head_dim]: a KV head's query heads, token-major.
    q = qk[:, :, :q_heads].reshape(batch, n, num_kv_heads, -1, head_dim).transpose(1, 2)
    q = QUERY_KEY.encode(q.reshape(batch, num_kv_heads, -1, head_dim))
    # Integer units times grid values: exact sums, scaled by 2**-frac_bits afterwards.
    scores = exact.decode(torch.matmul(q, k_all.transpose(2, 3)), QUERY_KEY)
    scores = torch.where(keys.query_mask, scores, float("-inf"))
    # Every query sees at least its own token, so the row max is finite.
    row_max = scores.amax(dim=-1, keepdim=True)
    probs = torch.where(keys.query_mask, exact.exp(scores - row_max), 0.0)
    probs = PROBABILITY.encode(probs)
    numer = torch.matmul(probs, v_all)  # exact, in PROBABILITY units
    denom = probs.sum(dim=-1, keepdim=True)  # exact, in PROBABILITY units
    out = numer / denom
    out = out.reshape(batch, num_kv_heads, n, -1).transpose(1, 2)
    return weights.out(out.reshape(batch, n, -1))


@dataclass
class MambaStep:
    """What one Mamba layer computed for a group, kept for state snapshots.

    ``conv_windows`` ``[B, K-1+n, conv_dim]``: the conv inputs, the old state first, so
    the conv state after ``c`` new tokens is rows ``c .. c+K-2``.
    ``ssm_states`` ``[B, n, heads, head_dim, state]``: the SSM state after each token.
    """

    conv_windows: torch.Tensor
    ssm_states: torch.Tensor

    def conv_state_after(self, row: int, c: int) -> torch.Tensor:
        """The conv state ``[conv_dim, K-1]`` of group row ``row`` after ``c`` new tokens."""
        k_minus_1 = self.conv_windows.shape[1] - self.ssm_states.shape[1]
        return self.conv_windows[row, c : c + k_minus_1].transpose(0, 1)


def mamba(
    x: torch.Tensor,
    weights: MambaWeights,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    layer: int,
    state_slots: torch.Tensor,
    dt_range: tuple[float, float],
    norm_eps: float,
) -> tuple[torch.Tensor, MambaStep]:
    """A Mamba2-style layer over the group; reads and updates the states in ``state_slots``.

    ``x`` is the normalised input ``[B, n, d_model]``; returns the output
    ``[B, n, d_model]`` and the per-token states (for snapshots at page boundaries).
    """
    batch, n, _ = x.shape
    heads, head_dim, state_size = ssm_pool.shape[2:]
    d_inner = heads * head_dim
    conv_dim, kernel = weights.conv_weight.shape
    state_dtype = conv_pool.dtype

    proj = weights.w_in(x)
    z = proj[..., :d_inner]
    # The conv state keeps its inputs in the state dtype: round fresh ones the same way,
    # so a resumed sequence reads the same numbers as one computed in a single chunk.
    # (Via float32: each conversion is then one round-to-nearest-even in every code path.)
    xbc = proj[..., d_inner : d_inner + conv_dim].to(torch.float32)
    xbc = xbc.to(state_dtype).to(torch.float64)
    dt_raw = proj[..., d_inner + conv_dim :]

    conv_state = conv_pool[layer].index_select(0, state_slots).to(torch.float64)
    window = torch.cat([conv_state.transpose(1, 2), xbc], dim=1)  # [B, K-1+n, conv_dim]
    # The causal depthwise conv: a fixed sequence of elementwise multiply-adds per token.
    conv = window[:, 0:n] * weights.conv_weight[:, 0]
    for tap in range(1, kernel):
        conv = conv + window[:, tap : tap + n] * weights.conv_weight[:, tap]
    conv = exact.soft_silu(conv + weights.conv_bias)
    xs = conv[..., :d_inner].reshape(batch, n, heads, head_dim)
    b_in = conv[..., d_inner : d_inner + state_size]
    c_out = conv[..., d_inner + state_size :]

    dt_min, dt_max = dt_range
    dt = exact.soft_sigmoid(dt_raw + weights.dt_bias) * (dt_max - dt_min) + dt_min
    # The recurrence runs token by token (so chunking cannot regroup it) in float32, or
    # in float64 for a float64 state, rounding to the state dtype after every token.
    step_dtype = torch.float64 if state_dtype == torch.float64 else torch.float32
    decay = exact.exp(dt * weights.a).to(step_dtype)  # [B, n, heads]
    update = ((dt.unsqueeze(-1) * xs).unsqueeze(-1) * b_in[:, :, None, None, :]).to(step_dtype)
    h = ssm_pool[layer].index_select(0, state_slots).to(step_dtype)  # [B, heads, P, N]
    states = []
    for t in range(n):
        h = h * decay[:, t, :, None, None]
        h = h + update[:, t]
        if state_dtype != step_dtype:
            h = h.to(state_dtype).to(step_dtype)
        states.append(h)
    ssm_states = torch.stack(states, dim=1)  # [B, n, heads, head_dim, state]

    conv_pool[layer, state_slots] = window[:, n:].transpose(1, 2).to(state_dtype)
    ssm_pool[layer, state_slots] = h.to(state_dtype)

    readout = torch.matmul(
        SSM_STATE.encode(ssm_states), SSM_READOUT.encode(c_out)[:, :, None, :, None]
    )  # exact: [B, n, heads, head_dim, 1]
    y = exact.decode(readout.squeeze(-1), SSM_STATE, SSM_READOUT)
    y = y + weights.d_skip[:, None] * xs
    y = y.reshape(batch, n, d_inner) * exact.soft_silu(z)
    return weights.w_out(exact.rms_norm(y, norm_eps)), MambaStep(window, ssm_states)
