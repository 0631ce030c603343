"""Copies between an engine's own block tensors and host pages, in one pass.

An engine that keeps its KV cache in tensors of its own (vLLM: one tensor of byte rows
per layer, a row per block) stores a block as one host page that holds every layer's
part of it, and loads it back the same way. A :class:`SegmentCopy` describes that
mapping once: *segments*, each a run of ``nbytes`` bytes of a block row of one tensor
(at ``src_offset`` in the row) that lands at ``dst_offset`` in the page's payload. A
copy then moves ``blocks[i] <-> pages[i]`` for every segment:

* on a GPU, one launch of a Triton kernel that reads the engine's tensors and writes the
  host pages through their device-mapped address (or the reverse): no staging buffer;
* on a CPU, one ``memmove`` per run of bytes contiguous on both sides
  (:func:`hicache.kernels.cpu_rows.move_runs`);
* :meth:`SegmentCopy.reference`, plain tensor indexing, for tests.

The segments' tensors may be separate allocations: the kernel addresses each from the
first one's pointer plus an element offset, so one launch covers them all. Indices are
trusted (the caller checks them, as for the other kernels); a block or page outside its
tensor is skipped by the kernel, never written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hicache.kernels.cpu_rows import merge_runs, move_runs
from hicache.kernels.launch import kernel_for, max_programs, next_pow2, require_device_mapped
from hicache.kernels.tuning import DEFAULT_TUNING, TransferTuning

# A run of at least this many consecutive blocks to consecutive pages is copied as one
# strided copy per segment on a CPU, rather than one memmove per segment and block.
MIN_STRIDED_RUN = 4


@dataclass(frozen=True)
class Segment:
    """Bytes ``[src_offset, +nbytes)`` of row ``block`` of ``tensor`` are bytes
    ``[dst_offset, +nbytes)`` of a page's payload."""

    tensor: torch.Tensor  # [blocks, row bytes], rows of bytes
    src_offset: int
    nbytes: int
    dst_offset: int


def _word_dtype(values: Sequence[int]) -> torch.dtype:
    """The widest integer type whose size divides every address, offset and length."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if all(v % size == 0 for v in values):
            return dtype
    return torch.uint8


class SegmentCopy:
    """Block rows of an engine's tensors ↔ host pages, through fixed segments.

    ``pages`` is the host side: ``[num_pages, row_bytes]`` uint8 rows whose payload starts
    at ``payload_offset`` (pinned or registered memory for a GPU copy).
    """

    def __init__(
        self,
        segments: Sequence[Segment],
        pages: torch.Tensor,
        payload_offset: int = 0,
        tuning: TransferTuning = DEFAULT_TUNING,
        use_kernel: bool | None = None,
    ) -> None:
        """``use_kernel``: the Triton kernel (default on a GPU; on CPU tensors it runs
        interpreted, for tests), else the CPU ``memmove`` runs."""
        if not segments:
            raise ValueError("a segment copy needs at least one segment")
        if pages.dtype != torch.uint8 or pages.dim() != 2 or not pages.is_contiguous():
            raise ValueError("host pages must be contiguous [pages, row_bytes] uint8 rows")
        device = segments[0].tensor.device
        for s in segments:
            t = s.tensor
            if t.device != device or t.dim() != 2 or t.stride(1) != 1 or t.element_size() != 1:
                raise ValueError("every segment's tensor must be byte rows on one device")
            if not 0 <= s.src_offset <= s.src_offset + s.nbytes <= t.shape[1]:
                raise ValueError(f"segment {s} is outside its tensor's rows")
            if not 0 <= payload_offset + s.dst_offset + s.nbytes <= pages.shape[1]:
                raise ValueError(f"segment {s} is outside the host page")
        self.segments = tuple(segments)
        self.pages = pages
        self.payload_offset = payload_offset
        self.device = device
        self.blocks = min(s.tensor.shape[0] for s in segments)
        self.page_bytes = sum(s.nbytes for s in segments)
        self._tuning = tuning
        self._streams: dict[bool, torch.cuda.Stream] = {}
        self._gpu = None
        if use_kernel if use_kernel is not None else device.type == "cuda":
            require_device_mapped("host pages", pages, device)
            self._gpu = self._prepare_gpu()

    def _prepare_gpu(self) -> dict:
        segs, pages = self.segments, self.pages
        first = segs[0].tensor
        addrs = [s.tensor.data_ptr() + s.src_offset for s in segs]
        strides = [s.tensor.stride(0) for s in segs]
        dsts = [self.payload_offset + s.dst_offset for s in segs]
        word = _word_dtype(
            [*addrs, first.data_ptr(), *strides, *dsts, *(s.nbytes for s in segs),
             pages.data_ptr(), pages.shape[1]]
        )  # fmt: skip
        size = word.itemsize
        dev_base = first.view(-1)[: first.numel() - first.numel() % size]
        dev_words = dev_base.view(word)
        host_words = pages.view(-1).view(word)
        table = np.array(
            [
                [(a - first.data_ptr()) // size for a in addrs],
                [s // size for s in strides],
                [d // size for d in dsts],
                [s.nbytes // size for s in segs],
            ],
            dtype=np.int64,
        )
        on = torch.from_numpy(table).to(self.device)
        longest = max(s.nbytes for s in segs) // size
        # One program moves about ``tile_bytes`` per step, as the row-copy kernel does.
        tile = max(1, self._tuning.tile_bytes // size)
        cols = min(next_pow2(longest), next_pow2(tile))
        return {
            "dev": dev_words,
            "host": host_words,
            "table": on,
            "page_stride": pages.shape[1] // size,
            "cols": cols,
            "col_tiles": math.ceil(longest / cols),
            "rows": max(1, tile // cols),
        }

    def _check(self, blocks: np.ndarray, pages: np.ndarray) -> None:
        if blocks.shape != pages.shape:
            raise ValueError("give one page per block")
        if blocks.size and (blocks.min() < 0 or blocks.max() >= self.blocks):
            raise ValueError(f"a block outside the engine's {self.blocks} blocks")
        if pages.size and (pages.min() < 0 or pages.max() >= self.pages.shape[0]):
            raise ValueError(f"a page outside the {self.pages.shape[0]} host pages")

    def to_host(self, blocks: Sequence[int], pages: Sequence[int]) -> None:
        """Copy each block's segments into its host page (waits for the copy)."""
        _wait(self.start(blocks, pages, to_host=True))

    def to_device(self, pages: Sequence[int], blocks: Sequence[int]) -> None:
        """Copy each host page's segments into its block (waits for the copy)."""
        _wait(self.start(blocks, pages, to_host=False))

    def start(
        self, blocks: Sequence[int], pages: Sequence[int], to_host: bool
    ) -> torch.cuda.Event | None:
        """Begin the copy of ``blocks[i] <-> pages[i]``: on a GPU, the event recorded after
        it (wait on it before the bytes are used); elsewhere the copy is done on return
        (None)."""
        blocks_a = np.asarray(blocks, dtype=np.int64)
        pages_a = np.asarray(pages, dtype=np.int64)
        self._check(blocks_a, pages_a)
        if not blocks_a.size:
            return None
        if self._gpu is None:
            self._copy_cpu(blocks_a, pages_a, to_host)
            return None
        if self.device.type != "cuda":  # the kernel interpreted on CPU tensors (tests)
            self._launch(blocks_a, pages_a, to_host)
            return None
        # Each direction on a stream of its own, so that a store and a load overlap;
        # after what the calling thread's stream has queued (the engine's writes).
        stream = self._streams.get(to_host)
        if stream is None:
            stream = self._streams[to_host] = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._launch(blocks_a, pages_a, to_host)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def _launch(self, blocks: np.ndarray, pages: np.ndarray, to_host: bool) -> None:
        g = self._gpu
        idx = torch.from_numpy(np.stack([blocks, pages])).to(self.device, non_blocking=True)
        n_rows = blocks.size * len(self.segments)
        num_tiles = math.ceil(n_rows / g["rows"]) * g["col_tiles"]
        grid = (min(num_tiles, max_programs(self.device, self._tuning)),)
        table = g["table"]
        from hicache.kernels.triton_segments import copy_segments_kernel

        kernel_for(copy_segments_kernel, self.device)[grid](
            g["dev"],
            g["host"],
            idx[0],
            idx[1],
            table[0],
            table[1],
            table[2],
            table[3],
            n_rows,
            len(self.segments),
            g["page_stride"],
            self.blocks,
            self.pages.shape[0],
            num_tiles,
            g["col_tiles"],
            TO_HOST=to_host,
            ROWS=g["rows"],
            COLS=g["cols"],
            num_warps=self._tuning.num_warps,
        )

    def _copy_cpu(self, blocks: np.ndarray, pages: np.ndarray, to_host: bool) -> None:
        """Runs of consecutive blocks going to consecutive pages move as one strided
        ``copy_`` per segment (torch spreads its rows over threads); what is left of
        scattered blocks as one ``memmove`` per run of contiguous bytes."""
        breaks = np.flatnonzero((np.diff(blocks) != 1) | (np.diff(pages) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [blocks.size]))
        long_runs = (ends - starts) >= MIN_STRIDED_RUN
        if long_runs.any():
            p0 = self.payload_offset
            for a, b in zip(starts[long_runs].tolist(), ends[long_runs].tolist()):
                b0, h0, n = int(blocks[a]), int(pages[a]), b - a
                for s in self.segments:
                    dev = s.tensor[b0 : b0 + n, s.src_offset : s.src_offset + s.nbytes]
                    col = p0 + s.dst_offset
                    host = self.pages[h0 : h0 + n, col : col + s.nbytes]
                    (host.copy_(dev) if to_host else dev.copy_(host))
            rest = np.concatenate(
                [np.arange(a, b) for a, b in zip(starts[~long_runs], ends[~long_runs])]
                or [np.empty(0, dtype=np.int64)]
            )
            blocks, pages = blocks[rest], pages[rest]
            if not blocks.size:
                return
        host = self.pages.data_ptr() + pages * self.pages.stride(0) + self.payload_offset
        dev_addr, host_addr, nbytes = [], [], []
        for s in self.segments:
            t = s.tensor
            dev_addr.append(t.data_ptr() + blocks * t.stride(0) + s.src_offset)
            host_addr.append(host + s.dst_offset)
            nbytes.append(np.full(blocks.size, s.nbytes, dtype=np.int64))
        dev, hst = np.concatenate(dev_addr), np.concatenate(host_addr)
        dst, src = (hst, dev) if to_host else (dev, hst)
        move_runs(*merge_runs(dst, src, np.concatenate(nbytes)))

    def reference(self, blocks: Sequence[int], pages: Sequence[int], to_host: bool) -> None:
        """The same copy by tensor indexing (tests compare the others with it)."""
        p = self.payload_offset
        for b, page in zip(blocks, pages):
            for s in self.segments:
                host = self.pages[page, p + s.dst_offset : p + s.dst_offset + s.nbytes]
                dev = s.tensor[b, s.src_offset : s.src_offset + s.nbytes]
                if to_host:
                    host.copy_(dev.to(host.device))
                else:
                    dev.copy_(host.to(dev.device))


def _wait(event: torch.cuda.Event | None) -> None:
    if event is not None:
        event.synchronize()
