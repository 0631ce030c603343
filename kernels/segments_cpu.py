"""The CPU form of a :class:`~hicache.kernels.segments.SegmentCopy`: an engine's block rows
to and from host pages at memory speed, with the GIL released for the bytes.

A copy is cut by its **source** side (a store's blocks, a load's pages): sorted by source
index, the items whose sources are consecutive rows form runs, and a run of
:data:`~hicache.kernels.cpu_rows.MIN_SOURCE_RUN` or more moves as one numpy assignment per
segment, ``dst[indices] = src[first : first + n]``: the source a plain strided view read
front to back, the destination rows scattered by index. numpy runs it in C without the
GIL, row after row, so a run costs one Python call per segment however many rows it has,
and the source is read as one stream (a scattered source is read in many short streams,
each starting cold). Whether the destination rows are consecutive does not matter. On the
2-core development box, 64 pages of 16 × 64 KiB segments with consecutive blocks went to
shuffled host pages at 0.73–0.88 of a memcpy this way, against 0.57–0.59 for a
``memmove`` per segment and block on the same threads (``benchmarks/bench_cpu_copy.py``).
Items in no long run move a ``memmove`` per segment (``ctypes.memmove`` releases the GIL
too, but each call takes it back).

A copy of ``cpu_parallel_min_bytes`` or more is cut into pieces of about
:data:`~hicache.kernels.cpu_rows.PIECE_BYTES` that ``cpu_copy_threads`` threads, the
calling one included, take from one queue (:func:`~hicache.kernels.cpu_rows.drain_pieces`):
a thread the OS deschedules on a busy host holds up only the piece it has. No
torch ``copy_`` here: its intra-op threads wait at a barrier for one another, which on a
busy host made a 2 MiB strided copy take milliseconds.

Indices are trusted (:class:`SegmentCopy` checks them first).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from hicache.kernels.cpu_rows import MIN_SOURCE_RUN, PIECE_BYTES, drain_pieces, source_runs
from hicache.kernels.tuning import TransferTuning

_memmove = ctypes.memmove


class CpuSegments:
    """The segments of a copy as numpy views and raw addresses, made once.

    ``segments``: ``(tensor, src_offset, nbytes, dst_offset)`` of each segment, with
    ``tensor`` ``[blocks, row bytes]`` byte rows on the CPU; ``pages``: the host pages
    ``[pages, row bytes]``, whose payload starts at ``payload_offset``.
    """

    def __init__(
        self,
        segments: Sequence[tuple[torch.Tensor, int, int, int]],
        pages: torch.Tensor,
        payload_offset: int,
        tuning: TransferTuning,
    ) -> None:
        merged: list[list] = []  # [tensor, src_offset, dst_offset, nbytes]
        for tensor, src, nbytes, dst_offset in segments:
            dst = payload_offset + dst_offset
            last = merged[-1] if merged else None
            if (
                last is not None
                and last[0] is tensor
                and last[1] + last[3] == src
                and last[2] + last[3] == dst
            ):  # contiguous with the one before on both sides: one segment
                last[3] += nbytes
            else:
                merged.append([tensor, src, dst, nbytes])
        host = pages.numpy()
        views = {id(t): t.detach().view(torch.uint8).numpy() for t, *_ in merged}
        # Each segment's column of every block row and of every host page (views).
        self._cols = [
            (views[id(t)][:, s0 : s0 + n], host[:, d0 : d0 + n]) for t, s0, d0, n in merged
        ]
        self._nbytes = [n for *_, n in merged]
        self._raw = [(t.data_ptr() + s0, t.stride(0), d0, n) for t, s0, d0, n in merged]
        self._host_addr = pages.data_ptr()
        self._row = pages.stride(0)
        self._page_bytes = sum(self._nbytes)
        self._tuning = tuning
        self.min_run = MIN_SOURCE_RUN  # the shortest run that moves by numpy assignment

    def copy(self, blocks: np.ndarray, pages: np.ndarray, to_host: bool) -> None:
        """Block ``blocks[i]`` ↔ page ``pages[i]`` for every segment; done on return."""
        src, dst = (blocks, pages) if to_host else (pages, blocks)
        runs, s_src, s_dst = source_runs(src, dst, self.min_run)
        singles = (s_src, s_dst) if to_host else (s_dst, s_src)  # (blocks, pages)
        blocks_l, pages_l = singles[0].tolist(), singles[1].tolist()
        threads = self._tuning.cpu_copy_threads or torch.get_num_threads()
        if src.size * self._page_bytes < self._tuning.cpu_parallel_min_bytes:
            threads = 1  # the pieces, in this thread
        drain_pieces(self._pieces(runs, blocks_l, pages_l, to_host), threads)

    def _pieces(self, runs: list, blocks: list[int], pages: list[int], to_host: bool) -> list:
        """The copy as calls of about :data:`PIECE_BYTES` each: a segment of part of a
        run, or a few items of the others."""
        pieces: list[tuple] = []
        for first, targets in runs:
            for seg, nbytes in enumerate(self._nbytes):
                step = max(1, PIECE_BYTES // nbytes)
                for j in range(0, targets.size, step):
                    pieces.append((self._run, seg, first + j, targets[j : j + step], to_host))
        step = max(1, PIECE_BYTES // max(self._page_bytes, 1))
        for j in range(0, len(blocks), step):
            pieces.append((self._move, blocks[j : j + step], pages[j : j + step], to_host))
        return pieces

    def _run(self, seg: int, first: int, targets: np.ndarray, to_host: bool) -> None:
        """Segment ``seg`` of the sources ``first ..`` ``first + len(targets) - 1`` (blocks
        for a store, pages for a load) into the rows ``targets`` of the other side."""
        dev, host = self._cols[seg]
        n = targets.size
        if to_host:
            host[targets] = dev[first : first + n]
        else:
            dev[targets] = host[first : first + n]

    def _move(self, blocks: list[int], pages: list[int], to_host: bool) -> None:
        """Each block ``blocks[i]`` ↔ page ``pages[i]``, one ``memmove`` per segment."""
        base, row = self._host_addr, self._row
        for b, p in zip(blocks, pages):
            host = base + p * row
            if to_host:
                for src, stride, dst, n in self._raw:
                    _memmove(host + dst, src + b * stride, n)
            else:
                for src, stride, dst, n in self._raw:
                    _memmove(src + b * stride, host + dst, n)
