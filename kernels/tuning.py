"""Launch parameters of the transfer kernels, and which backend moves KV pages by default.

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
    """How the row-copy kernel is launched.

    ``tile_bytes`` is what one program moves per loop step (16 KiB keeps 16-byte accesses
    on every thread with 4 warps and plenty of bytes in flight over PCIe);
    ``programs_per_sm`` bounds the persistent grid so that a load and a backup launched on
    two streams are resident at the same time instead of queueing behind each other;
    ``interpreter_programs`` is the grid on CPU tensors, small so that the persistent loop
    runs several tiles per program under test too.
    """

    tile_bytes: int = 16384
    num_warps: int = 4
    programs_per_sm: int = 2
    scatter_block_bytes: int = 8192
    interpreter_programs: int = 3


DEFAULT_TUNING = TransferTuning()

# The backend each direction uses on CUDA tensors when the caller names none; the
# benchmark measures both candidates against pinned memcpy in the same run.
KV_TO_HOST_BACKEND = Backend.TRITON
KV_TO_DEVICE_BACKEND = Backend.TRITON
MAMBA_TO_HOST_BACKEND = Backend.TRITON
MAMBA_TO_DEVICE_BACKEND = Backend.TRITON
