"""The engine's half of device-pool sharing: describe each pool tensor for the sidecar.

:func:`export_pools` describes each pool tensor as a msgpack-safe map (the sidecar maps it
back with :func:`hicache.controller.sidecar.device_map.map_pools`); :func:`export_ready_event`
shares the event a load waits on.

* CPU: the pools live in named POSIX shared memory (``CacheConfig(shared_memory=True)``);
  a description is the segment name, dtype, shape and the key the segment ends with.
* CUDA: a description is the CUDA IPC handle of the tensor's storage (raw bytes, from
  ``UntypedStorage._share_cuda_``) plus the GPU's UUID, dtype, shape, stride and offset.
"""

from __future__ import annotations

from typing import Any

import torch

from hicache.controller_api import ControllerError
from hicache.layout import dtype_name
from hicache.pools import DevicePools

__all__ = ["BUFFER_NAMES", "export_pools", "export_ready_event", "gpu_uuid"]

BUFFER_NAMES = ("full", "swa", "mamba_conv", "mamba_ssm")


def _pool_tensors(pools: DevicePools) -> dict[str, torch.Tensor]:
    out = {"full": pools.full.buffer}
    if pools.swa is not None:
        out["swa"] = pools.swa.buffer
    if pools.mamba is not None:
        out["mamba_conv"] = pools.mamba.conv
        out["mamba_ssm"] = pools.mamba.ssm
    return out


def gpu_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as this process numbers it."""
    return str(torch.cuda.get_device_properties(index).uuid)


def export_cuda_tensor(t: torch.Tensor) -> dict[str, Any]:
    """A CUDA tensor as an IPC description (the storage's handle, and the view on it)."""
    (
        device,
        handle,
        storage_bytes,
        storage_offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = t.untyped_storage()._share_cuda_()
    return {
        "kind": "cuda_ipc",
        "device_uuid": gpu_uuid(int(device)),
        "handle": bytes(handle),
        "storage_bytes": int(storage_bytes),
        "storage_offset_bytes": int(storage_offset_bytes),
        "ref_counter_handle": bytes(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": bytes(event_handle or b""),
        "event_sync_required": bool(event_sync_required),
        "dtype": dtype_name(t.dtype),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "offset": int(t.storage_offset()),
    }


def export_pools(pools: DevicePools) -> dict[str, Any]:
    """How the sidecar can reach ``pools``: ``{"device": "cpu"|"cuda", "buffers": {...}}``.

    Raises ControllerError when the pools cannot be shared (CPU pools not in shared memory).
    """
    tensors = _pool_tensors(pools)
    device = pools.full.buffer.device
    if device.type == "cuda":
        return {
            "device": "cuda",
            "buffers": {name: export_cuda_tensor(t) for name, t in tensors.items()},
        }
    if device.type != "cpu":
        raise ControllerError(f"pools on {device} cannot be shared with the sidecar")
    shared = pools.shared_tensors()
    if set(shared) != set(tensors):
        raise ControllerError(
            "the sidecar cannot reach CPU pools in private memory; allocate them with "
            "CacheConfig(shared_memory=True)"
        )
    return {
        "device": "cpu",
        "buffers": {name: {"kind": "shm", **shared[name]} for name in tensors},
    }


def export_ready_event(device: torch.device) -> tuple[bytes, torch.cuda.Event]:
    """An interprocess CUDA event recorded now on ``device``'s current stream, and its IPC
    handle: the sidecar makes its copy wait on it, so a backup reads finished KV without
    the engine blocking. Keep the event alive until the sidecar has answered."""
    event = torch.cuda.Event(interprocess=True)
    event.record(torch.cuda.current_stream(device))
    return bytes(event.ipc_handle()), event
