"""A segment copy through a device staging ring, its PCIe hop done by copy-engine DMAs.

:class:`~hicache.kernels.segments.SegmentCopy`'s kernel reads and writes the pinned host
pages straight from the SMs. One way that moves 0.86-0.94 of a pinned memcpy, but a store
and a load at once level off at 0.64-0.81 of two concurrent memcpys, where the copy engines
run both ways at full speed (docs/performance.md). Here, as for KV pools
(:mod:`hicache.kernels.staged`), the kernel only gathers (a store) or scatters (a load)
between the engine's block tensors and a staging chunk in device memory, and DMAs on the
copy engines move the payloads between the chunk and the host pages:

* store: the kernel gathers a chunk of blocks into a staging chunk (the payloads back to
  back); one DMA a page copies it out;
* load: one DMA a run of consecutive host pages copies a chunk in (staged a host row
  apart, as they lie in the pool); the kernel scatters it into the blocks.

The ring, its helper stream, its events and the order of the work are those of the KV
path (``staged._ring_for``, ``staged._issue_on_gpu``): a kernel on the caller's stream
overlaps the DMAs of the chunk before it. A DMA moves the span of the payload the
segments cover; a store stages only where the segments tile that span without a gap
(else the DMA would write bytes of the page that are not the copy's), a load either way.
On CPU tensors the same plan runs with memmoves standing in for the DMAs (the tests).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from hicache.kernels.staged import (
    StagingRing,
    _emulated_dmas,
    _issue_on_gpu,
    _ring_for,
    plan_dmas,
)

# A :class:`hicache.kernels.segments.SegmentCopy` (that module imports this one).
SegmentCopy = Any


class _Launch:
    """One staging slot's segment copy, called as the KV path calls its row launchers:
    ``launch(device items, staging items)`` for a store, the reverse for a load."""

    def __init__(self, copy: SegmentCopy, to_host: bool, stream: int | None = None) -> None:
        self.copy = copy
        self.to_host = to_host
        self.stream = stream

    def launch(self, first: np.ndarray, second: np.ndarray) -> None:
        blocks, slots = (first, second) if self.to_host else (second, first)
        self.copy._launch(np.asarray(blocks), np.asarray(slots), self.to_host, self.stream)


class StagedSegments:
    """The staged form of one :class:`SegmentCopy` (its segments, host pages, tuning)."""

    def __init__(self, copy: SegmentCopy) -> None:
        spans = sorted((s.dst_offset, s.dst_offset + s.nbytes) for s in copy.segments)
        self.lo = spans[0][0]
        self.span = max(end for _, end in spans) - self.lo
        # Staged pages start 16-byte aligned, so the kernel keeps its 16-byte accesses.
        self.stride = -(-self.span // 16) * 16
        self.gapless = all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        self.row = copy.pages.stride(0) * copy.pages.element_size()  # a host page's row
        self.copy = copy
        self._stages: dict[tuple[int, int, int], SegmentCopy] = {}

    def could_stage(self, to_host: bool) -> bool:
        """Whether a large enough copy this way would be staged: on a GPU, pages whose
        DMAs are at least ``staged_min_dma_bytes``; a store only where its segments leave
        no gap; never with ``staged_segments_min_bytes`` 0."""
        tuning = self.copy._tuning
        if self.copy.device.type != "cuda" or not tuning.staged_segments_min_bytes:
            return False
        return self.span >= tuning.staged_min_dma_bytes and (self.gapless or not to_host)

    def wanted(self, pages: int, to_host: bool) -> bool:
        """Whether a copy of ``pages`` pages this way goes through the ring: one that
        :meth:`could_stage` of at least ``staged_segments_min_bytes``."""
        big = pages * self.span >= self.copy._tuning.staged_segments_min_bytes
        return big and self.could_stage(to_host)

    def _layout(self, to_host: bool) -> tuple[int, int]:
        """Bytes from one staged page to the next, and pages a slot. A store stages the
        payload spans back to back (16-byte aligned). A load stages them a host row
        apart, as they lie in the host pool, so that one DMA reads a run of consecutive
        host pages whole (the frames between their spans come along and are not used)."""
        stride = self.row if not to_host else self.stride
        return stride, max(1, self.copy._tuning.staging_chunk_bytes // stride)

    def _ring(self, to_host: bool, stream: int | None = None) -> tuple[StagingRing, int, int]:
        """The ring of the raw ``stream`` (default: the current one; a fresh ring on a
        CPU), the staged page stride, and the pages a slot holds."""
        copy = self.copy
        tuning = copy._tuning
        stride, chunk_pages = self._layout(to_host)
        slot_bytes = chunk_pages * stride
        if copy.device.type == "cuda":
            stream_key = stream or torch.cuda.current_stream(copy.device).cuda_stream
            ring = _ring_for(copy.device, stream_key, slot_bytes, tuning)
        else:
            ring = StagingRing(copy.device, slot_bytes, tuning.staging_chunks)
        return ring, stride, chunk_pages

    def warm(self, to_host: bool, skip: np.ndarray) -> None:
        """Launch each slot's kernel of the current stream's ring over ``skip`` (blocks
        of -1, which it skips): compiled before the first staged copy needs it."""
        ring, stride, chunk_pages = self._ring(to_host)
        for buffer in ring.buffers:
            stage = self._stage(buffer, stride, chunk_pages)
            stage._launch(skip, np.zeros_like(skip), to_host)

    def _stage(self, buffer: torch.Tensor, stride: int, chunk_pages: int) -> SegmentCopy:
        """The segment copy between the engine's blocks and ``buffer`` seen as
        ``chunk_pages`` staged pages ``stride`` bytes apart (built once per ring slot)."""
        key = (buffer.data_ptr(), stride, chunk_pages)
        stage = self._stages.get(key)
        if stage is None:
            if len(self._stages) >= 16:  # rings come and go: keep only recent slots
                self._stages.clear()
            pages = buffer[: chunk_pages * stride].view(chunk_pages, stride)
            # The copy's own classes (segments.py imports this module, not the reverse).
            segs = [
                type(s)(s.tensor, s.src_offset, s.nbytes, s.dst_offset - self.lo)
                for s in self.copy.segments
            ]
            stage = type(self.copy)(segs, pages, 0, self.copy._tuning, use_kernel=True)
            self._stages[key] = stage
        return stage

    def run(
        self, blocks: np.ndarray, pages: np.ndarray, to_host: bool, stream: int | None = None
    ) -> None:
        """Copy ``blocks[i] <-> pages[i]`` (checked by the caller): queued on the raw
        ``stream`` on a GPU (default: the current one; the caller records its event
        after), done on return on a CPU."""
        copy = self.copy
        tuning = copy._tuning
        device = copy.device
        ring, stride, chunk_pages = self._ring(to_host, stream)
        host_base = copy.pages.data_ptr() + copy.payload_offset + self.lo
        # Chunk c (pages plan.page_bounds[c] onwards) goes through slot c % slots; a
        # store's first chunk and a load's last are an eighth of the others (plan_dmas),
        # so the gather before the first DMA and the scatter after the last are short. A
        # store: one DMA a page. A load: one DMA a run of consecutive host pages within a
        # chunk, from the first span's start to the last one's end (never past the pool's
        # last byte).
        plan = plan_dmas(pages, host_base, self.row, stride, chunk_pages, small_end=not to_host)
        sizes = plan.size - np.uint64(stride - self.span)
        bases = np.array([b.data_ptr() for b in ring.buffers], dtype=np.uint64)
        chunk_of_dma = np.repeat(
            np.arange(plan.num_chunks, dtype=np.int64), np.diff(plan.dma_bounds)
        )
        stage_addr = bases[chunk_of_dma % ring.slots] + plan.stage_offset
        dsts, srcs = (plan.host_addr, stage_addr) if to_host else (stage_addr, plan.host_addr)
        launchers = [
            _Launch(self._stage(b, stride, chunk_pages), to_host, stream) for b in ring.buffers
        ]
        stage_items = np.arange(chunk_pages, dtype=np.int64)
        if device.type != "cuda":
            for c in range(plan.num_chunks):
                lo, hi = int(plan.page_bounds[c]), int(plan.page_bounds[c + 1])
                d = slice(int(plan.dma_bounds[c]), int(plan.dma_bounds[c + 1]))
                launcher = launchers[c % ring.slots]
                if to_host:
                    launcher.launch(blocks[lo:hi], stage_items[: hi - lo])
                    _emulated_dmas(dsts[d], srcs[d], sizes[d])
                else:
                    _emulated_dmas(dsts[d], srcs[d], sizes[d])
                    launcher.launch(stage_items[: hi - lo], blocks[lo:hi])
            return
        from hicache.kernels.copy_engine import Copies1D

        dmas = Copies1D(dsts, srcs, sizes, ring.stream_handle, tuning.staged_batched_dma)
        caller = stream or torch.cuda.current_stream(device).cuda_stream
        _issue_on_gpu(plan, ring, launchers, blocks, stage_items, dmas, caller, to_host)
