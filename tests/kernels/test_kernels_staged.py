"""The staged KV path: its DMA plan, and its round trips (on CPU, host memcpys stand in
for the copy engines and Triton runs interpreted) against the torch reference and a loop,
bit for bit, on fresh random inputs with poisoned outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hicache.kernels as kernels
from hicache.kernels import Backend, TransferTuning, reference
from hicache.kernels.staged import host_dma_count, plan_dmas
from tests.support.bits import bits, randomize


def test_plan_merges_neighbouring_host_pages_within_a_chunk() -> None:
    # Pages of 100 bytes back to back from address 1000; chunks of 4 pages.
    plan = plan_dmas(np.array([5, 6, 7, 2, 3, 9]), 1000, 100, 100, 4)
    assert plan.page_bounds.tolist() == [0, 4, 6]
    assert plan.dma_bounds.tolist() == [0, 2, 4]
    # 5,6,7 merge; 2 starts a run that the chunk boundary cuts before 3; 9 is alone.
    assert plan.host_addr.tolist() == [1500, 1200, 1300, 1900]
    assert plan.stage_offset.tolist() == [0, 300, 0, 100]
    assert plan.size.tolist() == [300, 100, 100, 100]


def test_plan_takes_one_dma_per_page_when_host_pages_are_padded() -> None:
    plan = plan_dmas(np.array([0, 1, 2, 3]), 0, 128, 100, 3)
    assert plan.size.tolist() == [100] * 4
    assert plan.host_addr.tolist() == [0, 128, 256, 384]
    assert plan.stage_offset.tolist() == [0, 100, 200, 0]
    assert host_dma_count(np.array([0, 1, 2, 3]), 128, 100) == 4


@pytest.mark.parametrize("small_end", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 16, 17, 40])
def test_a_plan_with_a_small_first_or_last_chunk_covers_every_page_once(small_end, n) -> None:
    """A store's plan (``small_end`` False) starts with a chunk an eighth of the others,
    a load's ends with one; each DMA lands inside its own chunk's slot, every page once,
    where the page's position in its chunk says."""
    rng = np.random.default_rng(n)
    pages = rng.permutation(64)[:n]
    pages[n // 3 : n // 3 + n // 4] = np.arange(50, 50 + n // 4)  # a run of neighbours
    plan = plan_dmas(pages, 0, 10, 10, 16, small_end=small_end)
    sizes = np.diff(plan.page_bounds)
    assert plan.page_bounds[0] == 0 and plan.page_bounds[-1] == n and (sizes > 0).all()
    assert (sizes <= 16).all()
    if n > 2:  # more pages than an eighth of a chunk: the small one where asked
        assert sizes[-1 if small_end else 0] == 2
        middle = sizes[:-2] if small_end else sizes[1:-1]  # the rest whole, but one
        assert (middle == 16).all()
    # Replay the DMAs: each page's bytes land at its position within its chunk.
    seen = []
    for c in range(plan.num_chunks):
        lo, hi = plan.page_bounds[c], plan.page_bounds[c + 1]
        for d in range(plan.dma_bounds[c], plan.dma_bounds[c + 1]):
            first, count = int(plan.stage_offset[d]) // 10, int(plan.size[d]) // 10
            assert first + count <= hi - lo
            for k in range(count):
                assert int(plan.host_addr[d]) // 10 + k == pages[lo + first + k]
                seen.append(lo + first + k)
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("seed", range(5))
def test_dma_count_matches_the_plan_when_one_chunk_holds_everything(seed: int) -> None:
    rng = np.random.default_rng(seed)
    pages = rng.permutation(40)[:25]
    pages[5:12] = np.arange(30, 37)  # one long run
    plan = plan_dmas(pages, 0, 64, 64, 1000)
    assert host_dma_count(pages, 64, 64) == plan.size.size
    assert int(plan.size.sum()) == 25 * 64


def _host_view(buf: torch.Tensor, n: int, page_shape, dtype, pad: int) -> torch.Tensor:
    page_bytes = dtype.itemsize * int(torch.Size(page_shape).numel())
    rows = buf.view(n, page_bytes + pad)
    return rows[:, :page_bytes].view(dtype).view(n, *page_shape)


LAYERS, HEADS, DIM = 3, 2, 8


@pytest.mark.parametrize("slots", [1, 2, 3])
@pytest.mark.parametrize(
    ("dtype", "page_size", "pad", "in_order"),
    [
        (torch.bfloat16, 1, 0, True),
        (torch.float16, 4, 64, False),
        (torch.float32, 16, 0, False),
        (torch.bfloat16, 16, 0, True),
    ],
)
def test_staged_round_trip_matches_reference_and_loop(
    dtype: torch.dtype, page_size: int, pad: int, in_order: bool, slots: int
) -> None:
    """Chunks of 2 pages over 7 pages: 4 chunks, so every slot of the ring is reused."""
    gen = torch.Generator().manual_seed(page_size * 10 + slots + pad)
    num_pages, host_n, n = 12, 14, 7
    page_shape = (2, LAYERS, page_size, HEADS, DIM)
    page_bytes = dtype.itemsize * int(torch.Size(page_shape).numel())
    tuning = TransferTuning(staging_chunk_bytes=2 * page_bytes + 1, staging_chunks=slots)
    device_kv = randomize(
        torch.empty(2, LAYERS, num_pages * page_size, HEADS, DIM, dtype=dtype), gen
    )
    buf = randomize(torch.empty(host_n * (page_bytes + pad), dtype=torch.uint8), gen)
    device_pages = torch.tensor([4, 11, 0, 4, 7, 2, 9])  # device page 4 twice
    if in_order:
        host_pages = torch.tensor([3, 4, 5, 6, 10, 11, 0])
    else:
        host_pages = torch.randperm(host_n, generator=gen)[:n]

    got, want, loop = buf.clone(), buf.clone(), buf.clone()
    kernels.kv_pages_to_host(
        device_kv,
        _host_view(got, host_n, page_shape, dtype, pad),
        device_pages,
        host_pages,
        page_size,
        backend="staged",
        tuning=tuning,
    )
    reference.kv_pages_to_host_ref(
        device_kv,
        _host_view(want, host_n, page_shape, dtype, pad),
        device_pages,
        host_pages,
        page_size,
    )
    loop_view = _host_view(loop, host_n, page_shape, dtype, pad)
    for p, h in zip(device_pages.tolist(), host_pages.tolist()):
        loop_view[h] = device_kv[:, :, p * page_size : (p + 1) * page_size]
    assert torch.equal(got, want) and torch.equal(got, loop)
    assert not torch.equal(got, buf)

    host_kv = _host_view(got, host_n, page_shape, dtype, pad)
    back = torch.tensor([1, 8, 3, 10, 6, 5, 0])
    target = randomize(torch.empty_like(device_kv), gen)
    dev_got, dev_want = target.clone(), target.clone()
    kernels.kv_pages_to_device(
        host_kv, dev_got, host_pages, back, page_size, backend="staged", tuning=tuning
    )
    reference.kv_pages_to_device_ref(host_kv, dev_want, host_pages, back, page_size)
    assert torch.equal(bits(dev_got), bits(dev_want))
    paged = dev_got.view(2, LAYERS, num_pages, page_size, HEADS, DIM)
    original = device_kv.view(2, LAYERS, num_pages, page_size, HEADS, DIM)
    assert torch.equal(bits(paged[:, :, back]), bits(original[:, :, device_pages]))
    untouched = torch.ones(num_pages, dtype=torch.bool)
    untouched[back] = False
    poisoned = target.view(2, LAYERS, num_pages, page_size, HEADS, DIM)
    assert torch.equal(bits(paged[:, :, untouched]), bits(poisoned[:, :, untouched]))


def test_staged_transfer_of_a_layer_slice_of_the_pool() -> None:
    """A layer-sliced pool view (K and V blocks unevenly spaced) gathers correctly."""
    gen = torch.Generator().manual_seed(3)
    pool = randomize(torch.empty(2, 5, 6 * 4, 2, 8, dtype=torch.float16), gen)
    device_kv = pool[:, 1:4]
    host = randomize(torch.empty(5, 2, 3, 4, 2, 8, dtype=torch.float16), gen)
    want = host.clone()
    dp, hp = torch.tensor([5, 0, 3]), torch.tensor([1, 2, 4])
    kernels.kv_pages_to_host(device_kv, host, dp, hp, 4, backend="staged")
    reference.kv_pages_to_host_ref(device_kv, want, dp, hp, 4)
    assert torch.equal(bits(host), bits(want))


def test_default_dispatch_stages_only_large_transfers_in_long_runs() -> None:
    tuning = TransferTuning(
        staged_min_transfer_bytes=64 << 20,
        staged_min_dma_bytes=1 << 20,
        copy_engine_min_item_bytes_to_host=4 << 20,
    )
    big, runs = 256 << 20, 2 << 20
    assert tuning.auto_backend(128 << 10, True, transfer_bytes=big, dma_bytes=runs) is (
        Backend.STAGED
    )
    # Too small a transfer, too short runs, or no staged path possible (dma_bytes 0).
    assert tuning.auto_backend(128 << 10, True, transfer_bytes=32 << 20, dma_bytes=runs) is (
        Backend.TRITON
    )
    assert tuning.auto_backend(128 << 10, False, transfer_bytes=big, dma_bytes=512 << 10) is (
        Backend.TRITON
    )
    # Items that the copy engines take whole are not staged.
    for dma_bytes in (0, 8 << 20):
        assert tuning.auto_backend(8 << 20, True, transfer_bytes=big, dma_bytes=dma_bytes) is (
            Backend.COPY_ENGINE
        )


def test_cpu_tensors_take_the_memmove_rows_by_default() -> None:
    device_kv = torch.zeros(2, 2, 64, 2, 4)
    host_kv = torch.zeros(8, 2, 2, 16, 2, 4)
    idx = torch.tensor([0, 1])
    tuning = TransferTuning(staged_min_transfer_bytes=0, staged_min_dma_bytes=1)
    picked = kernels.kv_transfer_backend(
        device_kv, host_kv, idx, idx, 16, to_host=True, tuning=tuning
    )
    assert picked is Backend.CPU


def test_staged_refuses_what_it_cannot_move() -> None:
    conv, ssm = torch.zeros(2, 4, 3, 2), torch.zeros(2, 4, 5)
    hc, hs = torch.zeros(3, 2, 3, 2), torch.zeros(3, 2, 5)
    idx = torch.tensor([0])
    with pytest.raises(ValueError, match="moves KV pages only"):
        kernels.mamba_states_to_host(conv, ssm, hc, hs, idx, idx, backend="staged")
    dst, src = torch.zeros(2, 4, 3), torch.zeros(2, 2, 3, 3)
    with pytest.raises(ValueError, match="no staged backend"):
        kernels.fused_mamba_state_scatter_with_mask(
            dst, src, torch.tensor([0, 1]), torch.tensor([0, 1]), backend="staged"
        )
    with pytest.raises(ValueError, match="staging_chunks must be >= 1"):
        TransferTuning(staging_chunks=0)
    device_kv, host_kv = torch.zeros(2, 1, 8, 1, 2), torch.zeros(2, 2, 1, 4, 1, 2)
    before = host_kv.clone()
    with pytest.raises(IndexError, match="host_pages holds 2"):
        kernels.kv_pages_to_host(
            device_kv, host_kv, torch.tensor([0]), torch.tensor([2]), 4, backend="staged"
        )
    assert torch.equal(host_kv, before)
