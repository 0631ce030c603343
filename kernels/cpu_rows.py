"""Row copies between CPU tensors at memory speed.

The torch reference gathers a transfer's rows into a temporary, permutes it and scatters
it with advanced indexing: three passes over the bytes plus an element-wise index
kernel, about a tenth of a plain memcpy (docs/performance.md). Here each item of a
:class:`~hicache.kernels.geometry.RowCopy` moves directly from its source to its
destination, in one of three ways:

* an item that is one dense block on both sides (its rows back to back) joins its
  neighbours into runs contiguous on both sides, and each run is a single ``memmove``
  (``ctypes.memmove`` releases the GIL, so a transfer of ``parallel_min_bytes`` or more is
  split across ``threads`` threads by bytes);
* any other item (a KV page is one row per layer and K/V, far apart in the engine's
  pool) is one strided copy between two views of it, a numpy assignment (which releases
  the GIL and starts no threads of its own), split by items across ``threads`` threads.
  One call per item instead of a ``memmove`` per row: on the 2-core development box,
  64 MiB of KV pages between scattered pages moved at 0.62–0.66 of a memcpy with rows of
  16, 32 and 128 KiB, against 0.32–0.39, 0.47–0.50 and 0.59–0.62 by a ``memmove`` a row
  (``benchmarks/bench_cpu_copy.py``);
* but items of that second kind whose **sources are consecutive** (sorted by source, in
  runs of :data:`MIN_SOURCE_RUN` or more: a store of device pages in a row, a load of
  host pages in a row) move as one numpy assignment per run, ``dst[targets] =
  src[first : first + n]`` over byte views of the items: the source read front to back,
  the destinations by index, whatever their order, in C with the GIL released. On the
  2-core development box, 64 MiB of 512 KiB KV pages moved so at 0.66–0.83 of a memcpy
  (three runs of ``benchmarks/bench_cpu_copy.py``; docs/performance.md has more).

Callers check indices first (range, distinct destinations): this module trusts them, as
the GPU kernels do, and computes raw addresses and views from them.
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
# Items whose sources are consecutive, this many or more, move as one numpy assignment
# (the source one strided view read front to back, the destinations by index; the GIL
# released for all of it) instead of a copy per item or a memmove per row.
MIN_SOURCE_RUN = 4
# A run split across threads is cut into pieces of about this many bytes, which the
# threads take one at a time (small enough that one descheduled thread holds up little,
# large enough that a piece's Python costs under 2 % of its copy).
PIECE_BYTES = 2 << 20
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


def copy_pool(threads: int) -> ThreadPoolExecutor:
    """The shared pool of (at least ``threads``) CPU copy threads."""
    global _pool, _pool_threads
    with _pool_lock:
        if _pool is None or _pool_threads < threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            # No torch op runs on these threads (numpy and memmove only), and none of
            # them sets torch's thread count: torch.set_num_threads is process-wide for
            # every thread that starts its first parallel op later (an engine's too).
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
    src_items, dst_items = np.asarray(src_items), np.asarray(dst_items)
    dense = _dense_items(copy.src, copy) and _dense_items(copy.dst, copy)
    if dense:  # dense items merge into memmove runs, which moves consecutive ones as well
        dst, src, nbytes = row_runs(copy, src_items, dst_items)
        return move_runs(dst, src, nbytes, threads=threads, parallel_min_bytes=parallel_min_bytes)
    runs, src_items, dst_items = source_runs(src_items, dst_items, MIN_SOURCE_RUN)
    moved = _copy_source_runs(copy, runs, threads, parallel_min_bytes) if runs else 0
    if not src_items.size:
        return moved
    return moved + copy_items_strided(
        copy, src_items, dst_items, threads=threads, parallel_min_bytes=parallel_min_bytes
    )


def source_runs(
    src: np.ndarray, dst: np.ndarray, min_run: int
) -> tuple[list[tuple[int, np.ndarray]], np.ndarray, np.ndarray]:
    """The items sorted by source, cut where sources stop being consecutive: each run of
    ``min_run`` or more as ``(first source, its items' destinations)``, and the sources
    and destinations of the items in no such run (in source order)."""
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    breaks = np.flatnonzero(np.diff(src) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [src.size]))
    long = (ends - starts) >= min_run
    runs = [(int(src[a]), dst[a:b]) for a, b in zip(starts[long], ends[long])]
    inside = np.zeros(src.size + 1, dtype=np.int64)  # +1 where a run starts, -1 after it
    inside[starts[long]] += 1
    inside[ends[long]] -= 1
    rest = np.cumsum(inside[:-1]) == 0
    return runs, src[rest], dst[rest]


def drain_pieces(pieces: list[tuple], threads: int) -> None:
    """Run each ``(fn, *args)`` of ``pieces``: on ``threads`` threads, the calling one
    among them, each taking the next piece from one queue (a thread the OS deschedules
    holds up only the piece it has, where an even share per thread would make the whole
    wait for the slowest share)."""
    work = iter(pieces)

    def drain() -> None:
        for fn, *args in work:
            fn(*args)

    if threads < 2 or len(pieces) < 2:
        drain()
        return
    pool = copy_pool(threads - 1)
    futures = [pool.submit(drain) for _ in range(threads - 1)]
    try:
        drain()
    finally:
        for f in futures:
            f.result()


def _byte_items(side: RowSide, copy: RowCopy) -> np.ndarray:
    """``side``'s items as a numpy view of bytes ``[items, rows_a, rows_b, row bytes]``."""
    es = side.tensor.element_size()
    strides = (side.item_stride * es, side.a_stride * es, side.b_stride * es, 1)
    shape = (side.num_items, copy.rows_a, copy.rows_b, copy.row_bytes)
    extent = sum((n - 1) * st for n, st in zip(shape, strides)) + 1
    flat = np.frombuffer((ctypes.c_uint8 * extent).from_address(side.tensor.data_ptr()), np.uint8)
    return np.lib.stride_tricks.as_strided(flat, shape, strides, writeable=True)


def _copy_source_runs(
    copy: RowCopy, runs: list[tuple[int, np.ndarray]], threads: int, parallel_min_bytes: int
) -> int:
    """Each run of consecutive source items into its destinations, one numpy assignment
    per run (or per piece of about :data:`PIECE_BYTES` of it, split across threads):
    the source read front to back as one strided view, the destinations by index, in C
    with the GIL released."""
    src, dst = _byte_items(copy.src, copy), _byte_items(copy.dst, copy)

    def move(first: int, targets: np.ndarray) -> None:
        dst[targets] = src[first : first + targets.size]

    total = sum(t.size for _, t in runs) * copy.item_bytes
    workers = 1 if total < parallel_min_bytes else threads or torch.get_num_threads()
    step = max(1, PIECE_BYTES // max(copy.item_bytes, 1))
    pieces = [
        (move, first + j, targets[j : j + step])
        for first, targets in runs
        for j in range(0, targets.size, step)
    ]
    drain_pieces(pieces, workers)
    return total


def _dense_items(side: RowSide, copy: RowCopy) -> bool:
    """True when every item of ``side`` is its rows back to back, A-major."""
    b_ok = copy.rows_b == 1 or side.b_stride == copy.row_elems
    a_ok = copy.rows_a == 1 or side.a_stride == copy.rows_b * copy.row_elems
    return a_ok and b_ok


def copy_items_strided(
    copy: RowCopy,
    src_items: np.ndarray,
    dst_items: np.ndarray,
    *,
    threads: int = 0,
    parallel_min_bytes: int = 8 << 20,
) -> int:
    """One strided copy per item, from a view of source item ``src_items[i]`` to a
    view of destination item ``dst_items[i]``, the items split across ``threads`` threads
    (0: torch's count) when they hold ``parallel_min_bytes`` or more. Returns the bytes
    moved; done on return."""
    total = len(src_items) * copy.item_bytes
    src_list, dst_list = src_items.tolist(), dst_items.tolist()
    workers = min(threads or torch.get_num_threads(), len(src_list))
    if workers <= 1 or total < parallel_min_bytes:
        _copy_items(copy, src_list, dst_list)
        return total
    bounds = np.linspace(0, len(src_list), workers + 1).astype(int).tolist()
    pool = copy_pool(workers)
    futures = [
        pool.submit(_copy_items, copy, src_list[lo:hi], dst_list[lo:hi])
        for lo, hi in itertools.pairwise(bounds)
        if hi > lo
    ]
    for f in futures:
        f.result()
    return total


def _copy_items(copy: RowCopy, src_items: list[int], dst_items: list[int]) -> None:
    """Each item by one numpy assignment between byte views of it (numpy releases the
    GIL for it and starts no threads of its own: on the 2-core development box 2 and
    4 KiB rows moved at 4.4 / 5.3 GB/s this way against 3.2 / 4.2 by ``Tensor.copy_``)."""
    src, dst = _byte_items(copy.src, copy), _byte_items(copy.dst, copy)
    for s_item, d_item in zip(src_items, dst_items):
        dst[d_item] = src[s_item]


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
    pool = copy_pool(workers)
    futures = [
        pool.submit(_move, dst[lo:hi].tolist(), src[lo:hi].tolist(), nbytes[lo:hi].tolist())
        for lo, hi in itertools.pairwise(edges)
        if hi > lo
    ]
    for f in futures:
        f.result()
    return total
