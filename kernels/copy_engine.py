"""Row copies on the GPU's copy engines: one ``cudaMemcpy2DAsync`` per item.

The alternative to the Triton kernel that the benchmark measures against it. An item's
rows are equally spaced on both sides (the layer stride on the device, the row size in a
page-first host page), so one 2-D copy moves a whole page across all layers. The CUDA
runtime is reached through ctypes on the ``libcudart`` that torch has already loaded, so
no extra Python package is needed. The staged path (:mod:`hicache.kernels.staged`) uses
the 1-D copies, the batched copy and the stream calls defined here too.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import threading

import numpy as np
import torch

from hicache.kernels.geometry import RowCopy, RowSide

_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from unified addresses
_CUDA_STREAM_NON_BLOCKING = 1  # no implicit sync with the legacy default stream
_CUDA_ERROR_NOT_READY = 600  # cudaErrorNotReady: an event or stream still has work
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: read sources in stream order


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
        fn = lib.cudaMemcpyAsync
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.argtypes += [ctypes.c_void_p]
        lib.cudaStreamCreateWithFlags.restype = ctypes.c_int
        lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cudaStreamDestroy.restype = ctypes.c_int
        lib.cudaStreamDestroy.argtypes = [ctypes.c_void_p]
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaRuntimeGetVersion.restype = ctypes.c_int
        lib.cudaRuntimeGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        vp = ctypes.c_void_p
        for name, args in (
            ("cudaEventCreateWithFlags", [ctypes.POINTER(vp), ctypes.c_uint]),
            ("cudaEventDestroy", [vp]),
            ("cudaEventRecord", [vp, vp]),
            ("cudaEventSynchronize", [vp]),
            ("cudaStreamWaitEvent", [vp, vp, ctypes.c_uint]),
            ("cudaStreamSynchronize", [vp]),
            ("cudaEventQuery", [vp]),
            ("cudaHostGetDevicePointer", [ctypes.POINTER(vp), vp, ctypes.c_uint]),
        ):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = args
        return lib
    raise RuntimeError(
        "the copy-engine backend needs the CUDA runtime (libcudart), which was not found; "
        "use backend='triton'"
    )


def _runs(copy: RowCopy) -> tuple[int, list[tuple[int, int]]]:
    """Rows per 2-D copy, and the (source, destination) element offsets of each copy
    within an item.

    When ``a`` steps over all of ``b`` on both sides (``a_stride == rows_b * b_stride``,
    true for a dense pool and a page-first host page), an item is one copy of
    ``rows_a * rows_b`` equally spaced rows; otherwise one copy per ``a``.
    """
    src, dst, rows_b = copy.src, copy.dst, copy.rows_b
    if copy.rows_a == 1 or (
        src.a_stride == rows_b * src.b_stride and dst.a_stride == rows_b * dst.b_stride
    ):
        return copy.rows_a * rows_b, [(0, 0)]
    return rows_b, [(a * src.a_stride, a * dst.a_stride) for a in range(copy.rows_a)]


def _check_items(copy: RowCopy, src_items: np.ndarray, dst_items: np.ndarray) -> None:
    """Raise IndexError for an item outside its tensor (a DMA has no mask to skip it)."""
    for name, idx, side in (("source", src_items, copy.src), ("destination", dst_items, copy.dst)):
        if idx.size and (idx.min() < 0 or idx.max() >= side.num_items):
            raise IndexError(f"a {name} index is outside its {side.num_items} items")


def plan_2d_copies(
    copy: RowCopy, src_items: np.ndarray, dst_items: np.ndarray
) -> list[tuple[int, int, int, int, int, int]]:
    """The 2-D copies that move every row of items ``src_items[i] -> dst_items[i]``, as
    ``(dst_addr, dst_pitch, src_addr, src_pitch, width, height)`` in bytes.

    Raises IndexError for an item outside its tensor (a DMA has no mask to skip it).
    """
    _check_items(copy, src_items, dst_items)
    elem = copy.src.tensor.element_size()
    height, runs = _runs(copy)
    src_pitch, dst_pitch = copy.src.b_stride * elem, copy.dst.b_stride * elem
    src_base = copy.src.tensor.data_ptr() + src_items.astype(np.int64) * (
        copy.src.item_stride * elem
    )
    dst_base = copy.dst.tensor.data_ptr() + dst_items.astype(np.int64) * (
        copy.dst.item_stride * elem
    )
    return [
        (d + dst_off * elem, dst_pitch, s + src_off * elem, src_pitch, copy.row_bytes, height)
        for src_off, dst_off in runs
        for s, d in zip(src_base.tolist(), dst_base.tolist())
    ]


def plan_row_dmas(
    copy: RowCopy, src_items: np.ndarray, dst_items: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One 1-D copy per row of items ``src_items[i] -> dst_items[i]``, as (destination
    addresses, source addresses, sizes in bytes), uint64, item by item and row ``(a, b)``
    by row within an item: what a batched copy (``Copies1D``) takes, with no 2-D copy
    per item to issue. Raises IndexError for an item outside its tensor."""
    _check_items(copy, src_items, dst_items)
    elem = copy.src.tensor.element_size()
    a, b = np.arange(copy.rows_a, dtype=np.int64), np.arange(copy.rows_b, dtype=np.int64)

    def addresses(side: RowSide, items: np.ndarray) -> np.ndarray:
        rows = (a[:, None] * side.a_stride + b[None, :] * side.b_stride).ravel()
        offsets = items.astype(np.int64)[:, None] * side.item_stride + rows[None, :]
        return (side.tensor.data_ptr() + offsets.ravel() * elem).astype(np.uint64)

    dsts, srcs = addresses(copy.dst, dst_items), addresses(copy.src, src_items)
    return dsts, srcs, np.full(dsts.size, copy.row_bytes, dtype=np.uint64)


def run_count(src_items: np.ndarray, dst_items: np.ndarray) -> int:
    """How many runs of items consecutive on both sides ``src_items -> dst_items`` holds."""
    if src_items.size == 0:
        return 0
    breaks = (np.diff(src_items) != 1) | (np.diff(dst_items) != 1)
    return 1 + int(np.count_nonzero(breaks))


def plan_run_copies(
    copy: RowCopy, src_items: np.ndarray, dst_items: np.ndarray
) -> list[tuple[int, int, int, int, int, int]] | None:
    """The 2-D copies that move every row of items ``src_items[i] -> dst_items[i]`` with
    one copy per row ``(a, b)`` of each run of items consecutive on both sides (its rows
    one item stride apart on each side), as :func:`plan_2d_copies` gives them. A few
    large DMAs where the items run (a request's pages in a pool that hands them out in
    order); None when an item's row is wider than its stride (no such copy exists).
    Raises IndexError for an item outside its tensor."""
    _check_items(copy, src_items, dst_items)
    elem = copy.src.tensor.element_size()
    src, dst = copy.src, copy.dst
    if copy.row_bytes > min(src.item_stride, dst.item_stride) * elem:
        return None
    s, d = src_items.astype(np.int64), dst_items.astype(np.int64)
    if s.size == 0:
        return []
    cut = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], cut)).tolist()
    heights = np.diff(np.concatenate(([0], cut, [s.size]))).tolist()
    firsts = list(zip(s[starts].tolist(), d[starts].tolist(), heights))
    src_ptr, dst_ptr = src.tensor.data_ptr(), dst.tensor.data_ptr()
    out = []
    for a in range(copy.rows_a):
        for b in range(copy.rows_b):
            so, do = a * src.a_stride + b * src.b_stride, a * dst.a_stride + b * dst.b_stride
            out += [
                (
                    dst_ptr + (di * dst.item_stride + do) * elem,
                    dst.item_stride * elem,
                    src_ptr + (si * src.item_stride + so) * elem,
                    src.item_stride * elem,
                    copy.row_bytes,
                    h,
                )
                for si, di, h in firsts
            ]
    return out


def issue_2d_copies(plan: list[tuple[int, int, int, int, int, int]], stream: int) -> None:
    """Queue ``plan``'s 2-D copies (:func:`plan_2d_copies`) on the raw CUDA ``stream``."""
    lib = _cudart()
    memcpy2d = lib.cudaMemcpy2DAsync
    handle = ctypes.c_void_p(stream)
    for dst, dst_pitch, src, src_pitch, width, height in plan:
        err = memcpy2d(dst, dst_pitch, src, src_pitch, width, height, _CUDA_MEMCPY_DEFAULT, handle)
        if err:
            raise RuntimeError(f"cudaMemcpy2DAsync failed: {lib.cudaGetErrorString(err).decode()}")


def copy_rows_copy_engine(copy: RowCopy, src_items: torch.Tensor, dst_items: torch.Tensor) -> None:
    """Copy every row of items ``src_items[i] -> dst_items[i]`` with 2-D async memcpys.

    Issued on the current CUDA stream; returns without waiting. Indices on a GPU are read
    back first (a stream sync), so pass them on the CPU.
    """
    plan = plan_2d_copies(copy, src_items.cpu().numpy(), dst_items.cpu().numpy())
    issue_2d_copies(plan, torch.cuda.current_stream().cuda_stream)


def _check(err: int, what: str) -> None:
    if err:
        lib = _cudart()
        raise RuntimeError(f"{what} failed: {lib.cudaGetErrorString(err).decode()}")


def create_stream() -> int:
    """A new non-blocking CUDA stream on the current device, as its raw handle.

    Made with the runtime rather than taken from torch's stream pool, whose streams are
    handed out round-robin and can coincide with a caller's stream.
    """
    handle = ctypes.c_void_p()
    _check(
        _cudart().cudaStreamCreateWithFlags(ctypes.byref(handle), _CUDA_STREAM_NON_BLOCKING),
        "cudaStreamCreateWithFlags",
    )
    return int(handle.value or 0)


def destroy_stream(handle: int) -> None:
    """Release a stream from :func:`create_stream` (work still queued on it completes)."""
    _check(_cudart().cudaStreamDestroy(ctypes.c_void_p(handle)), "cudaStreamDestroy")


class RawEvents:
    """``count`` CUDA events without timing, driven through the runtime directly: a
    staged transfer records and waits on a few per chunk, and torch's Python event calls
    cost several times more host time than these."""

    _DISABLE_TIMING = 2  # cudaEventDisableTiming

    def __init__(self, count: int) -> None:
        lib = _cudart()
        self._record, self._wait = lib.cudaEventRecord, lib.cudaStreamWaitEvent
        self.handles: list[int] = []
        for _ in range(count):
            handle = ctypes.c_void_p()
            _check(
                lib.cudaEventCreateWithFlags(ctypes.byref(handle), self._DISABLE_TIMING),
                "cudaEventCreateWithFlags",
            )
            self.handles.append(int(handle.value or 0))
        self._lock = threading.Lock()

    def record(self, index: int, stream: int) -> None:
        """Record event ``index`` on the raw stream handle ``stream``."""
        err = self._record(self.handles[index], stream)
        if err:
            _check(err, "cudaEventRecord")

    def wait(self, stream: int, index: int) -> None:
        """Make ``stream`` wait for the latest record of event ``index``."""
        err = self._wait(stream, self.handles[index], 0)
        if err:
            _check(err, "cudaStreamWaitEvent")

    def synchronize(self, index: int) -> None:
        _check(_cudart().cudaEventSynchronize(self.handles[index]), "cudaEventSynchronize")

    def order(self, index: int, stream: int, after: int) -> None:
        """Make the raw ``stream`` wait for what the raw stream ``after`` has queued so far,
        through event ``index`` (its record and wait as one step, so that two threads
        ordering through the same event do not cross)."""
        with self._lock:
            self.record(index, after)
            self.wait(stream, index)

    def destroy(self) -> None:
        lib = _cudart()
        for handle in self.handles:
            lib.cudaEventDestroy(handle)
        self.handles = []


class CopyDone:
    """The end of the work queued so far on a raw stream: a CUDA event of its own, made
    and recorded at a few microseconds of host time, with the methods of
    ``torch.cuda.Event`` that a copy's callers use. Freed with the object."""

    __slots__ = ("_handle",)

    def __init__(self, stream: int) -> None:
        lib = _cudart()
        handle = ctypes.c_void_p()
        _check(
            lib.cudaEventCreateWithFlags(ctypes.byref(handle), RawEvents._DISABLE_TIMING),
            "cudaEventCreateWithFlags",
        )
        self._handle = int(handle.value or 0)
        _check(lib.cudaEventRecord(self._handle, stream), "cudaEventRecord")

    def synchronize(self) -> None:
        """Wait on the host until the work has ended."""
        _check(_cudart().cudaEventSynchronize(self._handle), "cudaEventSynchronize")

    def query(self) -> bool:
        """Whether the work has ended (an error of the work raises)."""
        err = _cudart().cudaEventQuery(self._handle)
        if err == _CUDA_ERROR_NOT_READY:
            return False
        _check(err, "cudaEventQuery")
        return True

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current one) wait for the work."""
        handle = (stream or torch.cuda.current_stream()).cuda_stream
        _check(_cudart().cudaStreamWaitEvent(handle, self._handle, 0), "cudaStreamWaitEvent")

    def __del__(self) -> None:
        if self._handle:
            with contextlib.suppress(Exception):  # at interpreter exit
                _cudart().cudaEventDestroy(self._handle)


def device_pointer(host_ptr: int) -> int:
    """The address a kernel uses for pinned or registered host memory at ``host_ptr``
    (the same address under unified addressing, on every current GPU)."""
    out = ctypes.c_void_p()
    _check(_cudart().cudaHostGetDevicePointer(ctypes.byref(out), host_ptr, 0),
           "cudaHostGetDevicePointer")  # fmt: skip
    return int(out.value or 0)


def synchronize_stream(handle: int) -> None:
    _check(_cudart().cudaStreamSynchronize(handle), "cudaStreamSynchronize")


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``cudaMemcpyAttributes`` (CUDA 12.8+): the location hints stay zero, which the
    runtime ignores for pinned host and device memory."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


@functools.cache
def _batch_copy() -> tuple[object, bool] | None:
    """``cudaMemcpyBatchAsync`` and whether it takes the ``failIdx`` argument (12.8 and
    12.9 do, 13.0 dropped it); None where the runtime has no batched copy."""
    lib = _cudart()
    version = ctypes.c_int()
    if lib.cudaRuntimeGetVersion(ctypes.byref(version)) or version.value < 12080:
        return None
    try:
        fn = lib.cudaMemcpyBatchAsync
    except AttributeError:
        return None
    with_fail_idx = version.value < 13000
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    fn.restype = ctypes.c_int
    fn.argtypes = [vp, vp, vp, sz, vp, vp, sz] + ([vp] if with_fail_idx else []) + [vp]
    return fn, with_fail_idx


_batch_failed: list[str] = []  # the first error of the batched copy, after which it is not used


def batched_copy_available() -> bool:
    """True when chunks of DMAs go out as one ``cudaMemcpyBatchAsync`` each."""
    return _batch_copy() is not None and not _batch_failed


class Copies1D:
    """A transfer's 1-D copies ``dsts[i] <- srcs[i]`` (``sizes[i]`` bytes; uint64
    addresses), issued a range at a time on one stream.

    ``batched`` sends a range as one ``cudaMemcpyBatchAsync`` where the runtime has it
    (the stream must not be the legacy default stream); should that call fail, the copies
    go out one by one, and so do all later ones (with a warning).
    """

    def __init__(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int, batched: bool
    ) -> None:
        # Kept referenced: the runtime reads these arrays during each call.
        self.dsts = np.ascontiguousarray(dsts, dtype=np.uint64)
        self.srcs = np.ascontiguousarray(srcs, dtype=np.uint64)
        self.sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
        self.addrs = (self.dsts.ctypes.data, self.srcs.ctypes.data, self.sizes.ctypes.data)
        self.stream = ctypes.c_void_p(stream)
        self.batch = _batch_copy() if batched and stream else None
        self.attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
        self.attr_idx = ctypes.c_size_t(0)
        self.fail_idx = ctypes.c_size_t(0)
        self.tail = [ctypes.addressof(self.attrs), ctypes.addressof(self.attr_idx), 1]
        if self.batch is not None and self.batch[1]:
            self.tail.append(ctypes.addressof(self.fail_idx))

    def issue(self, lo: int, hi: int) -> None:
        """Queue copies ``lo..hi-1``."""
        if hi <= lo:
            return
        lib = _cudart()
        if self.batch is not None and not _batch_failed:
            d, s, z = self.addrs
            off = 8 * lo
            err = self.batch[0](d + off, s + off, z + off, hi - lo, *self.tail, self.stream)
            if not err:
                return
            lib.cudaGetLastError()  # clear it: the copies are issued again one by one below
            _batch_failed.append(lib.cudaGetErrorString(err).decode())
            import warnings

            warnings.warn(
                f"cudaMemcpyBatchAsync failed ({_batch_failed[0]}); staged transfers issue "
                f"one cudaMemcpyAsync per DMA from now on",
                RuntimeWarning,
                stacklevel=2,
            )
        memcpy = lib.cudaMemcpyAsync
        dsts, srcs = self.dsts[lo:hi].tolist(), self.srcs[lo:hi].tolist()
        for dst, src, size in zip(dsts, srcs, self.sizes[lo:hi].tolist()):
            err = memcpy(dst, src, size, _CUDA_MEMCPY_DEFAULT, self.stream)
            if err:
                msg = lib.cudaGetErrorString(err).decode()
                raise RuntimeError(f"cudaMemcpyAsync failed: {msg}")
