"""Index arrays that a GPU kernel reads straight from pinned host memory.

A copy kernel needs its page and block indices where it can address them. Uploading a
numpy array with ``tensor.to(device)`` goes through pageable memory: the host waits for a
staging copy, and on the device the upload is a copy-engine transfer queued on the kernel's
stream before the kernel (for one page, most of the copy's device time besides the kernel,
``benchmarks/probe_launch.py``), behind whatever else is queued on the copy engines. A
pinned buffer is addressable by the kernel itself (as the host pool is), so the indices are
written there and the kernel loads them over the bus as it needs them: no upload, no
staging, nothing on the copy engines.

A buffer is written again only once the kernel that read it has ended: :class:`PairSlots`
keeps a few pinned buffers in turn, each with the event recorded after its last launch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch


class PairSlots:
    """Pinned buffers for a kernel that reads two index arrays (device items and host
    pages) on a raw stream handle, handed out in turn at a few microseconds of host time:
    ``with slots.pair(a, b, stream) as (pa, pb, tensors):`` writes ``a`` and ``b`` into
    the next pinned slot, each starting 16 bytes aligned (so a compiled kernel's alignment
    assumption always holds), and yields the addresses a kernel reads them at
    (``tensors()``: the two as pinned tensors, for a launch that takes tensors); on
    leaving, a raw event on ``stream`` marks when the slot may be written again.
    Thread-safe."""

    def __init__(self, count: int = 16) -> None:
        self._count = count
        self._bufs: list[torch.Tensor | None] = [None] * count
        self._views: list[np.ndarray | None] = [None] * count
        self._addrs = [0] * count
        self._events = None  # copy_engine.RawEvents, made with the first buffer
        self._recorded = [False] * count
        self._next = 0
        self._lock = threading.Lock()

    def _slot_buffer(self, slot: int, words: int) -> tuple[torch.Tensor, np.ndarray, int]:
        """Slot ``slot``'s buffer of at least ``words`` int64s: every slot's first one
        from one pinned allocation made at the first launch (an allocation of pinned
        memory costs far more than a launch), a larger one alone when a launch needs it."""
        from hicache.kernels.copy_engine import device_pointer

        if self._bufs[slot] is None:
            block = _pinned(self._count, 2048)
            base, addr = block.data_ptr(), device_pointer(block.data_ptr())
            for i, row in enumerate(block.unbind(0)):
                self._bufs[i], self._views[i] = row, row.numpy()
                self._addrs[i] = addr + (row.data_ptr() - base)
        buf = self._bufs[slot]
        assert buf is not None
        if buf.numel() < words:
            size = 1 << (words - 1).bit_length()
            buf = self._bufs[slot] = _pinned(size)
            self._views[slot] = buf.numpy()
            self._addrs[slot] = device_pointer(buf.data_ptr())
        view = self._views[slot]
        assert view is not None
        return buf, view, self._addrs[slot]

    @contextmanager
    def pair(
        self, a: np.ndarray, b: np.ndarray, stream: int
    ) -> Iterator[tuple[int, int, Callable[[], tuple[torch.Tensor, torch.Tensor]]]]:
        n = int(a.size)
        m = n + (n & 1)  # b starts 16 bytes after a's start times a whole number
        with self._lock:
            if self._events is None:
                from hicache.kernels.copy_engine import RawEvents

                self._events = RawEvents(self._count)
            slot = self._next
            self._next = (slot + 1) % self._count
            if self._recorded[slot]:
                self._events.synchronize(slot)  # the launch that read it last has ended
            buf, view, addr = self._slot_buffer(slot, 2 * m)
            view[:n] = a
            view[m : m + n] = b
            try:
                yield addr, addr + 8 * m, lambda: (buf[:n], buf[m : m + n])
            finally:  # after the launch: the slot is written again once it has run
                self._events.record(slot, stream)
                self._recorded[slot] = True


def _pinned(*shape: int) -> torch.Tensor:
    """A pinned int64 tensor (one allocation)."""
    return torch.empty(*shape, dtype=torch.int64, pin_memory=True)
