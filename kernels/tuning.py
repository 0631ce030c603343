"""Launch parameters of the transfer kernels, and which backend moves an item by default.

The defaults come from measurements on an H200 (docs/performance.md, "Transfer kernels");
change them only with a new measurement from ``benchmarks/gpu_kernels.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Backend(enum.Enum):
    """Which implementation runs a transfer.

    * ``TORCH``: the reference in :mod:`hicache.kernels.reference` (the CPU path);
    * ``TRITON``: one Triton launch; on a GPU it reads and writes pinned host memory
      directly through its device-mapped address, on CPU tensors it runs under Triton's
      interpreter (the test path);
    * ``COPY_ENGINE``: one ``cudaMemcpy2DAsync`` per page on the GPU's copy engines
      (KV and Mamba transfers only, CUDA only).
    """

    TORCH = "torch"
    TRITON = "triton"
    COPY_ENGINE = "copy_engine"


@dataclass(frozen=True)
class TransferTuning:
    """How transfers are launched on a GPU, and which backend moves an item by default.

    ``tile_bytes`` is what one program moves per loop step (16 KiB keeps 16-byte accesses
    on every thread with 4 warps and plenty of bytes in flight over PCIe);
    ``programs_per_sm`` bounds the persistent grid so that a load and a backup launched on
    two streams are resident at the same time instead of queueing behind each other (at 8
    per SM they serialise); ``interpreter_programs`` is the grid on CPU tensors, small so
    that the persistent loop runs several tiles per program under test too.

    ``copy_engine_min_item_bytes_*``: items (a KV page across all layers, one Mamba state
    tensor of a slot) at least this large go to the copy engines, smaller ones to Triton.
    Issuing one 2-D memcpy costs 3-7 microseconds of host time, so the copy engines only
    win on large items. On an H200 they were 3-6% ahead of Triton one way for 8 MiB KV
    pages and 7-8% for 75 MB SSM states, 95 against 77 GB/s with a load and a backup at
    once on 8 MiB pages, and behind for pages of 2 MiB and less (docs/performance.md).
    """

    tile_bytes: int = 16384
    num_warps: int = 4
    programs_per_sm: int = 2
    scatter_block_bytes: int = 8192
    interpreter_programs: int = 3
    copy_engine_min_item_bytes_to_host: int = 4 << 20
    copy_engine_min_item_bytes_to_device: int = 4 << 20

    def auto_backend(self, item_bytes: int, to_host: bool) -> Backend:
        """The backend a CUDA transfer of items of ``item_bytes`` uses by default."""
        if to_host:
            threshold = self.copy_engine_min_item_bytes_to_host
        else:
            threshold = self.copy_engine_min_item_bytes_to_device
        return Backend.COPY_ENGINE if item_bytes >= threshold else Backend.TRITON


DEFAULT_TUNING = TransferTuning()
