"""Row copies between CPU tensors at memory speed: one ``memmove`` per run of rows.

The torch reference gathers a transfer's rows into a temporary, permutes it and scatters
it with advanced indexing: three passes over the bytes plus an element-wise index
kernel, about a tenth of a plain memcpy (docs/performance.md). Here every row of a
:class:`~hicache.kernels.geometry.RowCopy` becomes one (destination address, source
address) pair, rows that are contiguous on both sides are merged into one run, and each
run is a single ``memmove``. ``ctypes.memmove`` releases the GIL, so a transfer of
``parallel_min_bytes`` or more is split across ``threads`` threads by bytes.

Callers check indices first (range, distinct destinations): this module trusts them, as
the GPU kernels do, and computes raw addresses from them.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from hicache.kernels.geometry import RowCopy, RowSide

_memmove = ctypes.memmove
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


def _row_addresses(side: RowSide, items: np.ndarray, rows_a: int, rows_b: int) -> np.ndarray:
    """Byte address of every row ``(item, a, b)``, flattened item-major."""
    es = side.tensor.element_size()
    a = np.arange(rows_a, dtype=np.int64)[None, :, None] * (side.a_stride * es)
    b = np.arange(rows_b, dtype=np.int64)[None, None, :] * (side.b_stride * es)
    base = side.tensor.data_ptr() + items.astype(np.int64)[:, None, None] * (side.item_stride * es)
    return (base + a + b).reshape(-1)


def row_runs(copy: RowCopy, src_items: np.ndarray, dst_items: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(dst, src, nbytes)`` of each run of rows contiguous on both sides."""
    src = _row_addresses(copy.src, src_items, copy.rows_a, copy.rows_b)
    dst = _row_addresses(copy.dst, dst_items, copy.rows_a, copy.rows_b)
    return merge_runs(dst, src, np.full(src.size, copy.row_bytes, dtype=np.int64))


def merge_runs(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, ...]:
    """Byte ranges ``(dst[i], src[i], nbytes[i])`` merged where one ends exactly where the
    next begins on both sides. Ranges are ordered by source address first, so pages that
    are neighbours on the source side (a request's consecutive pages) and land on
    neighbouring destinations merge, whatever order the caller listed them in."""
    if src.size == 0:
        return dst, src, nbytes
    order = np.argsort(src, kind="stable")
    src, dst, nbytes = src[order], dst[order], nbytes[order]
    ends = src[:-1] + nbytes[:-1]
    joins = (src[1:] == ends) & (dst[1:] == dst[:-1] + nbytes[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    run_bytes = np.add.reduceat(nbytes, starts)
    return dst[starts], src[starts], run_bytes


def _move(dst: list[int], src: list[int], nbytes: list[int]) -> None:
    for d, s, n in zip(dst, src, nbytes):
        _memmove(d, s, n)


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_threads
    with _pool_lock:
        if _pool is None or _pool_threads < threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="hicache-cpu-copy")
            _pool_threads = threads
        return _pool


def copy_rows_cpu(
    copy: RowCopy,
    src_items: np.ndarray | torch.Tensor,
    dst_items: np.ndarray | torch.Tensor,
    *,
    threads: int = 0,
    parallel_min_bytes: int = 8 << 20,
) -> int:
    """Copy source item ``src_items[i]`` to destination item ``dst_items[i]`` (every row
    of it); both tensors must be on the CPU. ``threads`` 0 means torch's intra-op thread
    count. Returns the bytes moved; the copy has finished on return."""
    for side in (copy.src, copy.dst):
        if side.tensor.device.type != "cpu":
            raise ValueError(f"copy_rows_cpu needs CPU tensors, got {side.tensor.device}")
    if isinstance(src_items, torch.Tensor):
        src_items = src_items.cpu().numpy()
    if isinstance(dst_items, torch.Tensor):
        dst_items = dst_items.cpu().numpy()
    dst, src, nbytes = row_runs(copy, np.asarray(src_items), np.asarray(dst_items))
    return move_runs(dst, src, nbytes, threads=threads, parallel_min_bytes=parallel_min_bytes)


def move_runs(
    dst: np.ndarray,
    src: np.ndarray,
    nbytes: np.ndarray,
    *,
    threads: int = 0,
    parallel_min_bytes: int = 8 << 20,
) -> int:
    """``memmove(dst[i], src[i], nbytes[i])`` for every i (raw addresses, trusted), split
    across ``threads`` threads (0: torch's count) when it moves ``parallel_min_bytes`` or
    more. Returns the bytes moved; done on return."""
    total = int(nbytes.sum())
    workers = threads or torch.get_num_threads()
    if workers <= 1 or total < parallel_min_bytes or nbytes.size < 2:
        _move(dst.tolist(), src.tolist(), nbytes.tolist())
        return total
    # Split the runs into contiguous slices of about equal bytes, one per worker.
    bounds = np.searchsorted(np.cumsum(nbytes), np.arange(1, workers) * (total / workers))
    edges = [0, *sorted(set(int(x) + 1 for x in bounds if 0 <= x < nbytes.size - 1)), nbytes.size]
    pool = _executor(workers)
    futures = [
        pool.submit(_move, dst[lo:hi].tolist(), src[lo:hi].tolist(), nbytes[lo:hi].tolist())
        for lo, hi in itertools.pairwise(edges)
        if hi > lo
    ]
    for f in futures:
        f.result()
    return total
