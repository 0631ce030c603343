"""Shared scaffolding for cache tests: layouts per component mix, and a marker engine.

The marker engine plays an engine without a model: the K/V it writes for a token encode
(token, position), and its Mamba state after a prefix encodes that prefix. So whatever the
cache hands back — slots, SWA window, a copied or loaded state — can be checked exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache import CacheConfig, DevicePools, ModelLayout, Request, UnifiedRadixCache
from hicache.components import COMPONENT_CLASSES
from hicache.components.base import TreeComponent

MIXES: dict[str, tuple[str, ...]] = {
    "full": ("full", "full"),
    "full+swa": ("full", "swa"),
    "full+mamba": ("full", "mamba"),
    "full+swa+mamba": ("full", "swa", "mamba"),
}


def make_layout(mix: str) -> ModelLayout:
    return ModelLayout(
        MIXES[mix],
        num_kv_heads=2,
        head_dim=4,
        dtype="float32",
        conv_dim=3,
        conv_kernel=4,
        ssm_state_shape=(2, 3),
        state_dtype="float32",
        model_id=f"test-{mix}",
    )


def make_cache(
    mix: str,
    page_size: int = 4,
    window: int | None = 8,
    full_slots: int = 512,
    mamba_slots: int = 32,
    controller=None,
    device: str = "cpu",
    pools_class: type[DevicePools] = DevicePools,
    extra_components: tuple[type[TreeComponent], ...] = (),
    **config,
) -> UnifiedRadixCache:
    """A cache for component ``mix``; ``pools_class`` and ``extra_components`` plug in a
    component the shipped layouts do not have."""
    layout = make_layout(mix)
    cfg = CacheConfig(
        page_size=page_size,
        sliding_window=window if layout.has_swa else None,
        full_slots=full_slots,
        mamba_slots=mamba_slots,
        device=device,
        **config,
    )
    pools = pools_class.allocate(layout, cfg)
    components = [*(COMPONENT_CLASSES[c] for c in layout.components), *extra_components]
    return UnifiedRadixCache(layout, cfg, pools, controller=controller, components=components)


def kv_marker(tokens: np.ndarray, start: int) -> torch.Tensor:
    """The K value the marker engine writes for ``tokens`` at positions ``start...``."""
    pos = np.arange(start, start + tokens.size)
    return torch.from_numpy((tokens * 4096 + pos).astype(np.float32))


def state_marker(tokens: np.ndarray) -> float:
    """The Mamba state value after the prefix ``tokens``."""
    s = 7
    for t in tokens.tolist():
        s = (s * 31 + t + 1) % 1048573
    return float(s)


class MarkerEngine:
    """Drives requests through the cache the way an engine does, writing markers."""

    def __init__(self, cache: UnifiedRadixCache, check: bool = True) -> None:
        self.cache = cache
        self.pools = cache.pools
        self.ps = cache.page_size
        self.check = check
        self.device = cache.pools.full.buffer.device
        # ids of requests that released SWA pages outside their window
        self.swa_released: set[int] = set()

    def _t(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    # -- verification --------------------------------------------------------------------

    def verify_prefix(
        self, req: Request, tokens: np.ndarray, length: int, state: bool = True
    ) -> None:
        """The cache gave ``req`` exactly the KV, SWA window and (with ``state``, for a
        request that has computed nothing beyond it) the state of ``tokens[:length]``."""
        slots = self._t(req.kv_slots[:length])
        want = kv_marker(tokens[:length], 0).to(self.device)
        k = self.pools.full.buffer[0, :, slots, 0, 0]
        v = self.pools.full.buffer[1, :, slots, 0, 0]
        assert torch.equal(k, want.expand_as(k)), "FULL K of the prefix is not the prefix's"
        assert torch.equal(v, (-want).expand_as(v)), "FULL V of the prefix is not the prefix's"
        if self.pools.swa is not None:
            lo = max(0, length - self.cache.config.sliding_window)
            swa = self.pools.swa_slots_of(req.kv_slots[lo:length])
            want = kv_marker(tokens[lo:length], lo).to(self.device)
            if id(req) in self.swa_released:
                # The request moved its window past the prefix's and gave those pages
                # back; what it still holds must be right.
                want = want[torch.from_numpy(swa >= 0).to(self.device)]
                swa = swa[swa >= 0]
            else:
                assert (swa >= 0).all(), "SWA window of the prefix has a hole"
            got = self.pools.swa.buffer[0, :, self._t(swa), 0, 0]
            assert torch.equal(got, want.expand_as(got))
        if self.pools.mamba is not None and state:
            conv = self.pools.mamba.conv[:, req.mamba_slot]
            ssm = self.pools.mamba.ssm[:, req.mamba_slot]
            if length == 0:
                assert not conv.any() and not ssm.any(), "fresh request state not zeroed"
            else:
                assert torch.all(conv == state_marker(tokens[:length])), "Mamba conv state"
                assert torch.all(ssm == float(length)), "Mamba SSM state"

    # -- computing -----------------------------------------------------------------------

    def compute(self, req: Request, tokens: np.ndarray, upto: int) -> None:
        """Compute ``tokens[req.computed_len:upto]``: allocate, write markers, record,
        checkpointing the Mamba state at every page boundary."""
        start = req.computed_len
        if upto <= start:
            return
        have = req.kv_slots.size
        if have < upto:
            self.cache.alloc_tokens(req, upto - have)
        new = tokens[start:upto]
        slots = self._t(req.kv_slots[start:upto])
        marker = kv_marker(new, start).to(self.device)
        self.pools.full.buffer[0, :, slots] = marker[None, :, None, None]
        self.pools.full.buffer[1, :, slots] = -marker[None, :, None, None]
        if self.pools.swa is not None:
            swa = self._t(self.pools.swa_slots_of(req.kv_slots[start:upto]))
            self.pools.swa.buffer[0, :, swa] = marker[None, :, None, None]
            self.pools.swa.buffer[1, :, swa] = -marker[None, :, None, None]
        pos = start
        while pos < upto:
            step = min(upto, (pos // self.ps + 1) * self.ps) - pos
            req.append_tokens(tokens[pos : pos + step])
            pos += step
            if self.pools.mamba is not None:
                self.pools.mamba.conv[:, req.mamba_slot] = state_marker(tokens[:pos])
                self.pools.mamba.ssm[:, req.mamba_slot] = float(pos)
                if pos % self.ps == 0:
                    self.cache.checkpoint_mamba(req)

    def start(self, tokens, extra_key: str | None = None, load: bool = True) -> Request:
        """A new request for ``tokens``: match (and load back), verified."""
        tokens = np.asarray(tokens, dtype=np.int64)
        req = Request(rid=len(self.cache.requests), extra_key=extra_key)
        m = self.cache.match_prefix(tokens, extra_key, req=req)
        if load and m.load_node is not None:
            self.cache.load_back(m.load_node, req=req)
        if self.check:
            self.verify_prefix(req, tokens, req.prefix_len)
        return req

    def run(self, tokens, extra_key: str | None = None, chunk: int | None = None) -> Request:
        """A whole request: match, compute the rest (in chunks, caching unfinished
        progress), finish. Returns the finished request."""
        tokens = np.asarray(tokens, dtype=np.int64)
        req = self.start(tokens, extra_key)
        pos = req.computed_len
        while pos < tokens.size:
            pos = min(tokens.size, pos + (chunk or tokens.size))
            self.compute(req, tokens, pos)
            if pos < tokens.size:
                self.cache.cache_unfinished_req(req)
                if self.check:
                    self.verify_prefix(req, tokens, req.prefix_len)
        self.cache.cache_finished_req(req)
        return req
