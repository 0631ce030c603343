"""The worker side of hicache under vLLM: vLLM's KV blocks to and from the sidecar.

With a local sidecar (its Unix socket), the worker maps the sidecar's host pool and moves
every byte once (:mod:`hicache.integrations.engine_blocks`): a store copies each block of
each group (every layer's page of it, Mamba state pages included) straight into a host
page the sidecar handed it and commits it; a load pins the pages, has the sidecar read
the ones only on disk into host pages, and copies them straight into vLLM's blocks. On a
GPU each direction is one kernel launch per group over vLLM's per-layer tensors
(:class:`hicache.kernels.SegmentCopy`); on a CPU, one ``memmove`` per run of bytes
contiguous on both sides.

Where the host pool cannot be mapped (a TCP endpoint), the worker registers a **staging
area** instead: ``staging_bytes`` of pages in the sidecar's layout that the sidecar copies
to and from, and the worker copies vLLM's blocks into and out of it (two copies).

Transfers run on two threads (loads, stores), so vLLM's step never waits for the
sidecar. vLLM's connector knows a step's stores a step before it submits them: when the
step's metadata is bound, :meth:`HiCacheOffloadingWorker.store_ahead` has the store thread
send their ``store_begin`` requests (``hicache_store_ahead``), so that each store finds its
host pages handed out and copies at once; one never submitted (a step later) is given
back. ``wait`` (vLLM is about to reuse a store's blocks) waits only until the store
has copied them out: that never depends on the sidecar. A load that fails in any way
(a page gone, a pin refused, a read that fails its checks, a dead sidecar) is reported
by :meth:`take_failed_loads`, so the connector has vLLM recompute the request. A store
that fails is dropped and counted; nothing of it is visible to lookups.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    OffloadingWorker,
    TransferResult,
    get_offload_block_hash,
    get_offload_group_idx,
)

from hicache import (
    ComponentType,
    ConfigError,
    EngineKey,
    PageKey,
    PageRef,
    TransferHandle,
    pack_engine_key,
    unsettled_load,
)
from hicache.controller.client import SidecarClientConfig, SidecarController, StagingArea
from hicache.integrations.engine_block_layers import BlockLayerLoad
from hicache.integrations.engine_block_stores import StorePrebook
from hicache.integrations.engine_blocks import BlockSegment, EngineBlocks, HandedPages
from hicache.integrations.vllm_config import HiCacheVllmConfig
from hicache.integrations.vllm_layerwise import LayerwiseLoads
from hicache.integrations.vllm_manager import HiCacheLoadSpec, HiCacheStoreSpec
from hicache.integrations.vllm_pages import PageNamespace
from hicache.integrations.vllm_store_ahead import StoresAhead
from hicache.kernels import merge_runs, move_runs

log = logging.getLogger(__name__)

FULL = ComponentType.FULL
# The scheduler's pin of a load is copied under only with this long left to run.
HANDED_MARGIN_S = 1.0


@dataclass(frozen=True)
class _Segment:
    """Bytes ``[src_offset, +nbytes)`` of a block of ``tensor`` are bytes
    ``[dst_offset, +nbytes)`` of half ``half`` (0: K, 1: V) of its staging page."""

    tensor: torch.Tensor
    src_offset: int
    nbytes: int
    half: int
    dst_offset: int
    ref: int  # the index of its layer's data ref in the group


class HiCacheOffloadingWorker(LayerwiseLoads, StoresAhead, OffloadingWorker):
    """``OffloadingWorker`` over the sidecar (see the module docstring)."""

    def __init__(
        self,
        namespace: PageNamespace,
        config: HiCacheVllmConfig,
        kv_caches: CanonicalKVCaches,
        rank: int,
    ) -> None:
        self.namespace = namespace
        self.config = config
        self.rank = rank
        self.counters: Counter[str] = Counter()
        self._segments = self._plan_segments(kv_caches)
        self._group_pos = {g.group_id: i for i, g in enumerate(namespace.groups)}
        self._groups = {g.group_id: g for g in namespace.groups}
        device = kv_caches.tensors[0].tensor.device
        self._on_cpu = device.type == "cpu"
        base = config.engine_id or f"vllm:{time.time_ns():x}"
        self.client = SidecarController(
            config.socket,
            engine_id=f"{base}-worker{rank}",
            config=SidecarClientConfig(
                request_timeout_s=config.request_timeout_s,
                backup_timeout_s=config.store_timeout_s,
                connect_timeout_s=config.request_timeout_s,
            ),
        )
        self.layout = namespace.layout()
        half = namespace.page_bytes // 2
        self.client.attach(self.layout, 1)
        groups = [
            [
                BlockSegment(s.tensor, s.src_offset, s.nbytes, s.half * half + s.dst_offset)
                for s in g
            ]
            for g in self._segments
        ]
        self.blocks: EngineBlocks | None = None
        self.staging: StagingArea | None = None
        if self.client.endpoint.startswith("ipc://"):
            # A local sidecar shares its host pages: mapped at each session, and while they
            # are not (the sidecar is down), a store is dropped and a load misses.
            self.blocks = EngineBlocks(self.client, groups, device, FULL)
            self.blocks.warm()  # the first store or load compiles nothing
        else:
            pages = max(1, config.staging_bytes // namespace.page_bytes)
            self.staging = StagingArea(self.layout, page_size=1, pages=pages, device=device)
            buf = self.staging.pools.full.buffer  # [2, 1, pages, 1, half / 4] float32
            # A staging page's K and V halves as byte rows, one row a page.
            self.halves = (buf[0, 0, :, 0].view(torch.uint8), buf[1, 0, :, 0].view(torch.uint8))
            self.client.register(self.layout, 1, self.staging.pools)
        log.info(
            "hicache worker %d: %s", rank,
            "one copy each way, through the sidecar's host pages" if self.blocks
            else "through a staging area (the sidecar's host pages are not mapped here)",
        )  # fmt: skip
        self._lock = threading.Lock()
        self._finished: list[TransferResult] = []
        self._failed: set[int] = set()
        self._reported_failed: set[int] = set()
        self._released: dict[int, threading.Event] = {}
        self.layerwise = False  # loads inside the step (vllm_layerwise.py)
        self._layers: dict[str, tuple[int, list[int]]] = {}
        self._layered: dict[int, tuple[BlockLayerLoad, list[int], float]] = {}
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="hicache-vllm-load")
        self._stores = ThreadPoolExecutor(1, thread_name_prefix="hicache-vllm-store")
        # Stores whose host pages were asked for a step ahead, by job id (store thread).
        self._prebooks: dict[int, tuple[StorePrebook, list, list[PageRef], int]] = {}
        self._binds = 0  # the steps whose stores were announced (vLLM's thread)
        self._shut = False

    # -- the page geometry ----------------------------------------------------------------

    def _plan_segments(self, kv_caches: CanonicalKVCaches) -> list[list[_Segment]]:
        """Per group, where each layer's page of a block goes in a staging page; refuses
        caches whose pages are not those the namespace was built for."""
        groups = self.namespace.groups
        if len(kv_caches.group_data_refs) != len(groups):
            raise ConfigError(
                f"vLLM offloads {len(kv_caches.group_data_refs)} KV cache groups but the "
                f"scheduler described {len(groups)}"
            )
        half = self.namespace.page_bytes // 2
        plan = []
        for group, refs in zip(groups, kv_caches.group_data_refs):
            sizes = tuple(r.page_size_bytes for r in refs)
            if sizes != group.layer_page_bytes:
                raise ConfigError(
                    f"KV cache group {group.group_id}: worker pages {sizes} differ from the "
                    f"scheduler's {group.layer_page_bytes} (packed KV layouts are not supported)"
                )
            segments, offset = [], 0
            for ref_index, ref in enumerate(refs):
                tensor = kv_caches.tensors[ref.tensor_idx].tensor
                if tensor.dtype not in (torch.int8, torch.uint8) or tensor.stride(1) != 1:
                    raise ConfigError("vLLM's canonical KV tensors must be byte rows")
                start, end = offset, offset + ref.page_size_bytes
                while start < end:  # a layer's page may straddle the K/V halves
                    which = start // half
                    stop = min(end, (which + 1) * half)
                    segments.append(
                        _Segment(
                            tensor,
                            start - offset,
                            stop - start,
                            which,
                            start - which * half,
                            ref_index,
                        )
                    )
                    start = stop
                offset = end
            plan.append(segments)
        return plan

    def _pairs(
        self, spec: GPULoadStoreSpec, keys: Sequence[bytes], blocks: Sequence[int] | None
    ) -> list[tuple[int, int, int]] | None:
        """``(key index, group position, block id)`` for each block of ``spec`` that has a
        key; None when keys and blocks do not line up.

        Blocks come group by group (``group_sizes``), a group's keys in block order. A
        load names one block per key. A store names only blocks that exist: vLLM leaves
        out null blocks (a window's or a Mamba group's blocks without state), so with
        ``blocks`` (each key's block index) a group's blocks are its keys from the one at
        ``block_indices`` (its first block) on.
        """
        by_group: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            pos = self._group_pos.get(get_offload_group_idx(key))
            if pos is None:
                return None
            by_group.setdefault(pos, []).append(i)
        out, start = [], 0
        for pos, size in enumerate(spec.group_sizes):
            ids = spec.block_ids[start : start + size].tolist()
            start += size
            mine = by_group.get(pos, [])
            if blocks is not None and size:
                first = next(
                    (n for n, k in enumerate(mine) if blocks[k] >= spec.block_indices[pos]), None
                )
                if first is None or blocks[mine[first]] != spec.block_indices[pos]:
                    return None
                mine = mine[first : first + size]
            if len(mine) != size if blocks is None else len(mine) < size:
                return None
            out += [(k, pos, b) for k, b in zip(mine, ids) if b != 0]
        return out

    def _copy(self, pairs: list[tuple[int, int, int]], pages: np.ndarray, to_stage: bool) -> int:
        """Copy each pair's block to (``to_stage``) or from its staging page."""
        if not self._on_cpu:
            return self._copy_indexed(pairs, pages, to_stage)
        dst, src, nbytes = [], [], []
        by_pos: dict[int, list[int]] = {}
        for j, (_, pos, _) in enumerate(pairs):
            by_pos.setdefault(pos, []).append(j)
        for pos, js in by_pos.items():
            block = np.array([pairs[j][2] for j in js], dtype=np.int64)
            page = pages[js]
            for seg in self._segments[pos]:
                t = seg.tensor
                vllm_addr = t.data_ptr() + block * t.stride(0) + seg.src_offset
                half = self.halves[seg.half]
                stage_addr = half.data_ptr() + page * half.stride(0) + seg.dst_offset
                a, b = (stage_addr, vllm_addr) if to_stage else (vllm_addr, stage_addr)
                dst.append(a)
                src.append(b)
                nbytes.append(np.full(block.size, seg.nbytes, dtype=np.int64))
        if not dst:
            return 0
        runs = merge_runs(np.concatenate(dst), np.concatenate(src), np.concatenate(nbytes))
        return move_runs(*runs)

    def _copy_indexed(
        self, pairs: list[tuple[int, int, int]], pages: np.ndarray, to_stage: bool
    ) -> int:
        """The same copy as indexed tensor copies (a GPU's, or a check of the CPU path)."""
        moved = 0
        for pos in {p for _, p, _ in pairs}:
            js = [j for j, (_, p, _) in enumerate(pairs) if p == pos]
            block = torch.tensor([pairs[j][2] for j in js], device=self.halves[0].device)
            page = torch.as_tensor(pages[js], device=block.device)
            for seg in self._segments[pos]:
                half = self.halves[seg.half]
                stage = half[:, seg.dst_offset : seg.dst_offset + seg.nbytes]
                vllm = seg.tensor[:, seg.src_offset : seg.src_offset + seg.nbytes].view(torch.uint8)
                if to_stage:
                    stage[page] = vllm[block]
                else:
                    vllm[block] = stage[page]
                moved += len(js) * seg.nbytes
        if not self._on_cpu:
            torch.cuda.current_stream().synchronize()
        return moved

    # -- stores ---------------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: object) -> bool:
        released = threading.Event()
        with self._lock:
            self._released[job_id] = released
        self._stores.submit(self._store, job_id, src_spec, dst_spec, released)
        return True

    def _store(
        self,
        job_id: int,
        src: GPULoadStoreSpec,
        dst: HiCacheStoreSpec,
        released: threading.Event,
    ) -> None:
        t0 = time.perf_counter()
        moved = 0
        try:
            ahead = self._prebooks.get(job_id)
            pairs = ahead[1] if ahead is not None else self._pairs(src, dst.keys, dst.block_indices)
            if pairs is None:
                self.counters["store_mismatched"] += 1
                return
            if self.blocks is not None:
                moved = self._store_direct(job_id, pairs, dst, released)
                return
            pages = self.staging.alloc(FULL, len(pairs))
            self.counters["store_pages_dropped_staging_full"] += len(pairs) - pages.size
            pairs = pairs[: pages.size]
            if not pairs:
                return
            moved = self._copy(pairs, pages, to_stage=True)
            released.set()  # vLLM's blocks are no longer read
            refs = self._store_refs(pairs, dst, pages.tolist())
            handle = self.client.backup(refs, tenant=dst.tenant)
            ok = handle.wait(self.config.store_timeout_s)
            self.staging.free(FULL, pages, handle)
            self.counters["store_pages" if ok else "store_pages_failed"] += len(refs)
        except Exception as exc:
            log.error("hicache store %d failed: %s", job_id, exc)
            self.counters["store_errors"] += 1
        finally:
            released.set()
            self._finish(TransferResult(job_id, True, moved, time.perf_counter() - t0))

    def _store_refs(
        self, pairs: list[tuple[int, int, int]], dst: HiCacheStoreSpec, slots: list[int]
    ) -> list[PageRef]:
        refs = []
        for (k, _, _), slot in zip(pairs, slots):
            parent = dst.parents[k]
            parent_hash = (
                self.namespace.root_hash
                if parent is None
                else self.namespace.page_hash(parent, self.rank)
            )
            page_hash = self.namespace.page_hash(dst.keys[k], self.rank)
            refs.append(PageRef(FULL, page_hash, parent_hash, slot, self._engine_key(dst.keys[k])))
        return refs

    def _engine_key(self, key: bytes) -> bytes:
        """vLLM's own name of the block of ``key`` (an ``OffloadKey``), as its KV events
        give it, for the sidecar's events (hicache/engine_keys.py)."""
        group = self._groups[get_offload_group_idx(key)]
        block_hash = maybe_convert_block_hash(get_offload_block_hash(key))
        name = EngineKey(
            block_hash, group.group_id, group.event_kind, group.block_size, group.sliding_window
        )
        return pack_engine_key(name)

    # -- loads ----------------------------------------------------------------------------

    def submit_load(self, job_id: int, src_spec: object, dst_spec: GPULoadStoreSpec) -> bool:
        if self.layerwise:
            self._start_layered(job_id, src_spec, dst_spec)
        else:
            self._loads.submit(self._load, job_id, src_spec, dst_spec)
        return True

    def _load(self, job_id: int, src: HiCacheLoadSpec, dst: GPULoadStoreSpec) -> None:
        t0 = time.perf_counter()
        moved, ok = 0, False
        try:
            pairs = self._pairs(dst, src.keys, None)
            if pairs is None:
                self.counters["load_mismatched"] += 1
                return
            if self.blocks is not None:
                hashes = [self.namespace.page_hash(src.keys[k], self.rank) for k, _, _ in pairs]
                where = ([pos for _, pos, _ in pairs], [b for _, _, b in pairs])
                cfg = self.config
                handed = self._handed(src, pairs)
                if handed is not None:
                    self.counters["loads_handed"] += 1
                    ok = self.blocks.load_handed(
                        hashes, *where, handed, cfg.pin_ttl_s, cfg.load_timeout_s
                    )
                else:
                    ok = self.blocks.load(hashes, *where, cfg.pin_ttl_s, cfg.load_timeout_s)
                moved = len(pairs) * self.namespace.page_bytes if ok else 0
                return
            ok = True
            while pairs and ok:
                pages = self.staging.alloc(FULL, len(pairs))
                if pages.size == 0:
                    self.counters["load_staging_full"] += 1
                    ok = False
                    break
                part, pairs = pairs[: pages.size], pairs[pages.size :]
                loaded, unsettled = self._load_part(part, src.keys, pages)
                if loaded:
                    moved += self._copy(part, pages, to_stage=False)
                ok = loaded
                self.staging.free(FULL, pages, unsettled)
        except Exception as exc:
            log.error("hicache load %d failed: %s", job_id, exc)
            self.counters["load_errors"] += 1
            ok = False
        finally:
            self.counters["loads" if ok else "loads_failed"] += 1
            self._finish(TransferResult(job_id, True, moved, time.perf_counter() - t0), not ok)

    def _handed(self, src: HiCacheLoadSpec, pairs: list) -> HandedPages | None:
        """This rank's pages of ``src`` as the scheduler's pin named them, when it did
        for every page and has ``HANDED_MARGIN_S`` or more to run."""
        handed = getattr(src, "handed", None)  # a spec of an older scheduler has none
        n = len(src.keys)
        if handed is None or len(handed.host_pages) < (self.rank + 1) * n:
            return None
        if handed.deadline - time.monotonic() < HANDED_MARGIN_S:
            return None
        mine = handed.host_pages[self.rank * n : (self.rank + 1) * n]
        pages = tuple(mine[k] for k, _, _ in pairs)
        if pages and min(pages) < 0:
            return None  # a page only on disk: read to host by the usual load
        return dataclasses.replace(handed, host_pages=pages)

    def _load_part(
        self, part: list[tuple[int, int, int]], keys: Sequence[bytes], pages: np.ndarray
    ) -> tuple[bool, TransferHandle | None]:
        """Fill ``pages`` from the sidecar: (all there, a transfer that may still write)."""
        hashes = [self.namespace.page_hash(keys[k], self.rank) for k, _, _ in part]
        receipt = self.client.pin([PageKey(FULL, h) for h in hashes], self.config.pin_ttl_s)
        if receipt is None:
            return False, None
        # A load names pages by hash; the chain (parent) matters only to stores.
        root = self.namespace.root_hash
        refs = [PageRef(FULL, h, root, page) for h, page in zip(hashes, pages.tolist())]
        try:
            outcome = self.client.load(refs, receipt, self.config.load_timeout_s)
        finally:
            self.client.unpin(receipt)
        return bool(outcome), unsettled_load(outcome)

    # -- completions ----------------------------------------------------------------------

    def _finish(self, result: TransferResult, failed: bool = False) -> None:
        with self._lock:
            self._finished.append(result)
            if failed:
                self._failed.add(result.job_id)
            self._released.pop(result.job_id, None)

    def get_finished(self) -> list[TransferResult]:
        """Every transfer done since the last call, reported as succeeded (vLLM's
        connector takes no failed job); failed loads are in :meth:`take_failed_loads`."""
        with self._lock:
            done, self._finished = self._finished, []
            failed = {r.job_id for r in done} & self._failed
            self._failed -= failed
            self._reported_failed |= failed
        return done

    def take_failed_loads(self) -> set[int]:
        """Load jobs returned by :meth:`get_finished` whose pages did not all arrive."""
        with self._lock:
            out, self._reported_failed = self._reported_failed, set()
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Return once the stores among ``job_ids`` no longer read vLLM's blocks."""
        with self._lock:
            events = [self._released[j] for j in job_ids if j in self._released]
        for event in events:
            event.wait()

    def shutdown(self) -> None:
        if self.blocks is not None and not self._shut:  # after every store submitted:
            self._stores.submit(self._drop_prebooks)  # none of these is
        self._shut = True
        self._loads.shutdown(wait=True)
        self._stores.shutdown(wait=True)
        counted = " ".join(f"{k}={v}" for k, v in sorted(self.counters.items()))
        log.info("hicache worker %d: %s", self.rank, counted or "no transfers")
        self.client.close()
        if self.staging is not None:
            self.staging.close()
