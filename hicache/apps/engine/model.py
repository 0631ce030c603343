"""The reference engine's model: a tiny hybrid of full-attention, sliding-window and Mamba2 layers.

The model keeps no state of its own: all KV lives in the cache's :class:`DevicePools`
(FULL KV at a token's FULL slot, SWA KV at ``pools.swa_slots_of`` of it) and all Mamba
state in the request's state slot. A forward pass takes, per request, the new tokens,
their positions, the FULL slots of *all* tokens so far and the Mamba slot, and returns
float32 logits for the new tokens.

Its arithmetic is batch-invariant by construction (:mod:`hicache.apps.engine.exact`): the
logits of a token are bit-identical whether its sequence was processed in one chunk, in
page-aligned chunks, token by token, batched with other requests, or resumed from KV and
state that were computed earlier in another chunking or loaded from the cache. This is
what lets the engine compare a cached run with a cache-less one bit for bit.

Mamba state at page boundaries: the cache keeps a Mamba state only at page-aligned
sequence ends, so a scheduler ends prefill chunks on page boundaries and checkpoints
after each. To checkpoint at page boundaries *inside* a multi-page chunk, ask for
snapshots there (``SequenceChunk.mamba_snapshot_lengths``); for each boundary in order,
write its snapshot into the request's slot (:meth:`MambaSnapshot.write_to`), record the
tokens up to it and checkpoint; the last snapshot (at the chunk end) restores the final
state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hicache.apps.engine import exact
from hicache.apps.engine.config import DEFAULT_KINDS, ModelConfig, mamba_dims, tiny_hybrid_layout
from hicache.apps.engine.layers import (
    AttentionWeights,
    KeyAddressing,
    MambaStep,
    MambaWeights,
    Rope,
    attention,
    mamba,
)
from hicache.config import CacheConfig
from hicache.layout import LayerKind, ModelLayout
from hicache.pools import DevicePools
from hicache.types import ConfigError


@dataclass(frozen=True)
class TinyHybrid:
    """A consistent layout, model config and cache config for tests and the demo."""

    layout: ModelLayout
    model_config: ModelConfig
    cache_config: CacheConfig

    def build(self) -> tuple[HybridModel, DevicePools]:
        """A fresh model and freshly allocated (zeroed) pools."""
        model = HybridModel(self.layout, self.model_config, device=self.cache_config.device)
        return model, DevicePools.allocate(self.layout, self.cache_config)


def tiny_hybrid(
    kinds: Sequence[str | LayerKind] = DEFAULT_KINDS,
    *,
    page_size: int = 16,
    sliding_window: int = 48,
    full_slots: int = 8192,
    mamba_slots: int = 64,
    dtype: torch.dtype | str = torch.bfloat16,
    state_dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> TinyHybrid:
    """The default tiny hybrid: layout, model config and a CPU cache config that agree.

    ``sliding_window`` is used only when ``kinds`` has sliding-window layers; ``dtype``
    is the KV dtype and ``state_dtype`` the Mamba state dtype.
    """
    layout = tiny_hybrid_layout(kinds, dtype=dtype, state_dtype=state_dtype)
    window = sliding_window if layout.has_swa else None
    model_config = ModelConfig(sliding_window=window, seed=seed)
    cache_config = CacheConfig(
        page_size=page_size,
        sliding_window=window,
        full_slots=full_slots,
        mamba_slots=mamba_slots if layout.has_mamba else 0,
        seed=seed,
    )
    return TinyHybrid(layout, model_config, cache_config)


def page_boundaries(start: int, end: int, page_size: int) -> tuple[int, ...]:
    """The page-aligned sequence lengths in ``(start, end]``: where a scheduler that
    processes tokens ``start .. end-1`` in one chunk may checkpoint the Mamba state."""
    first = (start // page_size + 1) * page_size
    return tuple(range(first, end + 1, page_size))


@dataclass
class MambaSnapshot:
    """The Mamba state of all Mamba layers at one sequence length.

    ``conv`` ``[mamba_layers, conv_dim, K-1]`` and ``ssm`` ``[mamba_layers, *ssm_state]``,
    in the layout's state dtype: exactly the bytes the state slot held at that length.
    """

    length: int
    conv: torch.Tensor
    ssm: torch.Tensor

    def write_to(self, pools: DevicePools, slot: int) -> None:
        """Overwrite state slot ``slot`` with this snapshot."""
        if pools.mamba is None:
            raise ConfigError("these pools have no Mamba pool to write a snapshot into")
        pools.mamba.conv[:, slot] = self.conv
        pools.mamba.ssm[:, slot] = self.ssm


@dataclass
class SequenceChunk:
    """The new tokens of one request for one forward pass.

    ``kv_slots`` are the FULL slots of *all* the request's tokens so far, the new ones
    last (their K/V is written there); ``positions`` must be ``len(kv_slots) - n ...
    len(kv_slots) - 1``. ``mamba_slot`` is the request's state slot (required exactly
    when the layout has Mamba layers); it holds the state at the start of the chunk and
    is left holding the state at its end. ``mamba_snapshot_lengths``: sequence lengths in
    ``(start, end]`` at which to return a copy of the Mamba state.
    """

    token_ids: torch.Tensor | Sequence[int]
    positions: torch.Tensor | Sequence[int]
    kv_slots: np.ndarray | torch.Tensor | Sequence[int]
    mamba_slot: int | None = None
    mamba_snapshot_lengths: Sequence[int] = ()


@dataclass
class ChunkOutput:
    """Float32 logits ``[n, vocab]`` of the chunk's tokens, and the requested snapshots."""

    logits: torch.Tensor
    mamba_snapshots: dict[int, MambaSnapshot] = field(default_factory=dict)


@dataclass
class _Checked:
    """A validated chunk; slot tables are numpy int64."""

    tokens: np.ndarray
    start: int
    full_slots: np.ndarray  # FULL slots of positions 0 .. end-1
    swa_slots: np.ndarray | None  # SWA slots of positions swa_first .. end-1
    swa_first: int
    mamba_slot: int | None
    snapshot_lengths: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.full_slots.size


def _int64_array(values: torch.Tensor | np.ndarray | Sequence[int]) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)


@dataclass(frozen=True)
class _Layer:
    kind: LayerKind
    index_in_kind: int
    mixer: AttentionWeights | MambaWeights


class HybridModel:
    """A tiny hybrid model with random weights from ``config.seed``; state lives in pools.

    Each layer is ``h += mixer(rms_norm(h))``, the mixer being attention (rotary, grouped
    KV heads; full or sliding-window) or a Mamba2-style conv + SSM; a final norm and the
    LM head give the logits. Activations are float64 (see :mod:`hicache.apps.engine.exact`),
    K/V are stored in the layout's dtype and Mamba state in its state dtype. Two models
    built from equal layouts and configs have bit-identical weights, in any process on
    the same torch build.
    """

    def __init__(
        self, layout: ModelLayout, config: ModelConfig | None = None, device: str = "cpu"
    ) -> None:
        config = config or ModelConfig()
        config.validate(layout)
        self.layout = layout
        self.config = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(config.seed)
        d = config.d_model

        def normal(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

        def dense(d_in: int, d_out: int) -> torch.Tensor:
            return normal(d_in, d_out, scale=d_in**-0.5)

        self.embedding = normal(config.vocab_size, d).to(self.device)
        layers = []
        counters = dict.fromkeys(LayerKind, 0)
        for kind in layout.layer_kinds:
            mixer: AttentionWeights | MambaWeights
            if kind is LayerKind.MAMBA:
                heads, head_dim, state_size = mamba_dims(layout)
                d_inner = heads * head_dim
                conv_dim, kernel = layout.conv_dim, layout.conv_kernel
                mixer = MambaWeights(
                    w_in=exact.Linear(dense(d, d_inner + conv_dim + heads).to(self.device)),
                    conv_weight=normal(conv_dim, kernel, scale=kernel**-0.5).to(self.device),
                    conv_bias=normal(conv_dim, scale=0.1).to(self.device),
                    dt_bias=normal(heads).to(self.device),
                    # Decay rates in [-16, -1]: with dt in [dt_min, dt_max] the state
                    # forgets over tens to thousands of tokens.
                    a=(-1.0 - 15.0 * torch.rand(heads, generator=gen, dtype=torch.float64)).to(
                        self.device
                    ),
                    d_skip=torch.ones(heads, dtype=torch.float64, device=self.device),
                    w_out=exact.Linear(dense(d_inner, d).to(self.device)),
                )
            else:
                q_dim = layout.num_kv_heads * config.q_heads_per_kv_head * layout.head_dim
                kv_dim = layout.num_kv_heads * layout.head_dim
                qkv = dense(d, q_dim + 2 * kv_dim)
                # Fold the softmax scale into the Q columns (RoPE is linear, so this is
                # the same as scaling the scores).
                qkv[:, :q_dim] *= layout.head_dim**-0.5
                mixer = AttentionWeights(
                    qkv=exact.Linear(qkv.to(self.device)),
                    out=exact.Linear(dense(q_dim, d).to(self.device)),
                )
            layers.append(_Layer(kind, counters[kind], mixer))
            counters[kind] += 1
        self.layers: tuple[_Layer, ...] = tuple(layers)
        self.lm_head = exact.Linear(dense(d, config.vocab_size).to(self.device))
        self.rope = Rope.build(
            max(layout.head_dim, 2), config.max_positions, config.rope_theta, self.device
        )

    # -- public API ----------------------------------------------------------------------

    def forward(
        self,
        pools: DevicePools,
        token_ids: torch.Tensor | Sequence[int],
        positions: torch.Tensor | Sequence[int],
        kv_slots: np.ndarray | torch.Tensor | Sequence[int],
        mamba_slot: int | None = None,
    ) -> torch.Tensor:
        """Run one request's new tokens; returns their float32 logits ``[n, vocab]``.

        Writes the tokens' K/V at their slots (the last ``n`` of ``kv_slots``) and
        advances the state in ``mamba_slot``. See :class:`SequenceChunk` for the rules.
        """
        chunk = SequenceChunk(token_ids, positions, kv_slots, mamba_slot)
        return self.forward_batch(pools, [chunk])[0].logits

    def forward_batch(
        self, pools: DevicePools, chunks: Sequence[SequenceChunk]
    ) -> list[ChunkOutput]:
        """Run several requests' chunks (e.g. one decode token each); one output per chunk.

        Chunks with the same number of new tokens run together, vectorised; a request's
        results are bit-identical to running it alone. The chunks must belong to distinct
        requests (distinct new slots and Mamba slots).
        """
        self._check_pools(pools)
        checked = [self._check_chunk(pools, c) for c in chunks]
        if self.layout.has_mamba:
            slots = [c.mamba_slot for c in checked]
            if len(set(slots)) != len(slots):
                raise ValueError(
                    "two chunks in one batch share a Mamba slot; batch distinct requests only"
                )
        outputs: list[ChunkOutput | None] = [None] * len(checked)
        by_length: dict[int, list[int]] = {}
        for i, c in enumerate(checked):
            by_length.setdefault(c.tokens.size, []).append(i)
        for members in by_length.values():
            group = [checked[i] for i in members]
            for i, out in zip(members, self._forward_group(pools, group)):
                outputs[i] = out
        return outputs  # type: ignore[return-value]

    # -- validation ----------------------------------------------------------------------

    def _check_pools(self, pools: DevicePools) -> None:
        if pools.layout != self.layout:
            raise ConfigError(
                "the pools were allocated for another layout than the model's; allocate them "
                "with DevicePools.allocate(model.layout, config)"
            )
        if self.layout.has_swa and pools.config.sliding_window != self.config.sliding_window:
            raise ConfigError(
                f"the cache's sliding_window ({pools.config.sliding_window}) differs from the "
                f"model's ({self.config.sliding_window}); set both to the same number of tokens"
            )

    def _check_chunk(self, pools: DevicePools, chunk: SequenceChunk) -> _Checked:
        tokens = _int64_array(chunk.token_ids)
        full_slots = _int64_array(chunk.kv_slots)
        n, end = tokens.size, full_slots.size
        if n == 0:
            raise ValueError("a chunk needs at least one new token")
        if n > end:
            raise ValueError(
                f"kv_slots holds {end} slots but the chunk has {n} new tokens; pass the slots "
                "of all tokens so far, the new ones last"
            )
        start = end - n
        positions = _int64_array(chunk.positions)
        if positions.size != n or positions[0] != start or np.any(np.diff(positions) != 1):
            raise ValueError(
                f"positions must be {start}..{end - 1} (the new tokens follow the {start} "
                f"tokens whose slots come first in kv_slots), got {positions[:8].tolist()}..."
            )
        if end > self.config.max_positions:
            raise ValueError(
                f"sequence length {end} exceeds max_positions={self.config.max_positions}"
            )
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size})")
        if full_slots.min() < 0 or full_slots.max() >= pools.full.capacity:
            raise ValueError(f"kv_slots must be in [0, {pools.full.capacity})")

        swa_slots, swa_first = None, 0
        if self.layout.has_swa:
            window = self.config.sliding_window
            assert window is not None
            swa_first = max(0, start - window + 1)
            swa_slots = pools.swa_slots_of(full_slots[swa_first:])
            if np.any(swa_slots < 0):
                bad = swa_first + int(np.flatnonzero(swa_slots < 0)[0])
                raise ValueError(
                    f"token {bad} is inside the sliding window of this chunk but its SWA page "
                    "was freed or never allocated; only tokens before position "
                    f"{swa_first} may lose their SWA pages"
                )

        mamba_slot = chunk.mamba_slot
        if self.layout.has_mamba:
            assert pools.mamba is not None
            if mamba_slot is None or not 0 <= mamba_slot < pools.mamba.capacity:
                raise ValueError(
                    f"the layout has Mamba layers: pass the request's state slot in "
                    f"[0, {pools.mamba.capacity}), got {mamba_slot}"
                )
        elif mamba_slot is not None:
            raise ValueError("the layout has no Mamba layers; pass mamba_slot=None")
        lengths = tuple(sorted({int(x) for x in chunk.mamba_snapshot_lengths}))
        if lengths and not self.layout.has_mamba:
            raise ValueError("mamba_snapshot_lengths given but the layout has no Mamba layers")
        if lengths and not (start < lengths[0] and lengths[-1] <= end):
            raise ValueError(
                f"mamba_snapshot_lengths must lie in ({start}, {end}], got {list(lengths)}"
            )
        return _Checked(tokens, start, full_slots, swa_slots, swa_first, mamba_slot, lengths)

    # -- the forward pass ----------------------------------------------------------------

    def _forward_group(self, pools: DevicePools, group: list[_Checked]) -> list[ChunkOutput]:
        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device)

        tokens = tensor(np.stack([c.tokens for c in group]))  # [B, n]
        positions = tensor(np.stack([np.arange(c.start, c.end) for c in group]))
        full_keys = self._addressing(group, positions, sliding=False)
        swa_keys = self._addressing(group, positions, sliding=True) if self.layout.has_swa else None
        state_slots = (
            tensor(np.array([c.mamba_slot for c in group], dtype=np.int64))
            if self.layout.has_mamba
            else None
        )
        mamba_steps: list[MambaStep] = []

        eps = self.config.norm_eps
        hidden = self.embedding[tokens]  # [B, n, d_model], float64
        for layer in self.layers:
            x = exact.rms_norm(hidden, eps)
            if layer.kind is LayerKind.MAMBA:
                assert pools.mamba is not None and state_slots is not None
                out, step = mamba(
                    x,
                    layer.mixer,  # type: ignore[arg-type]
                    pools.mamba.conv,
                    pools.mamba.ssm,
                    layer.index_in_kind,
                    state_slots,
                    (self.config.dt_min, self.config.dt_max),
                    eps,
                )
                mamba_steps.append(step)
            else:
                is_full = layer.kind is LayerKind.FULL
                pool = pools.full if is_full else pools.swa
                keys = full_keys if is_full else swa_keys
                assert pool is not None and keys is not None
                out = attention(
                    x,
                    layer.mixer,  # type: ignore[arg-type]
                    pool.buffer,
                    layer.index_in_kind,
                    keys,
                    positions,
                    self.rope,
                    self.layout.num_kv_heads,
                    self.layout.head_dim,
                )
            hidden = hidden + out

        logits = self.lm_head(exact.rms_norm(hidden, eps)).to(torch.float32)  # [B, n, vocab]
        return [
            ChunkOutput(logits[row], self._snapshots(c, row, mamba_steps))
            for row, c in enumerate(group)
        ]

    def _addressing(
        self, group: list[_Checked], positions: torch.Tensor, sliding: bool
    ) -> KeyAddressing:
        """Slots and mask of each request's keys for full-attention or sliding-window layers.

        A request's keys are positions ``0 .. end-1`` (full) or ``max(0, start-W+1) ..
        end-1`` (sliding window), padded to the group's longest list with masked entries;
        since every sum is exact, the padding never changes a bit.
        """
        tables: list[np.ndarray] = []
        for c in group:
            table = c.swa_slots if sliding else c.full_slots
            assert table is not None
            tables.append(table)
        firsts = np.array([c.swa_first if sliding else 0 for c in group], dtype=np.int64)
        longest = max(t.size for t in tables)
        key_slots = np.empty((len(group), longest), dtype=np.int64)
        for row, table in enumerate(tables):
            key_slots[row, : table.size] = table
            key_slots[row, table.size :] = table[0]  # a valid slot, masked below
        # A request's keys are consecutive positions from its first one, so its padding
        # lies past its last query and the causal test masks it.
        key_pos = torch.from_numpy(firsts[:, None] + np.arange(longest)).to(self.device)
        key_pos = key_pos[:, None, :]  # [B, 1, Lk]
        query_pos = positions.unsqueeze(-1)  # [B, n, 1]
        mask = key_pos <= query_pos
        if sliding:
            mask = mask & (key_pos > query_pos - self.config.sliding_window)
        query_mask = mask.repeat_interleave(self.config.q_heads_per_kv_head, dim=1).unsqueeze(1)
        write = np.concatenate([t[c.start - int(f) :] for c, t, f in zip(group, tables, firsts)])
        return KeyAddressing(
            torch.from_numpy(write).to(self.device),
            torch.from_numpy(key_slots).to(self.device),
            query_mask,
        )

    def _snapshots(
        self, chunk: _Checked, row: int, steps: list[MambaStep]
    ) -> dict[int, MambaSnapshot]:
        dtype = self.layout.state_dtype
        out = {}
        for length in chunk.snapshot_lengths:
            c = length - chunk.start
            conv = torch.stack([s.conv_state_after(row, c) for s in steps]).to(dtype)
            ssm = torch.stack([s.ssm_states[row, c - 1] for s in steps]).to(dtype)
            out[length] = MambaSnapshot(length, conv.clone(), ssm.clone())
        return out
