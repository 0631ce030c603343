"""Staged KV page transfers: a device-side gather or scatter plus large copy-engine DMAs.

The Triton row copy reads and writes pinned host memory straight from the SMs, in small
PCIe transactions. One way that runs at 90-95% of a memcpy, but a load and a backup at
once level off near 78 GB/s where two memcpys reach about 100 (docs/performance.md). Here
the PCIe hop is left to the copy engines, in large DMAs, through a bounded ring of device
staging chunks:

* backup: the row-copy kernel gathers a chunk of pages from the pool into a staging chunk
  (dense and page-first, like the host pages), then the copy engines move the chunk to
  the host, one DMA per run of consecutive host pages;
* load: the copy engines move host pages into a staging chunk, one DMA per run, then the
  kernel scatters the chunk into the pool.

The kernel runs on the caller's stream and the DMAs on a helper stream of the ring, so the
gather (or scatter) of one chunk overlaps the DMA of another; events keep a chunk slot
from being reused before the work that reads it is done. A ring belongs to one caller
stream (a load and a backup on two streams must not share slots); rings are kept per
(device, stream) up to ``TransferTuning.staging_max_rings``, the least recently used
freed first. On CPU tensors the same plan runs with host memcpys standing in for the DMAs
and no events, which is how the tests check the addressing.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from hicache.kernels.geometry import RowCopy, RowSide
from hicache.kernels.tuning import DEFAULT_TUNING, TransferTuning

__all__ = [
    "DmaPlan",
    "StagingRing",
    "host_dma_count",
    "kv_staged",
    "mean_dma_bytes",
    "plan_dmas",
    "release_rings",
]


def host_dma_count(host_pages: np.ndarray, host_stride_bytes: int, page_bytes: int) -> int:
    """How many host-side DMAs the pages need: one per run of consecutive host pages when
    pages sit back to back in the host buffer, else one per page (chunk cuts aside)."""
    n = int(host_pages.size)
    if n == 0:
        return 0
    if host_stride_bytes != page_bytes:
        return n
    h = host_pages.astype(np.int64, copy=False)
    return 1 + int(np.count_nonzero(h[1:] != h[:-1] + 1))


def mean_dma_bytes(copy: RowCopy, host: RowSide, host_pages: np.ndarray) -> int:
    """Mean bytes per host-side DMA if these pages were staged; 0 where staging cannot
    run (no pages, pageable host memory)."""
    if host_pages.size == 0 or not host.tensor.is_pinned():
        return 0
    elem = host.tensor.element_size()
    count = host_dma_count(host_pages, host.item_stride * elem, copy.item_bytes)
    return int(host_pages.size) * copy.item_bytes // count


@dataclass(frozen=True)
class DmaPlan:
    """The host-side DMAs of a staged transfer, cut into chunks of ``chunk_pages`` pages.

    Chunk ``c`` covers pages ``page_bounds[c]:page_bounds[c+1]`` (positions in the index
    tensors) and DMAs ``dma_bounds[c]:dma_bounds[c+1]``; DMA ``i`` moves ``size[i]`` bytes
    between host address ``host_addr[i]`` and byte ``stage_offset[i]`` of the chunk's slot.
    """

    chunk_pages: int
    page_bytes: int
    page_bounds: np.ndarray
    dma_bounds: np.ndarray
    host_addr: np.ndarray
    stage_offset: np.ndarray
    size: np.ndarray

    @property
    def num_chunks(self) -> int:
        return int(self.page_bounds.size) - 1


def plan_dmas(
    host_pages: np.ndarray,
    host_base: int,
    host_stride_bytes: int,
    page_bytes: int,
    chunk_pages: int,
    small_end: bool | None = None,
) -> DmaPlan:
    """Cut a transfer of ``host_pages`` into chunks and DMAs.

    Host page ``p`` starts at ``host_base + p * host_stride_bytes``. Within a chunk, pages
    that are consecutive in the index and in the host buffer (stride equal to the page)
    merge into one DMA; a staging chunk holds its pages back to back in index order.

    Chunks hold ``chunk_pages`` pages each, but with ``small_end`` False the first chunk
    and with True the last one an eighth of that, where the transfer has more pages than
    that eighth: the step that runs alone (a store's first gather, before any DMA; a
    load's last scatter, after every DMA) is then an eighth as long.
    """
    if chunk_pages < 1 or page_bytes < 1:
        raise ValueError(f"chunk_pages={chunk_pages} and page_bytes={page_bytes} must be >= 1")
    h = host_pages.astype(np.int64, copy=False)
    n = int(h.size)
    small = max(1, chunk_pages // 8)
    if small_end is None or n <= small or small == chunk_pages:
        num_chunks = -(-n // chunk_pages)
        page_bounds = np.minimum(np.arange(num_chunks + 1, dtype=np.int64) * chunk_pages, n)
    elif small_end:  # the rest in whole chunks from the start, the last an eighth
        body = n - small
        page_bounds = np.append(np.arange(0, body, chunk_pages, dtype=np.int64), [body, n])
    else:
        page_bounds = np.append([0], np.arange(small, n, chunk_pages, dtype=np.int64))
        page_bounds = np.append(page_bounds, n)
    starts_mask = np.zeros(n, dtype=bool)
    starts_mask[page_bounds[:-1]] = True
    if host_stride_bytes == page_bytes:
        starts_mask[1:] |= h[1:] != h[:-1] + 1
    else:
        starts_mask[:] = True
    starts = np.flatnonzero(starts_mask)
    ends = np.append(starts[1:], n)
    dma_bounds = np.searchsorted(starts, page_bounds)
    # Each DMA's page position within its chunk: from the chunk's first page.
    chunk_first = page_bounds[np.searchsorted(page_bounds, starts, side="right") - 1]
    return DmaPlan(
        chunk_pages=chunk_pages,
        page_bytes=page_bytes,
        page_bounds=page_bounds,
        dma_bounds=dma_bounds,
        host_addr=(host_base + h[starts] * host_stride_bytes).astype(np.uint64),
        stage_offset=((starts - chunk_first) * page_bytes).astype(np.uint64),
        size=((ends - starts) * page_bytes).astype(np.uint64),
    )


class StagingRing:
    """``slots`` device staging chunks of ``slot_bytes`` each, with their events and the
    helper stream that runs the DMAs, for transfers issued on one caller stream.

    On CPU (the test path) the slots are host tensors and there are no events or stream.
    """

    def __init__(self, device: torch.device, slot_bytes: int, slots: int) -> None:
        self.device = device
        self.slot_bytes = slot_bytes
        self.buffers = [
            torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(slots)
        ]
        self.stage_items: torch.Tensor | None = None
        self.stream_handle = 0
        self.events = None
        if device.type == "cuda":
            from hicache.kernels.copy_engine import RawEvents, create_stream

            with torch.cuda.device(device):
                self.stream_handle = create_stream()
                # Event s: slot s holds a chunk for the next step ("ready"); event
                # slots + s: the step that read slot s is done ("free"); the last one is
                # recorded on the caller's stream after each transfer ("done").
                self.events = RawEvents(2 * slots + 1)

    @property
    def slots(self) -> int:
        return len(self.buffers)

    @property
    def done(self) -> int:
        return 2 * self.slots

    def items(self, count: int) -> torch.Tensor:
        """``arange(count)`` on the ring's device: the staging side's item indices."""
        if self.stage_items is None or self.stage_items.numel() < count:
            self.stage_items = torch.arange(count, dtype=torch.int64, device=self.device)
        return self.stage_items[:count]

    def release(self) -> None:
        """Wait until no queued work uses the ring, then free its stream and events (the
        buffers go back to torch's allocator with the object)."""
        if self.events is not None:
            from hicache.kernels.copy_engine import destroy_stream, synchronize_stream

            self.events.synchronize(self.done)
            synchronize_stream(self.stream_handle)
            self.events.destroy()
            destroy_stream(self.stream_handle)
            self.events = None


_RINGS: OrderedDict[tuple[str, int, int], StagingRing] = OrderedDict()
_RINGS_LOCK = threading.Lock()


def _ring_for(
    device: torch.device, stream_key: int, slot_bytes: int, tuning: TransferTuning
) -> StagingRing:
    """The ring of (device, caller stream), created or grown as needed; the least recently
    used rings beyond ``tuning.staging_max_rings`` are released."""
    key = (device.type, device.index or 0, stream_key)
    with _RINGS_LOCK:
        ring = _RINGS.pop(key, None)
        if ring is not None and (
            ring.slot_bytes < slot_bytes or ring.slots != tuning.staging_chunks
        ):
            ring.release()
            ring = None
        if ring is None:
            ring = StagingRing(device, slot_bytes, tuning.staging_chunks)
        _RINGS[key] = ring
        while len(_RINGS) > tuning.staging_max_rings:
            _, old = _RINGS.popitem(last=False)
            old.release()
        return ring


def release_rings() -> int:
    """Free every staging ring (after the work queued on it); returns how many there were."""
    with _RINGS_LOCK:
        count = len(_RINGS)
        while _RINGS:
            _, ring = _RINGS.popitem(last=False)
            ring.release()
        return count


def _staging_side(buffer: torch.Tensor, host: torch.Tensor, chunk_pages: int) -> RowSide:
    """A slot viewed as ``chunk_pages`` dense host-layout pages ``[2, layers, ps, H, D]``."""
    page_shape = tuple(host.shape[1:])
    page_bytes = host.element_size() * int(np.prod(page_shape))
    view = buffer[: chunk_pages * page_bytes].view(host.dtype).view(chunk_pages, *page_shape)
    return RowSide(view, view.stride(0), view.stride(1), view.stride(2), chunk_pages)


def _emulated_dmas(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
    """What the copy engines do, on CPU memory (the test path)."""
    for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
        ctypes.memmove(dst, src, size)


def kv_staged(
    copy: RowCopy,
    device_pages: torch.Tensor,
    host_pages: torch.Tensor,
    to_host: bool,
    tuning: TransferTuning = DEFAULT_TUNING,
) -> None:
    """Move the KV pages of ``copy`` (from :func:`~hicache.kernels.geometry.kv_row_copy`)
    through the staging ring: every row of device page ``device_pages[i]`` to or from host
    page ``host_pages[i]``.

    On CUDA the work is queued on the current stream (the DMAs on the ring's helper
    stream, which the current stream waits for) and the call returns without waiting. Host
    indices on a GPU are read back first (a stream sync) and checked; pass them on the
    CPU. Device indices on a GPU are not read back: a backup of a device page outside the
    pool leaves its host page with unspecified bytes (the Triton path leaves it
    untouched), so the default dispatch stages only transfers whose indices are on the
    CPU, where they were checked. The host pages must be pinned.
    """
    from hicache.kernels.triton_transfer import RowLauncher

    dev_side, host_side = (copy.src, copy.dst) if to_host else (copy.dst, copy.src)
    host, device_kv = host_side.tensor, dev_side.tensor
    device = device_kv.device
    n = int(host_pages.numel())
    if n == 0:
        return
    on_gpu = device.type == "cuda"
    if on_gpu and not host.is_pinned():
        raise ValueError(
            "host_kv is pageable host memory, which the staged path cannot DMA asynchronously; "
            "allocate it pinned (tensor.pin_memory() or cudaHostRegister) or pass "
            "backend='torch'"
        )
    elem = host.element_size()
    page_bytes = copy.item_bytes
    chunk_pages = max(1, tuning.staging_chunk_bytes // page_bytes)
    host_ids = host_pages.cpu().numpy()
    if host_ids.min() < 0 or host_ids.max() >= host_side.num_items:
        raise IndexError(
            f"host_pages holds an entry outside the {host_side.num_items} host pages; pass "
            f"ids handed out by the pool that owns the tensor"
        )
    plan = plan_dmas(
        host_ids,
        host.data_ptr(),
        host_side.item_stride * elem,
        page_bytes,
        chunk_pages,
    )
    if on_gpu:
        stream_key = torch.cuda.current_stream(device).cuda_stream
        ring = _ring_for(device, stream_key, chunk_pages * page_bytes, tuning)
    else:
        ring = StagingRing(device, chunk_pages * page_bytes, tuning.staging_chunks)
    slots = ring.slots
    bases = np.array([b.data_ptr() for b in ring.buffers], dtype=np.uint64)
    chunk_of_dma = np.repeat(np.arange(plan.num_chunks, dtype=np.int64), np.diff(plan.dma_bounds))
    stage_addr = np.ascontiguousarray(bases[chunk_of_dma % slots] + plan.stage_offset)
    host_addr = np.ascontiguousarray(plan.host_addr)
    sizes = np.ascontiguousarray(plan.size)
    dsts, srcs = (host_addr, stage_addr) if to_host else (stage_addr, host_addr)

    stage_sides = [_staging_side(b, host, chunk_pages) for b in ring.buffers]
    grid = (copy.rows_a, copy.rows_b, copy.row_elems)
    launchers = [
        RowLauncher(
            RowCopy(dev_side, side, *grid) if to_host else RowCopy(side, dev_side, *grid), tuning
        )
        for side in stage_sides
    ]
    dev_items = device_pages.to(device, non_blocking=True).contiguous()  # read packed
    stage_items = ring.items(chunk_pages)

    if not on_gpu:
        for c in range(plan.num_chunks):
            lo, hi = int(plan.page_bounds[c]), int(plan.page_bounds[c + 1])
            d_lo, d_hi = int(plan.dma_bounds[c]), int(plan.dma_bounds[c + 1])
            launcher = launchers[c % slots]
            if to_host:
                launcher.launch(dev_items[lo:hi], stage_items[: hi - lo])
                _emulated_dmas(dsts[d_lo:d_hi], srcs[d_lo:d_hi], sizes[d_lo:d_hi])
            else:
                _emulated_dmas(dsts[d_lo:d_hi], srcs[d_lo:d_hi], sizes[d_lo:d_hi])
                launcher.launch(stage_items[: hi - lo], dev_items[lo:hi])
        return

    from hicache.kernels.copy_engine import Copies1D

    dmas = Copies1D(dsts, srcs, sizes, ring.stream_handle, tuning.staged_batched_dma)
    with torch.cuda.device(device):
        caller = torch.cuda.current_stream(device).cuda_stream
        _issue_on_gpu(plan, ring, launchers, dev_items, stage_items, dmas, caller, to_host)


def _issue_on_gpu(
    plan: DmaPlan,
    ring: StagingRing,
    launchers: list,
    dev_items: torch.Tensor,
    stage_items: torch.Tensor,
    dmas,
    caller: int,
    to_host: bool,
) -> None:
    """Queue the chunks: kernels on the caller's stream, DMAs on the ring's stream."""
    slots, helper, events = ring.slots, ring.stream_handle, ring.events
    assert events is not None
    page_bounds, dma_bounds = plan.page_bounds.tolist(), plan.dma_bounds.tolist()
    if not to_host:
        # The DMAs read host pages and overwrite slots: both wait for what the caller's
        # stream has queued so far (earlier writers of those pages, earlier scatters).
        events.record(ring.done, caller)
        events.wait(helper, ring.done)
    for c in range(plan.num_chunks):
        lo, hi = page_bounds[c], page_bounds[c + 1]
        slot = c % slots
        if to_host:
            if c >= slots:
                events.wait(caller, slots + slot)  # the DMA out of this slot is done
            launchers[slot].launch(dev_items[lo:hi], stage_items[: hi - lo])
            events.record(slot, caller)
            events.wait(helper, slot)
            dmas.issue(dma_bounds[c], dma_bounds[c + 1])
            events.record(slots + slot, helper)
        else:
            if c >= slots:
                events.wait(helper, slots + slot)  # the scatter out of this slot is done
            dmas.issue(dma_bounds[c], dma_bounds[c + 1])
            events.record(slot, helper)
            events.wait(caller, slot)
            launchers[slot].launch(stage_items[: hi - lo], dev_items[lo:hi])
            events.record(slots + slot, caller)
    if to_host:
        # DMAs on the helper run in order: the last one done means all are.
        events.wait(caller, slots + (plan.num_chunks - 1) % slots)
    events.record(ring.done, caller)
