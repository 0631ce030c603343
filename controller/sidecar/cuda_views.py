"""Checks that a CUDA pool registered over IPC stays inside its own memory: its view's
strides do not overlap, and its claimed storage lies inside the allocation its handle
opened (the sidecar maps every engine's memory into one address space)."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

import torch

from hicache.controller_api import ControllerError

log = logging.getLogger("hicache.controller.client.device_share")


class RegistrationRefused(ControllerError):
    """The sidecar cannot map the engine's device memory; the message says why."""


def non_overlapping(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether no two elements of a ``shape``/``stride`` view share memory: taken from the
    smallest stride up, each dimension must step past everything the inner ones span."""
    span = 1
    for n, s in sorted(((n, s) for n, s in zip(shape, stride) if n > 1), key=lambda d: d[1]):
        if s < span:
            return False
        span = s * n
    return True


def check_allocation_extent(index: int, ptr: int, nbytes: int) -> None:
    """Refuse a storage that claims more bytes than the allocation its handle opened: the
    sidecar maps every engine's memory into one address space, so a view past the end
    could reach another engine's pools."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no driver library by that name: the CUDA runtime found another
        log.warning("cannot ask the CUDA driver for an allocation's extent; not checked")
        return
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    with torch.cuda.device(index):
        rc = driver.cuMemGetAddressRange_v2(
            ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)
        )
    if rc != 0:
        raise RegistrationRefused(f"the CUDA driver cannot place the engine's storage (error {rc})")
    if ptr + nbytes > base.value + size.value:
        raise RegistrationRefused(
            f"a CUDA buffer claims {nbytes} bytes of storage, its allocation holds "
            f"{base.value + size.value - ptr} from there: send the storage's real size"
        )
