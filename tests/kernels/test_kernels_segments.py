"""Block rows of an engine's own tensors to host pages and back (kernels/segments.py): the
Triton kernel (interpreted on CPU tensors) and the CPU memmove runs against the torch
reference, across separate allocations, aligned and unaligned."""

from __future__ import annotations

import pytest
import torch

from hicache.kernels import segments_cpu
from hicache.kernels.segments import Segment, SegmentCopy, _word_dtype
from hicache.kernels.tuning import DEFAULT_TUNING, TransferTuning

PAYLOAD = 128


def _engine(seed: int, row: int = 96, blocks: int = 10) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (blocks, row), dtype=torch.uint8, generator=g) for _ in range(3)]


def _segments(tensors: list[torch.Tensor], unaligned: bool) -> list[Segment]:
    a, b, c = tensors
    if unaligned:  # a layer's page cut at an odd byte, as a K/V boundary may cut it
        return [
            Segment(a, 0, 96, 0),
            Segment(b, 0, 37, 96),
            Segment(b, 37, 59, 133),
            Segment(c, 5, 91, 192),
        ]
    return [
        Segment(a, 0, 96, 0),
        Segment(b, 0, 40, 96),
        Segment(b, 40, 56, 136),
        Segment(c, 8, 88, 192),
    ]


@pytest.mark.parametrize("use_kernel", [True, False], ids=["triton", "cpu-runs"])
@pytest.mark.parametrize("unaligned", [False, True], ids=["words", "bytes"])
def test_a_store_and_a_load_move_exactly_the_segments(use_kernel, unaligned):
    tensors = _engine(1)
    segs = _segments(tensors, unaligned)
    pages = torch.full((6, 512), 0xAB, dtype=torch.uint8)
    expected = pages.clone()
    copy = SegmentCopy(segs, pages, payload_offset=PAYLOAD, use_kernel=use_kernel)
    SegmentCopy(segs, expected, payload_offset=PAYLOAD).reference([3, 7, 1], [5, 0, 2], True)

    copy.to_host([3, 7, 1], [5, 0, 2])

    assert torch.equal(pages, expected)  # the frames and the untouched pages stay as they were
    before = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    copy.to_device([5, 0, 2], [3, 7, 1])
    for seg in segs:
        src = slice(seg.src_offset, seg.src_offset + seg.nbytes)
        i = next(n for n, t in enumerate(tensors) if t is seg.tensor)
        assert torch.equal(seg.tensor[[3, 7, 1], src], before[i][[3, 7, 1], src])
    assert not any(t[[0, 2, 4, 5, 6, 8, 9]].any() for t in tensors)  # other blocks untouched


@pytest.mark.parametrize("step, vec", [(16, 2), (8, 1)], ids=["16-byte", "8-byte"])
def test_the_kernel_is_told_of_16_byte_accesses_only_where_every_offset_allows_them(step, vec):
    """A layout whose offsets, strides and lengths are all multiples of 16 bytes is copied
    with 16-byte accesses (two int64 words); one 8-byte offset anywhere keeps one word per
    access. Both move exactly the reference's bytes, both ways."""
    tensors = _engine(4, row=8 * step, blocks=8)
    a, b, c = tensors
    segs = [Segment(a, 0, 8 * step, 0), Segment(b, step, 3 * step, 8 * step),
            Segment(c, 2 * step, 5 * step, 11 * step)]  # fmt: skip
    got = torch.zeros(6, PAYLOAD + 16 * step, dtype=torch.uint8)
    want = got.clone()
    copy = SegmentCopy(segs, got, PAYLOAD, use_kernel=True)
    assert copy._gpu["vec"] == vec
    copy.to_host([7, 2, 4], [1, 5, 0])
    SegmentCopy(segs, want, PAYLOAD).reference([7, 2, 4], [1, 5, 0], True)
    assert torch.equal(got, want)
    before = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    copy.to_device([1, 5, 0], [7, 2, 4])
    for seg in segs:
        i = next(n for n, t in enumerate(tensors) if t is seg.tensor)
        cols = slice(seg.src_offset, seg.src_offset + seg.nbytes)
        assert torch.equal(seg.tensor[[7, 2, 4], cols], before[i][[7, 2, 4], cols])


def test_the_widest_word_that_divides_everything_is_used():
    assert _word_dtype([0, 16, 4096]) is torch.int64
    assert _word_dtype([0, 12, 4096]) is torch.int32
    assert _word_dtype([0, 37]) is torch.uint8


def test_indices_outside_the_blocks_or_pages_are_refused():
    tensors = _engine(2)
    copy = SegmentCopy(_segments(tensors, False), torch.zeros(4, 512, dtype=torch.uint8), PAYLOAD)
    with pytest.raises(ValueError, match="block outside"):
        copy.to_host([10], [0])
    with pytest.raises(ValueError, match="page outside"):
        copy.to_host([0], [4])
    with pytest.raises(ValueError, match="one page per block"):
        copy.to_host([0, 1], [0])


def test_a_segment_that_does_not_fit_is_refused():
    a = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside its tensor"):
        SegmentCopy([Segment(a, 32, 64, 0)], torch.zeros(2, 256, dtype=torch.uint8))
    with pytest.raises(ValueError, match="outside the host page"):
        SegmentCopy([Segment(a, 0, 64, 200)], torch.zeros(2, 256, dtype=torch.uint8))


@pytest.mark.parametrize(
    "use_kernel, threaded",
    [(True, False), (False, False), (False, True)],
    ids=["triton", "cpu-runs", "cpu-pieces-on-threads"],
)
def test_runs_of_consecutive_blocks_and_scattered_ones_move_alike(
    use_kernel, threaded, monkeypatch
):
    """Consecutive blocks to consecutive pages, ascending or descending (on a CPU one
    numpy assignment per segment), beside scattered ones (memmoves), a run turning round
    on one page: the reference's bytes both ways. Threaded, the runs and blocks are cut
    into pieces of a block or two, taken by two threads."""
    tuning = DEFAULT_TUNING
    if threaded:
        tuning = TransferTuning(cpu_copy_threads=2, cpu_parallel_min_bytes=0)
        monkeypatch.setattr(segments_cpu, "PIECE_BYTES", 100)
    tensors = _engine(3, blocks=40)
    segs = _segments(tensors, unaligned=True)
    blocks = [*range(2, 10), 20, 15, *range(11, 16), *range(24, 30), *range(31, 36)]
    pages = [*range(4, 12), 0, 22, *range(16, 21), *range(35, 29, -1), 23, 24, 25, 26, 27]
    got = torch.zeros(40, 512, dtype=torch.uint8)
    want = torch.zeros_like(got)
    SegmentCopy(segs, got, PAYLOAD, tuning, use_kernel=use_kernel).to_host(blocks, pages)
    SegmentCopy(segs, want, PAYLOAD).reference(blocks, pages, True)
    assert torch.equal(got, want)
    before = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    SegmentCopy(segs, got, PAYLOAD, tuning, use_kernel=use_kernel).to_device(pages, blocks)
    for seg in segs:
        i = next(n for n, t in enumerate(tensors) if t is seg.tensor)
        cols = slice(seg.src_offset, seg.src_offset + seg.nbytes)
        assert torch.equal(seg.tensor[blocks, cols], before[i][blocks, cols])


@pytest.mark.parametrize("threaded", [False, True], ids=["one-thread", "pieces-on-threads"])
@pytest.mark.parametrize("to_host", [True, False], ids=["store", "load"])
def test_a_cpu_copy_whose_sources_are_consecutive_moves_by_runs_whatever_the_targets(
    to_host, threaded, monkeypatch
):
    """Sources consecutive in any order (a store's blocks, a load's pages), their other
    side shuffled: every item moves by runs, no memmove at all, and the bytes are the
    reference's; a few items outside the runs beside them move by memmove, as exactly."""
    tuning = DEFAULT_TUNING
    if threaded:
        tuning = TransferTuning(cpu_copy_threads=2, cpu_parallel_min_bytes=0)
        monkeypatch.setattr(segments_cpu, "PIECE_BYTES", 100)
    g = torch.Generator().manual_seed(11)
    tensors = _engine(5, blocks=48)
    segs = _segments(tensors, unaligned=True)
    sources = torch.randperm(20, generator=g) + 3  # 3..22 in a shuffled order
    targets = torch.randperm(48, generator=g)[:20]  # scattered over the other side
    blocks, pages = (sources, targets) if to_host else (targets, sources)
    host = torch.randint(0, 256, (48, 512), dtype=torch.uint8, generator=g)
    state = [*(t.clone() for t in tensors), host.clone()]

    def run(blocks, pages, use_reference: bool) -> list[torch.Tensor]:
        for t, s in zip([*tensors, host], state):
            t.copy_(s)
        copy = SegmentCopy(segs, host, PAYLOAD, tuning, use_kernel=False)
        if use_reference:
            copy.reference(blocks.tolist(), pages.tolist(), to_host)
        else:
            copy.start(blocks.tolist(), pages.tolist(), to_host)
        return [t.clone() for t in [*tensors, host]]

    want = run(blocks, pages, True)
    with monkeypatch.context() as m:
        m.setattr(segments_cpu, "_memmove", lambda *a: pytest.fail("a run moved by memmove"))
        got = run(blocks, pages, False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # Two items whose sources join no run, among them: memmoves, the same bytes.
    loose_src = torch.tensor([30, 40])
    loose_dst = torch.tensor([t for t in range(48) if t not in targets.tolist()][:2])
    if to_host:
        blocks, pages = torch.cat([loose_src, blocks]), torch.cat([loose_dst, pages])
    else:
        blocks, pages = torch.cat([loose_dst, blocks]), torch.cat([loose_src, pages])
    assert all(
        torch.equal(a, b) for a, b in zip(run(blocks, pages, False), run(blocks, pages, True))
    )
