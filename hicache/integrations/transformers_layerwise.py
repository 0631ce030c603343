"""Layer-wise load-back for :class:`~hicache.integrations.transformers.PrefixCachedLM`: a
prefix on the host tier is loaded while the first chunk of the suffix computes.

The load is started for every layer at once (:meth:`UnifiedRadixCache.start_load_back`);
the cache object is built with every layer's prefix shapes but no contents
(:meth:`CacheCodec.restore_by_layer`), and a forward pre-hook on each decoder layer waits
for that layer's part of the load (on a GPU: its stream waits for the layer's copy, the
host does not) and fills the layer's KV or state from the pools just before the layer
computes. Full-attention, sliding-window and Mamba layers alike: each waits only for its
own part. The load is installed once the chunk has computed; if it fails at any layer,
the forward stops there, the load is undone (the request and the pools as they were), and
the request recomputes the prefix: the result is the same as without a cache.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hicache import ComponentType, ConfigError, LayerGroups

if TYPE_CHECKING:
    from hicache import LayeredLoadBack
    from hicache.integrations.transformers_layout import HFLayerMap


class LayerLoadFailed(RuntimeError):
    """A layer's part of a layer-wise load did not arrive: the forward stops there."""


def layer_groups(hf_map: HFLayerMap, size: int = 1) -> LayerGroups:
    """Groups of ``size`` transformers layers, with the pool layers each one owns."""
    owners = {
        ComponentType.FULL: hf_map.full,
        ComponentType.SWA: hf_map.swa,
        ComponentType.MAMBA: hf_map.mamba,
    }
    return LayerGroups.of({c: o for c, o in owners.items() if o}, size)


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The model's decoder layers: the one module list as long as its layer count."""
    count = model.config.get_text_config(decoder=True).num_hidden_layers
    found = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if len(found) != 1:
        raise ConfigError(
            f"{type(model).__name__}: {len(found)} module lists of {count} layers, "
            "expected one (the decoder layers)"
        )
    return found[0]


def prefix_slots(req: Any, load: LayeredLoadBack) -> np.ndarray:
    """The FULL token slots of the prefix the load will give ``req``."""
    return np.concatenate([req.kv_slots[: req.prefix_len], *load.view.full_slots])


def swa_mapping(pools: Any, load: LayeredLoadBack):
    """FULL token slots to SWA slots, the load's SWA pages overlaid on the pools'."""
    overlay = load.view.swa_pages

    def swa_slots_of(full_slots: np.ndarray) -> np.ndarray:
        ps = pools.full.page_size
        pages = (full_slots // ps).tolist()
        swa = np.array([overlay.get(p, pools.full_to_swa[p]) for p in pages], dtype=np.int64)
        return np.where(swa >= 0, swa * ps + full_slots % ps, -1)

    return swa_slots_of


def layered_chunk(lm: Any, run: Any, load: LayeredLoadBack, use_cache: bool) -> Any:
    """Compute the first chunk after ``load``'s prefix while it arrives; the chunk's
    logits once the load is installed, or None when it failed (the request as before the
    load, ``run.hf`` its device prefix restored: the caller computes the rest)."""
    req, seq = run.req, run.sequence
    start = load.prefix_len
    end = lm.chunk_ends(start, len(seq))[0]
    t0 = time.perf_counter()
    slots = torch.from_numpy(prefix_slots(req, load)).to(lm.device)
    state = load.view.state_slot if load.view.state_slot is not None else req.mamba_slot
    hf, fills = lm.codec.restore_by_layer(slots, state, swa_mapping(lm.cache.pools, load))
    run.result.restore_s = time.perf_counter() - t0

    def before_layer(j: int):
        def hook(module: Any, args: Any) -> None:
            if not load.wait_layer(j):
                raise LayerLoadFailed(f"layer {j} of the prefix did not load")
            for fill in fills.get(j, ()):
                fill()

        return hook

    layers = lm.decoder_layers
    handles = [
        layers[j].register_forward_pre_hook(before_layer(j)) for j in range(load.groups.num_layers)
    ]
    logits = None
    try:
        logits = lm.forward(torch.tensor([seq[start:end]], dtype=torch.long), hf)
    except LayerLoadFailed:
        pass
    finally:
        for h in handles:
            h.remove()
        t1 = time.perf_counter()
        ok = load.finish()  # installs the load, or undoes it
        run.result.load_back_s += time.perf_counter() - t1
    if not ok or logits is None:
        device_slots = torch.from_numpy(req.kv_slots[: req.prefix_len]).to(lm.device)
        run.hf = lm.codec.restore(device_slots, req.mamba_slot)
        return None
    run.hf = hf
    loaded = req.prefix_len - run.result.device_hit_tokens
    run.result.host_hit_tokens = min(loaded, run.host_hit_len)
    run.result.disk_hit_tokens = loaded - run.result.host_hit_tokens
    new = lm.cache.alloc_tokens(req, end - start)
    lm._record(run, 0, hf, new, seq[start:end], use_cache)
    lm.codec.trim_sliding(hf)
    run.result.computed_tokens += end - start
    return logits
