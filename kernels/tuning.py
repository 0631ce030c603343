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
      (KV and Mamba transfers only, CUDA only);
    * ``STAGED``: KV pages only. A bounded ring of device staging chunks: the row-copy
      kernel gathers (or scatters) pages between the pool and a dense chunk at device
      speed, and the copy engines move each chunk across PCIe in large DMAs, one per run
      of consecutive host pages (:mod:`hicache.kernels.staged`). On CPU tensors it runs
      the same plan with host memcpys standing in for the DMAs (the test path);
    * ``CPU``: CPU tensors only, the default there. One ``memmove`` per run of rows that
      are contiguous on both sides, split across threads for large transfers
      (:mod:`hicache.kernels.cpu_rows`); at memory speed, where the reference's gather,
      permute and scatter ran at about a tenth of it.
    """

    TORCH = "torch"
    TRITON = "triton"
    COPY_ENGINE = "copy_engine"
    STAGED = "staged"
    CPU = "cpu"


@dataclass(frozen=True)
class TransferTuning:
    """How transfers are launched on a GPU, and which backend moves an item by default.

    ``tile_bytes`` is what one program moves per loop step (16 KiB keeps 16-byte accesses
    on every thread with 4 warps and plenty of bytes in flight over PCIe);
    ``programs_per_sm`` bounds the persistent grid so that a load and a backup launched on
    two streams are resident at the same time instead of queueing behind each other (at 8
    per SM they serialise); ``interpreter_programs`` is the grid on CPU tensors, small so
    that the persistent loop runs several tiles per program under test too.

    ``grid_limit`` (0: none) caps the persistent grid below ``programs_per_sm`` times the
    SMs: a copy that runs beside the engine's own kernels (a layer-wise load, while the
    suffix computes) holds only that many SMs, since a kernel's block that fills an SM's
    registers (a GEMM's) cannot share one with a copy's block, and a copy on every SM would
    run ahead of the compute instead of beside it. A few programs keep enough bytes in
    flight to reach PCIe speed (:data:`LAYER_COPY_TUNING`).

    ``copy_engine_min_item_bytes_*``: items (a KV page across all layers, one Mamba state
    tensor of a slot) at least this large go to the copy engines, smaller ones to Triton.
    Issuing one 2-D memcpy costs 3-7 microseconds of host time, so the copy engines only
    win on large items. On an H200 they were 3-6% ahead of Triton one way for 8 MiB KV
    pages and 7-8% for 75 MB SSM states, 95 against 77 GB/s with a load and a backup at
    once on 8 MiB pages, and behind for pages of 2 MiB and less (docs/performance.md).

    The staged KV path (``Backend.STAGED``): ``staging_chunk_bytes`` is one staging chunk
    (at least one page), ``staging_chunks`` the chunks in a ring, so a ring holds at most
    ``staging_chunks * max(staging_chunk_bytes, page bytes)`` of device memory; one ring
    exists per (device, caller stream) that ran a staged transfer, at most
    ``staging_max_rings`` of them (the least recently used is freed first).
    ``staged_batched_dma`` issues a chunk's DMAs with one ``cudaMemcpyBatchAsync`` where
    the CUDA runtime has it (12.8 and later), else one ``cudaMemcpyAsync`` per DMA. By
    default a KV transfer on CUDA whose pages are below the copy-engine threshold is
    staged when it moves at least ``staged_min_transfer_bytes`` and its host pages form
    runs of consecutive pages averaging at least ``staged_min_dma_bytes`` (each run is one
    DMA); the indices must be on the CPU and the host pages pinned. Each chunk costs
    host time to issue (a kernel launch, a batched copy, four event calls), which delays
    whatever the caller issues next; large chunks keep that small. On an H200 the staged
    path took a load and a backup at once from 77-79 to 90.7-94.5 GB/s; below 256 MiB its
    fixed host time cost more than that gained, and with DMAs of 384 KiB a backup alone
    fell to 87% of a memcpy (docs/performance.md).

    ``staged_segments_min_bytes`` (0: never): a segment copy on CUDA (an engine's own
    block tensors ↔ host pages, :mod:`hicache.kernels.staged_segments`) of at least this
    many bytes, whose pages' payloads are at least ``staged_min_dma_bytes``, goes through
    the same staging ring, its PCIe hop done by DMAs: a store and a load at once then share
    the copy engines' two directions instead of the SMs.

    ``cpu_copy_threads`` (0: torch's intra-op thread count) threads run one CPU transfer
    of at least ``cpu_parallel_min_bytes`` (``Backend.CPU``); below it one thread does,
    since handing work to a thread costs more than copying a few MiB.
    """

    tile_bytes: int = 16384
    num_warps: int = 4
    programs_per_sm: int = 2
    grid_limit: int = 0
    scatter_block_bytes: int = 8192
    interpreter_programs: int = 3
    copy_engine_min_item_bytes_to_host: int = 4 << 20
    copy_engine_min_item_bytes_to_device: int = 4 << 20
    staging_chunk_bytes: int = 64 << 20
    staging_chunks: int = 2
    staging_max_rings: int = 4
    staged_batched_dma: bool = True
    staged_min_transfer_bytes: int = 256 << 20
    staged_min_dma_bytes: int = 1 << 20
    staged_segments_min_bytes: int = 16 << 20
    cpu_copy_threads: int = 0
    cpu_parallel_min_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        counts = (
            "tile_bytes",
            "num_warps",
            "programs_per_sm",
            "scatter_block_bytes",
            "interpreter_programs",
            "staging_chunk_bytes",
            "staging_chunks",
            "staging_max_rings",
        )
        for name in counts:
            if getattr(self, name) < 1:
                raise ValueError(f"TransferTuning.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("grid_limit", "staged_segments_min_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"TransferTuning.{name} must be >= 0, got {getattr(self, name)}")

    def auto_backend(
        self, item_bytes: int, to_host: bool, *, transfer_bytes: int = 0, dma_bytes: int = 0
    ) -> Backend:
        """The backend a CUDA transfer of items of ``item_bytes`` uses by default.

        ``transfer_bytes`` is the whole transfer and ``dma_bytes`` the mean bytes per
        host-side DMA the staged path would issue (0 where it cannot run: Mamba states,
        host indices on the GPU, pageable host memory); both stay 0 for callers that do
        not consider the staged path.
        """
        if to_host:
            threshold = self.copy_engine_min_item_bytes_to_host
        else:
            threshold = self.copy_engine_min_item_bytes_to_device
        if item_bytes >= threshold:
            # Pages this large are one 2-D copy each with no gather: as fast as staging
            # them and less host work per byte (docs/performance.md).
            return Backend.COPY_ENGINE
        if (
            dma_bytes > 0
            and transfer_bytes >= self.staged_min_transfer_bytes
            and dma_bytes >= self.staged_min_dma_bytes
        ):
            return Backend.STAGED
        return Backend.TRITON


DEFAULT_TUNING = TransferTuning()
#: A layer-wise load's copies, which run while the engine computes: 16 programs on a GPU
#: (an eighth of an H100's SMs or fewer).
LAYER_COPY_TUNING = TransferTuning(grid_limit=16)


def parse_backend(backend: Backend | str | None) -> Backend | None:
    """``backend=`` of the transfer functions as a :class:`Backend` (None: choose)."""
    if backend is None:
        return None
    try:
        return Backend(backend)
    except ValueError:
        choices = ", ".join(b.value for b in Backend)
        raise ValueError(f"backend={backend!r} is not one of: {choices}") from None
