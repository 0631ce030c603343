"""Index arrays that a GPU kernel reads straight from pinned host memory.

A copy kernel needs its page and block indices where it can address them. Uploading a
numpy array with ``tensor.to(device)`` goes through pageable memory: the host waits for a
staging copy, and on the device the upload is a copy-engine transfer queued on the kernel's
stream before the kernel (for one page, most of the copy's device time besides the kernel,
``benchmarks/probe_launch.py``), behind whatever else is queued on the copy engines. A
pinned buffer is addressable by the kernel itself (as the host pool is), so the indices are
written there and the kernel loads them over the bus as it needs them: no upload, no
staging, nothing on the copy engines.

A buffer is written again only once the kernel that read it has ended: :class:`IndexSlots`
keeps a few pinned buffers in turn, each with the event recorded after its last launch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


class IndexSlots:
    """Pinned int64 buffers handed out in turn for GPU kernel launches.

    ``with slots.staged(idx, stream) as t:`` copies a ``[rows, n]`` int64 array into the
    next slot (after waiting for that slot's previous launch, ``count`` launches ago, which
    has almost always ended) and yields it as a pinned tensor for the kernel launched in
    the block; on leaving, an event on ``stream`` marks when the slot may be written again.
    Thread-safe: one launch stages at a time.
    """

    def __init__(self, count: int = 16) -> None:
        self._count = count
        self._bufs: list[torch.Tensor] = []  # pinned on the first launch, not before
        self._events: list[torch.cuda.Event | None] = [None] * count
        self._next = 0
        self._lock = threading.Lock()

    @contextmanager
    def staged(self, idx: np.ndarray, stream: torch.cuda.Stream) -> Iterator[torch.Tensor]:
        with self._lock:
            slot = self._next
            self._next = (slot + 1) % self._count
            ev = self._events[slot]
            if ev is not None:
                ev.synchronize()  # the launch that read this slot last has ended
            if not self._bufs:  # every slot's first buffer in one allocation
                block = torch.empty(self._count, 1024, dtype=torch.int64, pin_memory=True)
                self._bufs = list(block.unbind(0))
            buf = self._bufs[slot]
            if buf.numel() < idx.size:
                size = 1 << max(10, (idx.size - 1).bit_length())
                buf = self._bufs[slot] = torch.empty(size, dtype=torch.int64, pin_memory=True)
            out = buf[: idx.size].view(idx.shape)
            np.copyto(out.numpy(), idx, casting="same_kind")
            try:
                yield out
            finally:  # after the launch: the slot is written again once it has run
                if ev is None:
                    ev = self._events[slot] = torch.cuda.Event()
                ev.record(stream)
