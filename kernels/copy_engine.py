"""Row copies on the GPU's copy engines: one ``cudaMemcpy2DAsync`` per item.

The alternative to the Triton kernel that the benchmark measures against it. An item's
rows are equally spaced on both sides (the layer stride on the device, the row size in a
page-first host page), so one 2-D copy moves a whole page across all layers. The CUDA
runtime is reached through ctypes on the ``libcudart`` that torch has already loaded, so
no extra Python package is needed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import numpy as np
import torch

from hicache.kernels.geometry import RowCopy, RowSide

_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from unified addresses


@functools.cache
def _cudart() -> ctypes.CDLL:
    torch.cuda.init()
    candidates: list[str] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            if "libcudart.so" in path and path not in candidates:
                candidates.append(path)
    found = ctypes.util.find_library("cudart")
    candidates += [c for c in ("libcudart.so.13", "libcudart.so.12", found) if c]
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        fn = lib.cudaMemcpy2DAsync
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
        fn.argtypes += [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        return lib
    raise RuntimeError(
        "the copy-engine backend needs the CUDA runtime (libcudart), which was not found; "
        "use backend='triton'"
    )


def _row_runs(side: RowSide, rows_a: int, rows_b: int) -> tuple[int, list[int]]:
    """The pitch (elements) between rows and the a-offsets of the 2-D copies per item.

    When ``a`` steps over all of ``b`` (``a_stride == rows_b * b_stride``), the item is one
    run of ``rows_a * rows_b`` equally spaced rows; otherwise one run per ``a``.
    """
    if rows_a == 1 or side.a_stride == rows_b * side.b_stride:
        return side.b_stride, [0]
    return side.b_stride, [a * side.a_stride for a in range(rows_a)]


def copy_rows_copy_engine(copy: RowCopy, src_items: torch.Tensor, dst_items: torch.Tensor) -> None:
    """Copy every row of items ``src_items[i] -> dst_items[i]`` with 2-D async memcpys.

    Issued on the current CUDA stream; returns without waiting. Indices on a GPU are read
    back first (a stream sync), so pass them on the CPU.
    """
    lib = _cudart()
    src_idx = src_items.cpu().numpy().astype(np.int64)
    dst_idx = dst_items.cpu().numpy().astype(np.int64)
    for name, idx, side in (("source", src_idx, copy.src), ("destination", dst_idx, copy.dst)):
        if idx.size and (idx.min() < 0 or idx.max() >= side.num_items):
            raise IndexError(f"a {name} index is outside its {side.num_items} items")
    elem = copy.src.tensor.element_size()
    src_pitch, src_runs = _row_runs(copy.src, copy.rows_a, copy.rows_b)
    dst_pitch, dst_runs = _row_runs(copy.dst, copy.rows_a, copy.rows_b)
    if len(src_runs) != len(dst_runs):
        # Both sides must be cut the same way; fall back to one run per ``a`` on both.
        src_runs = [a * copy.src.a_stride for a in range(copy.rows_a)]
        dst_runs = [a * copy.dst.a_stride for a in range(copy.rows_a)]
    height = copy.rows_a * copy.rows_b // len(src_runs)
    width = copy.row_bytes
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    src_base = (copy.src.tensor.data_ptr() + src_idx * (copy.src.item_stride * elem)).tolist()
    dst_base = (copy.dst.tensor.data_ptr() + dst_idx * (copy.dst.item_stride * elem)).tolist()
    memcpy2d = lib.cudaMemcpy2DAsync
    for src_off, dst_off in zip(src_runs, dst_runs):
        src_off_b, dst_off_b = src_off * elem, dst_off * elem
        for s, d in zip(src_base, dst_base):
            err = memcpy2d(
                d + dst_off_b,
                dst_pitch * elem,
                s + src_off_b,
                src_pitch * elem,
                width,
                height,
                _CUDA_MEMCPY_DEFAULT,
                stream,
            )
            if err:
                raise RuntimeError(
                    f"cudaMemcpy2DAsync failed: {lib.cudaGetErrorString(err).decode()}"
                )
