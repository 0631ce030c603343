"""Moving a transformers cache object's contents to and from hicache's device pools.

A transformers 5.x ``DynamicCache`` keeps, per decoder layer, keys and values
``[batch, kv_heads, tokens, head_dim]`` (a sliding-window layer only the last
``window - 1`` tokens) and, per Mamba/linear-attention layer, conv and recurrent states
``[batch, ...]``. :class:`CacheCodec` writes what a forward pass added into the pools'
slots, and builds a cache object for a prefix from the pools: a restored object holds the
same bytes the live one held at that prefix, so the model continues identically.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hicache import ConfigError, DevicePools
from hicache.integrations.transformers_layout import HFLayerMap


class CacheCodec:
    """Writes a transformers cache object into the pools and restores one from them."""

    def __init__(self, config: Any, hf_map: HFLayerMap, pools: DevicePools) -> None:
        self.config = config
        self.map = hf_map
        self.pools = pools
        self.layout = hf_map.layout
        self.device = pools.full.buffer.device
        self._offsets = self.layout.state_byte_offsets()
        self._head = self.layout.conv_dim  # bytes of a layer's state kept in the conv part

    # -- cache objects -------------------------------------------------------------------

    def new_cache(self) -> Any:
        """An empty cache object for this model. Sliding-window layers keep their whole
        last chunk until :meth:`write_kv` has copied it (then they are trimmed to the
        window), so that a chunk longer than the window is cached whole."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        for j in self.map.swa:
            cache.layers[j].activate_past_recording()
        return cache

    def restore(self, kv_slots: torch.Tensor, mamba_slot: int | None) -> Any:
        """A cache object holding the prefix whose FULL slots are ``kv_slots`` and whose
        Mamba state is in ``mamba_slot`` (an empty one for an empty prefix)."""
        cache = self.new_cache()
        n = int(kv_slots.numel())
        if n == 0:
            return cache
        kv = self._gather(self.pools.full.buffer, kv_slots)
        for i, j in enumerate(self.map.full):
            _set_kv(cache.layers[j], kv[0, i].unsqueeze(0), kv[1, i].unsqueeze(0))
        if self.map.swa:
            keep = min(n, self.map.cache_sliding_window)
            full_tail = kv_slots[n - keep :].cpu().numpy()
            swa = self.pools.swa_slots_of(full_tail)
            if (swa < 0).any():
                raise ConfigError("restore: the prefix has no sliding-window KV for its window")
            kv = self._gather(self.pools.swa.buffer, torch.from_numpy(swa).to(self.device))
            for i, j in enumerate(self.map.swa):
                _set_kv(cache.layers[j], kv[0, i].unsqueeze(0), kv[1, i].unsqueeze(0))
                cache.layers[j].cumulative_length = n
        if self.map.mamba:
            if mamba_slot is None:
                raise ConfigError("restore: a Mamba layout needs the prefix's state slot")
            for layer_i, states in enumerate(self._unpack(mamba_slot)):
                _set_states(cache.layers[self.map.mamba[layer_i]], self.layout, states, n)
        return cache

    def restore_by_layer(
        self,
        kv_slots: torch.Tensor,
        mamba_slot: int | None,
        swa_slots_of: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> tuple[Any, dict[int, list[Callable[[], None]]]]:
        """:meth:`restore` layer by layer: a cache object whose every layer already has
        its prefix's shapes (so the model computes positions and masks as for a restored
        one) and, per transformers layer, the copies that fill it from the pools, to run
        once that layer's pool contents are there (a layer-wise load) and before the layer
        computes. The bytes are :meth:`restore`'s. ``swa_slots_of`` maps FULL token slots
        to SWA slots (default: the pools' own mapping)."""
        cache = self.new_cache()
        fills: dict[int, list[Callable[[], None]]] = {}
        n = int(kv_slots.numel())
        if n == 0:
            return cache, fills
        lay = self.layout
        shape = (1, lay.num_kv_heads, n, lay.head_dim)
        for i, j in enumerate(self.map.full):
            k, v = (torch.empty(shape, dtype=lay.dtype, device=self.device) for _ in "kv")
            _set_kv(cache.layers[j], k, v)
            fills.setdefault(j, []).append(_kv_fill(self.pools.full.buffer, i, kv_slots, k, v))
        if self.map.swa:
            keep = min(n, self.map.cache_sliding_window)
            tail = kv_slots[n - keep :].cpu().numpy()
            swa = (swa_slots_of or self.pools.swa_slots_of)(tail)
            if (swa < 0).any():
                raise ConfigError("restore: the prefix has no sliding-window KV for its window")
            swa_t = torch.from_numpy(swa).to(self.device)
            shape = (1, lay.num_kv_heads, keep, lay.head_dim)
            for i, j in enumerate(self.map.swa):
                k, v = (torch.empty(shape, dtype=lay.dtype, device=self.device) for _ in "kv")
                _set_kv(cache.layers[j], k, v)
                cache.layers[j].cumulative_length = n
                fills.setdefault(j, []).append(_kv_fill(self.pools.swa.buffer, i, swa_t, k, v))
        if self.map.mamba:
            if mamba_slot is None:
                raise ConfigError("restore: a Mamba layout needs the prefix's state slot")
            for i, j in enumerate(self.map.mamba):
                states = [
                    torch.empty((1, *t.shape), dtype=t.dtype, device=self.device)
                    for t in lay.state_tensors
                ]
                _set_states(cache.layers[j], lay, states, n)
                fills.setdefault(j, []).append(self._state_fill(i, mamba_slot, states))
        return cache, fills

    def _state_fill(self, i: int, slot: int, states: list[torch.Tensor]) -> Callable[[], None]:
        def fill() -> None:
            mamba = self.pools.mamba
            packed = torch.cat([mamba.conv[i, slot, :, 0], mamba.ssm[i, slot]])
            for t, (spec, off) in zip(states, self._offsets):
                t.view(-1).view(torch.uint8).copy_(packed[off : off + spec.nbytes])

        return fill

    @staticmethod
    def _gather(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """K and V of ``slots`` in every layer of a pool, ``[2, layers, heads, tokens,
        dim]``: two kernels for the whole prefix, and each ``[0, i]`` / ``[1, i]`` slice
        is dense like the tensors a live cache object holds."""
        return buffer.index_select(2, slots).permute(0, 1, 3, 2, 4).contiguous()

    # -- writes --------------------------------------------------------------------------

    def write_kv(self, cache: Any, full_slots: torch.Tensor, row: int = 0) -> None:
        """Copy the KV of the last ``len(full_slots)`` tokens of batch row ``row`` into
        those FULL slots (and the SWA slots of their pages); trims sliding layers."""
        n = int(full_slots.numel())
        for i, j in enumerate(self.map.full):
            layer = cache.layers[j]
            self._scatter(self.pools.full.buffer, i, full_slots, layer, n, row)
        if self.map.swa:
            swa = self.pools.swa_slots_of(full_slots.cpu().numpy())
            if (swa < 0).any():
                raise ConfigError("write_kv: a token slot has no sliding-window page")
            swa_t = torch.from_numpy(swa).to(self.device)
            for i, j in enumerate(self.map.swa):
                layer = cache.layers[j]
                self._scatter(self.pools.swa.buffer, i, swa_t, layer, n, row)

    def trim_sliding(self, cache: Any) -> None:
        """Keep only the window a sliding layer needs (what transformers keeps itself)."""
        window = self.map.cache_sliding_window
        for j in self.map.swa:
            layer = cache.layers[j]
            if layer.keys is not None and layer.keys.shape[-2] > window:
                layer.keys = layer.keys[:, :, -window:].contiguous()
                layer.values = layer.values[:, :, -window:].contiguous()

    @staticmethod
    def _scatter(
        buffer: torch.Tensor, i: int, slots: torch.Tensor, layer: Any, n: int, row: int
    ) -> None:
        for kv, src in ((0, layer.keys), (1, layer.values)):
            buffer[kv, i].index_copy_(0, slots, src[row, :, -n:].transpose(0, 1))

    def write_states(self, cache: Any, slot: int, row: int = 0) -> None:
        """Copy batch row ``row``'s Mamba states into state slot ``slot`` (all layers)."""
        packed = torch.stack(
            [
                torch.cat([_bytes(t[row]) for t in _states_of(cache.layers[j], self.layout)])
                for j in self.map.mamba
            ]
        )
        self.pools.mamba.conv[:, slot, :, 0].copy_(packed[:, : self._head])
        self.pools.mamba.ssm[:, slot].copy_(packed[:, self._head :])

    def _unpack(self, slot: int) -> list[list[torch.Tensor]]:
        packed = torch.cat(
            [self.pools.mamba.conv[:, slot, :, 0], self.pools.mamba.ssm[:, slot]], dim=1
        )
        out = []
        for layer_bytes in packed:
            states = []
            for t, off in self._offsets:
                raw = layer_bytes[off : off + t.nbytes].clone()
                states.append(raw.view(t.dtype).view(1, *t.shape))
            out.append(states)
        return out


def _kv_fill(
    buffer: torch.Tensor, i: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Callable[[], None]:
    """The copy of layer ``i``'s K and V of ``slots`` in a pool into ``k`` and ``v``."""

    def fill() -> None:
        kv = buffer[:, i].index_select(1, slots).permute(0, 2, 1, 3)  # [2, heads, n, dim]
        k[0].copy_(kv[0])
        v[0].copy_(kv[1])

    return fill


def check_live_cache(cache: Any, hf_map: HFLayerMap) -> None:
    """Raise ConfigError when a live cache object's tensors do not have the layout's
    shapes and dtypes (a wrong family formula, an unmapped layer)."""
    lay = hf_map.layout
    for j in (*hf_map.full, *hf_map.swa):
        k = cache.layers[j].keys
        want = (lay.num_kv_heads, lay.head_dim)
        if k is None or (k.shape[1], k.shape[3]) != want or k.dtype != lay.dtype:
            got = None if k is None else (tuple(k.shape), k.dtype)
            raise ConfigError(f"layer {j}: KV {got} does not match the layout {want}")
    for j in hf_map.mamba:
        got = [(tuple(t.shape[1:]), t.dtype) for t in _states_of(cache.layers[j], lay)]
        want = [(t.shape, t.dtype) for t in lay.state_tensors]
        if got != want:
            raise ConfigError(f"layer {j}: states {got} do not match the layout {want}")


def observed_states(cache: Any, hf_map: HFLayerMap) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Shape and dtype of each named state tensor of the first Mamba layer of a live cache."""
    layer = cache.layers[hf_map.mamba[0]]
    out = {}
    for idx in layer.conv_states:
        for name, store in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
            t = store[idx]
            if t is not None:
                out[f"{name}{idx}"] = (tuple(t.shape[1:]), t.dtype)
    return out


def _states_of(layer: Any, layout: Any) -> list[torch.Tensor]:
    out = []
    for t in layout.state_tensors:
        store = layer.conv_states if t.name.startswith("conv") else layer.recurrent_states
        out.append(store[int(t.name[-1])])
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _set_kv(layer: Any, k: torch.Tensor, v: torch.Tensor) -> None:
    layer.keys, layer.values = k, v
    layer.device = k.device
    layer.is_initialized = True
    if hasattr(layer, "_sliding_window_tensor"):
        layer._sliding_window_tensor = layer._sliding_window_tensor.to(k.device)


def _set_states(layer: Any, layout: Any, states: list[torch.Tensor], tokens: int) -> None:
    for spec, t in zip(layout.state_tensors, states):
        idx = int(spec.name[-1])
        if spec.name.startswith("conv"):
            layer.conv_states[idx] = t
            layer.conv_kernel_size[idx] = t.shape[-1]
            layer.is_conv_states_initialized[idx] = True
            layer.dtype, layer.device = t.dtype, t.device
        else:
            layer.recurrent_states[idx] = t
            layer.is_recurrent_states_initialized[idx] = True
        layer.has_previous_state[idx] = True
    if hasattr(layer, "cumulative_length_linear"):
        # transformers 5.25+: the tokens a linear-attention layer has seen, which its
        # get_seq_length reports (and a model whose first layer is one takes positions from)
        layer.cumulative_length_linear = torch.tensor(tokens, dtype=torch.long, device=layer.device)
