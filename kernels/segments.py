"""Copies between an engine's own block tensors and host pages, in one pass.

An engine that keeps its KV cache in tensors of its own (vLLM: one tensor of byte rows
per layer, a row per block) stores a block as one host page that holds every layer's
part of it, and loads it back the same way. A :class:`SegmentCopy` describes that
mapping once: *segments*, each a run of ``nbytes`` bytes of a block row of one tensor
(at ``src_offset`` in the row) that lands at ``dst_offset`` in the page's payload. A
copy then moves ``blocks[i] <-> pages[i]`` for every segment:

* on a GPU, one launch of a Triton kernel that reads the engine's tensors and writes the
  host pages through their device-mapped address (or the reverse): no staging buffer; or,
  for copies of ``TransferTuning.staged_segments_min_bytes`` and more, the kernel into a
  device staging ring and copy-engine DMAs over PCIe (:mod:`.staged_segments`);
* on a CPU, one numpy assignment per segment for each run of items whose sources
  (blocks for a store, pages for a load) are consecutive, else a ``memmove`` per segment
  and item, split across threads for large copies (:mod:`.segments_cpu`);
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

from hicache.kernels.copy_engine import CopyDone, device_pointer
from hicache.kernels.host_indices import PairSlots
from hicache.kernels.launch import (
    compiled_runner,
    kernel_for,
    max_programs,
    next_pow2,
    require_device_mapped,
)
from hicache.kernels.segments_cpu import CpuSegments
from hicache.kernels.staged_segments import StagedSegments
from hicache.kernels.tuning import DEFAULT_TUNING, TransferTuning


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
        self._cpu: CpuSegments | None = None  # the CPU copy's views, when first wanted
        self._slots = PairSlots()  # pinned index buffers for the kernel's launches
        self._handles: dict[bool, int] = {}  # each direction's raw stream handle
        self._order = None  # RawEvents: a copy after its caller's stream (_stream_handle)
        self._compiled: dict[bool, object] = {}  # each direction's compiled launch, or None
        self._staged = None  # the staged form (kernels/staged_segments.py), when first wanted
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
        # 16-byte accesses where every offset, stride and length allows them (the kernel is
        # told so; its pointers' own alignment is Triton's specialisation).
        relative = [*(a - first.data_ptr() for a in addrs), *strides, *dsts, pages.shape[1]]
        vec = 16 // size if all(v % 16 == 0 for v in [*relative, *(s.nbytes for s in segs)]) else 1
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
        host_addr = host_words.data_ptr()
        if pages.device.type == "cpu" and self.device.type == "cuda":
            host_addr = device_pointer(host_addr)  # where the kernel addresses the pages
        self._programs = max_programs(self.device, self._tuning)
        return {
            "dev": dev_words,
            "host": host_words,
            "table": on,
            "dev_addr": dev_words.data_ptr(),
            "host_addr": host_addr,
            "table_addrs": tuple(on[i].data_ptr() for i in range(4)),
            "page_stride": pages.shape[1] // size,
            "cols": cols,
            "col_tiles": math.ceil(longest / cols),
            "rows": max(1, tile // cols),
            "vec": vec,
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

    def warm(self) -> None:
        """Compile (or load) every kernel variant a copy may launch, both ways, moving
        nothing (each launch's only block is -1, which the kernel skips), on the streams
        the copies run on: the direct kernel, and the staged form's, whose staging ring is
        allocated here where it would be used. A CUDA copy's first transfer then costs what
        later ones do; elsewhere nothing to do."""
        if self._gpu is None or self.device.type != "cuda":
            return
        staged = self.staged()
        for to_host in (True, False):
            stream = self._stream(to_host)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                # The launch that captures each direction's compiled variant (its index
                # rows start 16-byte aligned whatever their length: PairSlots, so one
                # variant serves every later call), and the staged form's kernels.
                skip = np.full(1, -1, dtype=np.int64)
                self._launch(skip, skip, to_host)
                if staged.could_stage(to_host):
                    staged.warm(to_host, skip)
            stream.synchronize()

    def _stream(self, to_host: bool) -> torch.cuda.Stream:
        stream = self._streams.get(to_host)
        if stream is None:
            stream = self._streams[to_host] = torch.cuda.Stream(self.device)
        return stream

    def start(self, blocks: Sequence[int], pages: Sequence[int], to_host: bool) -> CopyDone | None:
        """Begin the copy of ``blocks[i] <-> pages[i]``: on a GPU, the event recorded after
        it (:class:`~hicache.kernels.copy_engine.CopyDone`, which has the methods of
        ``torch.cuda.Event`` a caller uses: wait on it before the bytes are used);
        elsewhere the copy is done on return (None)."""
        blocks_a = np.asarray(blocks, dtype=np.int64)
        pages_a = np.asarray(pages, dtype=np.int64)
        self._check(blocks_a, pages_a)
        if not blocks_a.size:
            return None
        if self._gpu is None:
            if self._cpu is None:
                segs = [(s.tensor, s.src_offset, s.nbytes, s.dst_offset) for s in self.segments]
                self._cpu = CpuSegments(segs, self.pages, self.payload_offset, self._tuning)
            self._cpu.copy(blocks_a, pages_a, to_host)
            return None
        if self.device.type != "cuda":  # the kernel interpreted on CPU tensors (tests)
            self._launch(blocks_a, pages_a, to_host)
            return None
        # Each direction on a stream of its own, so that a store and a load overlap;
        # after what the calling thread's stream has queued (the engine's writes). Raw
        # handles and events throughout: torch's stream context, stream waits and events
        # cost several times their host time (benchmarks/probe_staged.py), and a copy's
        # host time before its first launch is time the copy has not started.
        stream = self._stream_handle(to_host)
        caller = torch.cuda.current_stream(self.device).cuda_stream
        self._order.order(int(to_host), stream, caller)
        staged = self.staged()
        if staged.wanted(blocks_a.size, to_host):
            staged.run(blocks_a, pages_a, to_host, stream)
        else:
            self._launch(blocks_a, pages_a, to_host, stream)
        return CopyDone(stream)

    def _stream_handle(self, to_host: bool) -> int:
        """The raw handle of this direction's stream (made on first use), and the events
        that order it after a caller's stream."""
        handle = self._handles.get(to_host)
        if handle is None:
            from hicache.kernels.copy_engine import RawEvents

            if self._order is None:
                self._order = RawEvents(2)
            handle = self._handles[to_host] = self._stream(to_host).cuda_stream
        return handle

    def staged(self) -> StagedSegments:
        """This copy through a device staging ring and copy-engine DMAs (used on a GPU for
        copies of ``TransferTuning.staged_segments_min_bytes`` and more)."""
        if self._staged is None:
            self._staged = StagedSegments(self)
        return self._staged

    def _launch(
        self, blocks: np.ndarray, pages: np.ndarray, to_host: bool, stream: int | None = None
    ) -> None:
        """The kernel over ``blocks[i] <-> pages[i]``, on the raw ``stream`` (default: the
        current one); on CPU tensors, interpreted."""
        if self.device.type != "cuda":
            self._launch_on(torch.from_numpy(np.stack([blocks, pages])), to_host)
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.device).cuda_stream
        # Read by the kernel from pinned memory: no upload queued on the copy engines.
        with self._slots.pair(blocks, pages, stream) as (b_addr, p_addr, tensors):
            n_rows, num_tiles, grid = self._grid(blocks.size)
            compiled = self._compiled.get(to_host)
            if compiled:
                try:
                    # The variant chosen at the first launch, with raw addresses: the
                    # same arguments but the indices' (16-byte aligned, as then), and no
                    # per-call binding (launch.compiled_runner).
                    compiled(grid, stream, self._args(b_addr, p_addr, n_rows, num_tiles, to_host))
                    return
                except (TypeError, ValueError, SystemError):  # a launcher of other arguments
                    self._compiled[to_host] = None
            with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=self.device)):
                ran = self._launch_on(tensors(), to_host)
            if to_host not in self._compiled:
                self._compiled[to_host] = compiled_runner(ran)

    def _grid(self, items: int) -> tuple[int, int, int]:
        """A launch over ``items`` blocks: its rows (a segment of an item each), its tiles,
        and its persistent grid."""
        n_rows = items * len(self.segments)
        num_tiles = math.ceil(n_rows / self._gpu["rows"]) * self._gpu["col_tiles"]
        return n_rows, num_tiles, min(num_tiles, self._programs)

    def _args(self, b_addr: int, p_addr: int, n_rows: int, num_tiles: int, to_host: bool) -> tuple:
        """The kernel's arguments in order, every pointer as an address."""
        g = self._gpu
        return (
            g["dev_addr"], g["host_addr"], b_addr, p_addr, *g["table_addrs"], n_rows,
            len(self.segments), g["page_stride"], self.blocks, self.pages.shape[0], num_tiles,
            g["col_tiles"], to_host, g["rows"], g["cols"], g["vec"],
        )  # fmt: skip

    def _launch_on(self, idx, to_host: bool):
        """The kernel over ``idx`` (blocks, pages: a ``[2, items]`` tensor or a pair) where
        it can read them (on the device, or pinned), through Triton's launch; what that
        returns (the compiled variant on a GPU)."""
        g = self._gpu
        n_rows, num_tiles, grid = self._grid(idx[0].shape[0])
        table = g["table"]
        from hicache.kernels.triton_segments import copy_segments_kernel

        return kernel_for(copy_segments_kernel, self.device)[(grid,)](
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
            VEC=g["vec"],
            num_warps=self._tuning.num_warps,
        )

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
