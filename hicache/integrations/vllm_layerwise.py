"""The worker's layer-wise loads under vLLM (``hicache_layerwise``): a hit loaded inside the
step that computes the rest of its prompt, one copy per attention layer.

``submit_load`` (vLLM's ``start_load_kv``) starts a load's copies layer by layer
(:meth:`EngineBlocks.start_layer_load`); :meth:`LayerwiseLoads.wait_layer` (vLLM's
``wait_for_layer_load``) waits for one layer of every load of the step;
:meth:`LayerwiseLoads.finish_layered` (at ``wait_for_save``) ends them and names the blocks
of those that failed, which vLLM recomputes. A part of
:class:`~hicache.integrations.vllm_worker.HiCacheOffloadingWorker`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_offload.base import GPULoadStoreSpec, TransferResult

from hicache.controller.client import SidecarController
from hicache.integrations.engine_block_layers import BlockLayerLoad
from hicache.integrations.engine_blocks import EngineBlocks


class LayerwiseLoads:
    """The layer-wise loads of :class:`HiCacheOffloadingWorker` (which sets the
    attributes below, ``_pairs`` and ``_finish``)."""

    blocks: EngineBlocks | None
    client: SidecarController
    config: Any
    counters: Counter[str]
    namespace: Any
    rank: int
    layerwise: bool
    _segments: list
    _layers: dict[str, tuple[int, list[int]]]
    _layered: dict[int, tuple[BlockLayerLoad, list[int], float]]

    def _pairs(self, spec: GPULoadStoreSpec, keys: Sequence[bytes], blocks: Any) -> Any: ...

    def _finish(self, result: TransferResult, failed: bool = False) -> None: ...

    def enable_layerwise(self, layer_names: Sequence[Sequence[str]]) -> bool:
        """Load inside the step, layer by layer, from now on (the scheduler schedules a
        hit at once): ``layer_names[g]`` are group ``g``'s layers, in the order of their
        data refs. False where it cannot copy layer by layer (the host pages not mapped, a
        layer's refs not told apart): every load then fails, and vLLM recomputes."""
        self.layerwise = True
        if self.blocks is None or len(layer_names) != len(self._segments):
            return False
        layers: dict[str, tuple[int, list[int]]] = {}
        for g, (names, segments) in enumerate(zip(layer_names, self._segments)):
            refs = 1 + max((s.ref for s in segments), default=-1)
            if not names or refs % len(names):
                return False
            per = refs // len(names)
            for i, name in enumerate(names):
                mine = [j for j, s in enumerate(segments) if s.ref // per == i]
                layers[name] = (g, mine)
        self._layers = layers
        return True

    def _start_layered(self, job_id: int, src: Any, dst: GPULoadStoreSpec) -> None:
        """Start a load's copies layer by layer, in this (the step's) thread."""
        t0 = time.perf_counter()
        pairs = self._pairs(dst, src.keys, None)
        if pairs is None or not self._layers:  # a failed load: vLLM recomputes
            self.counters["load_mismatched" if self._layers else "load_not_layerwise"] += 1
            load = BlockLayerLoad(self.client, None, [])
        else:
            hashes = [self.namespace.page_hash(src.keys[k], self.rank) for k, _, _ in pairs]
            load = self.blocks.start_layer_load(
                hashes, [p for _, p, _ in pairs], [b for _, _, b in pairs], self._layers,
                self.config.pin_ttl_s, self.config.load_timeout_s,
            )  # fmt: skip
        self._layered[job_id] = (load, dst.block_ids.tolist(), t0)

    def wait_layer(self, layer_name: str) -> None:
        """Return once ``layer_name``'s blocks of every load of this step may be read."""
        for load, _, _ in self._layered.values():
            load.wait(layer_name)

    def finish_layered(self) -> set[int]:
        """End this step's layer-wise loads; the blocks of those that failed."""
        failed: set[int] = set()
        for job_id, (load, blocks, t0) in self._layered.items():
            ok = load.finish()
            moved = len(blocks) * self.namespace.page_bytes if ok else 0
            self.counters["loads" if ok else "loads_failed"] += 1
            self._finish(TransferResult(job_id, True, moved, time.perf_counter() - t0))
            if not ok:
                failed.update(blocks)
        self._layered.clear()
        return failed
