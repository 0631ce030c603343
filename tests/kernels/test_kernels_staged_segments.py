"""A segment copy through the staging ring (kernels/staged_segments.py): the kernel gathers
or scatters between the engine's blocks and a staging chunk, DMAs (memmoves on CPU tensors)
move each page's payload span. The bytes are the reference's, both ways, across several
chunks and a ring that wraps; a store never writes outside the segments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.kernels.segments import Segment, SegmentCopy
from hicache.kernels.tuning import TransferTuning

PAYLOAD = 64
ROW = 256


def _tensors(seed: int, blocks: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (blocks, ROW), dtype=torch.uint8, generator=g) for _ in range(3)]


def _gapless(t: list[torch.Tensor]) -> list[Segment]:
    # The payload from byte 16 on, tiled without a gap, out of order, across tensors.
    return [Segment(t[1], 32, 48, 16 + 96), Segment(t[0], 0, 96, 16), Segment(t[2], 16, 80, 160)]


def _tuning(chunk_bytes: int) -> TransferTuning:
    return TransferTuning(staging_chunk_bytes=chunk_bytes, staging_chunks=2,
                          staged_segments_min_bytes=1, staged_min_dma_bytes=1)  # fmt: skip


@pytest.mark.parametrize("chunk_bytes", [1, 300, 10_000], ids=["page-a-chunk", "2-a-chunk", "one"])
def test_a_staged_store_and_load_move_exactly_the_segments(chunk_bytes):
    tensors = _tensors(1)
    segs = _gapless(tensors)
    pages = torch.full((9, PAYLOAD + 320), 0xAB, dtype=torch.uint8)
    want = pages.clone()
    copy = SegmentCopy(segs, pages, PAYLOAD, _tuning(chunk_bytes), use_kernel=True)
    staged = copy.staged()
    assert (staged.lo, staged.span, staged.gapless) == (16, 224, True)
    blocks, dst = np.array([3, 11, 0, 7, 5]), np.array([8, 2, 4, 0, 6])
    staged.run(blocks, dst, to_host=True)
    SegmentCopy(segs, want, PAYLOAD).reference(blocks.tolist(), dst.tolist(), True)
    assert torch.equal(pages, want)  # headers, bytes past the span, other pages: untouched
    before = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    staged.run(blocks, dst, to_host=False)
    for seg in segs:
        i = next(k for k, t in enumerate(tensors) if t is seg.tensor)
        cols = slice(seg.src_offset, seg.src_offset + seg.nbytes)
        assert torch.equal(seg.tensor[blocks, cols], before[i][blocks, cols])
        others = [b for b in range(12) if b not in blocks]
        assert not seg.tensor[others].any()  # no other block written


@pytest.mark.parametrize("chunk_bytes", [1, 900, 1 << 20], ids=["page-a-chunk", "2-a-chunk", "one"])
def test_a_staged_load_reads_a_run_of_consecutive_pages_in_one_dma(chunk_bytes, monkeypatch):
    """Consecutive host pages within a chunk are read by one DMA, from the first span's
    start to the last one's end: never past the pool's last byte, and the blocks get the
    reference's bytes."""
    from hicache.kernels import staged_segments

    tensors = _tensors(4)
    segs = _gapless(tensors)
    pages = torch.randint(0, 256, (9, PAYLOAD + 320), dtype=torch.uint8)
    copy = SegmentCopy(segs, pages, PAYLOAD, _tuning(chunk_bytes), use_kernel=True)
    dmas: list[tuple[int, int]] = []
    real = staged_segments._emulated_dmas

    def record(dsts, srcs, sizes):
        dmas.extend(zip(srcs.tolist(), sizes.tolist()))
        real(dsts, srcs, sizes)

    monkeypatch.setattr(staged_segments, "_emulated_dmas", record)
    blocks, src = np.array([2, 4, 6, 8, 10, 1]), np.array([5, 6, 7, 8, 0, 3])
    for t in tensors:
        t.zero_()
    copy.staged().run(blocks, src, to_host=False)
    for seg in segs:
        got = seg.tensor[blocks, seg.src_offset : seg.src_offset + seg.nbytes]
        at = PAYLOAD + seg.dst_offset
        assert torch.equal(got, pages[src, at : at + seg.nbytes])
    end = pages.data_ptr() + pages.numel()
    assert all(a + n <= end for a, n in dmas)
    chunk_pages = max(1, chunk_bytes // pages.shape[1])
    runs = {1: 6, 2: 4}.get(chunk_pages, 3)  # pages 5-8 one run when a chunk holds them
    assert len(dmas) == runs


def test_a_layout_with_a_gap_stages_loads_only_and_loads_stay_exact():
    tensors = _tensors(2)
    segs = [Segment(tensors[0], 0, 64, 0), Segment(tensors[1], 0, 64, 128)]  # a gap of 64
    pages = torch.randint(0, 256, (4, PAYLOAD + 192), dtype=torch.uint8)
    copy = SegmentCopy(segs, pages, PAYLOAD, _tuning(1 << 20), use_kernel=True)
    staged = copy.staged()
    assert not staged.gapless and staged.span == 192
    assert not staged.wanted(4, to_host=True)
    for t in tensors:
        t.zero_()
    staged.run(np.array([9, 1]), np.array([3, 0]), to_host=False)
    for seg in segs:
        got = seg.tensor[[9, 1], : seg.nbytes]
        want = pages[[3, 0], PAYLOAD + seg.dst_offset : PAYLOAD + seg.dst_offset + seg.nbytes]
        assert torch.equal(got, want)


def test_only_a_gpu_copy_large_enough_with_large_pages_is_staged():
    tensors = _tensors(3)
    pages = torch.zeros(4, PAYLOAD + 320, dtype=torch.uint8)
    cpu = SegmentCopy(_gapless(tensors), pages, PAYLOAD, _tuning(1 << 20), use_kernel=True)
    assert not cpu.staged().wanted(4, to_host=False)  # CPU tensors: the memmove runs
    with pytest.raises(ValueError, match="staged_segments_min_bytes"):
        TransferTuning(staged_segments_min_bytes=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_staged_segment_copies_on_a_gpu_match_the_kernel_both_ways_and_at_once():
    """On a GPU the staged store and load (DMAs on the ring's stream, several chunks) give
    the reference's bytes, alone and with a store and a load running at once."""
    dev = torch.device("cuda")
    seg_bytes, nseg, blocks = 4096, 8, 64
    tensors = [torch.randint(0, 256, (blocks, seg_bytes), dtype=torch.uint8, device=dev)
               for _ in range(nseg)]  # fmt: skip
    segs = [Segment(t, 0, seg_bytes, i * seg_bytes) for i, t in enumerate(tensors)]
    pages = torch.zeros(blocks, 128 + nseg * seg_bytes, dtype=torch.uint8).pin_memory()
    tuning = TransferTuning(staging_chunk_bytes=3 * nseg * seg_bytes, staged_segments_min_bytes=1,
                            staged_min_dma_bytes=1)  # fmt: skip
    copy = SegmentCopy(segs, pages, 128, tuning)
    want = pages.clone()
    ids = list(range(0, 40))
    dst = list(range(63, 23, -1))
    assert copy.staged().wanted(len(ids), to_host=True)
    copy.to_host(ids, dst)
    SegmentCopy(segs, want, 128, use_kernel=False).reference(ids, dst, True)
    assert torch.equal(pages, want)
    saved = [t[ids].clone() for t in tensors]
    for t in tensors:
        t[ids] = 0
    # at once: a store of blocks 40..63 into the free pages 0..23, a load of the pages above
    store = copy.start(list(range(40, 64)), list(range(24)), to_host=True)
    load = copy.start(ids, dst, to_host=False)
    store.synchronize()
    load.synchronize()
    for k, t in enumerate(tensors):
        assert torch.equal(t[ids], saved[k])
    SegmentCopy(segs, want, 128, use_kernel=False).reference(list(range(40, 64)), list(range(24)),
                                                             True)  # fmt: skip
    assert torch.equal(pages, want)
    # consecutive host pages: a load reads each chunk's run in one DMA
    stored = [t[40:64].clone() for t in tensors]
    copy.to_device(list(range(24)), list(range(24)))
    assert all(torch.equal(t[:24], stored[k]) for k, t in enumerate(tensors))


def _compiled(kernel) -> int:
    """How many variants of a Triton kernel are compiled (or loaded) in this process."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_warmed_segment_copy_compiles_nothing_at_its_first_copies():
    """After ``warm()``, the first store and load, direct and staged, of a fresh copy's
    shape launch only variants compiled already."""
    from hicache.kernels.triton_segments import copy_segments_kernel

    dev = torch.device("cuda")
    seg_bytes, nseg, blocks = 8192, 6, 48
    tensors = [torch.zeros(blocks, seg_bytes + 48, dtype=torch.uint8, device=dev)
               for _ in range(nseg)]  # fmt: skip
    segs = [Segment(t, 16, seg_bytes, i * seg_bytes) for i, t in enumerate(tensors)]
    pages = torch.zeros(blocks, 256 + nseg * seg_bytes, dtype=torch.uint8).pin_memory()
    tuning = TransferTuning(staging_chunk_bytes=5 * nseg * seg_bytes,
                            staged_segments_min_bytes=8 * nseg * seg_bytes,
                            staged_min_dma_bytes=1)  # fmt: skip
    copy = SegmentCopy(segs, pages, 256, tuning)
    copy.warm()
    before = _compiled(copy_segments_kernel)
    for n in (1, 2, 3, 20):  # direct below 8 pages, staged from 8
        ids = list(range(n))
        copy.to_host(ids, ids[::-1])
        copy.to_device(ids[::-1], ids)
    assert _compiled(copy_segments_kernel) == before
