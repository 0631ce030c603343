"""The zero-copy path: the sidecar maps SGLang's KV host pool itself.

With ``"allocator": "shm"`` SGLang allocates each host pool in an anonymous memfd. A
``layer_first`` MHA pool's buffer ``[2, layers, tokens, heads, head_dim]`` is then exactly
a sidecar FULL buffer (in 2-byte units), so the backend hands the memfd to the sidecar on
its descriptor socket (``SCM_RIGHTS``, controller/client/fd_pass.py) and registers it as the
engine's FULL buffer: backups read SGLang's host pages and loads write them with no copy
on the backend's side. The extra pools (SWA, Mamba) keep the staging path.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

from hicache import DevicePools, LayerKind, ModelLayout, dtype_name
from hicache.controller.client import SidecarUnavailable, export_pools, fd_socket_path, send_fds
from hicache.integrations.sglang_pages import UNIT_BYTES

log = logging.getLogger("hicache.integrations.sglang")


def pool_memfd(pool: Any) -> int | None:
    """The memfd holding ``pool``'s whole KV buffer from its first byte, when the pool is a
    ``layer_first`` MHA pool allocated in shared memory; else None."""
    if getattr(pool, "layout", None) != "layer_first":
        return None
    allocator = getattr(pool, "allocator", None)
    fds, maps = getattr(allocator, "fds", None), getattr(allocator, "mms", None)
    buffer = getattr(pool, "kv_buffer", None)
    if not fds or not maps or buffer is None or not buffer.is_contiguous():
        return None
    base = ctypes.addressof(ctypes.c_char.from_buffer(maps[0]))
    if buffer.data_ptr() != base:
        return None
    return fds[0]


def memfd_description(
    endpoint: str, staging: DevicePools, layout: ModelLayout, pool: Any, fd: int
) -> Callable[[], dict[str, Any]]:
    """A registration description whose FULL buffer is SGLang's memfd (handed over again
    at every session, as a restarted sidecar holds no descriptors) and whose other buffers
    are the staging pools."""
    if not endpoint.startswith("ipc://"):
        raise ValueError("the zero-copy path needs the sidecar's Unix socket")
    inbox = fd_socket_path(endpoint[len("ipc://") :])
    buffer = pool.kv_buffer
    units = buffer.numel() * buffer.element_size() // UNIT_BYTES
    two, layers, tokens, heads = buffer.shape[:4]
    shape = [two, layers, tokens, heads, units // (two * layers * tokens * heads)]
    if len(layout.layers_of(LayerKind.FULL)) != layers:
        raise ValueError("the sidecar layout does not have the KV pool's own layers")

    def describe() -> dict[str, Any]:
        try:
            (ticket,) = send_fds(inbox, [fd])
        except OSError as exc:
            raise SidecarUnavailable(f"the sidecar's descriptor socket {inbox}: {exc}") from None
        desc = export_pools(staging)
        desc["buffers"]["full"] = {
            "kind": "memfd",
            "ticket": ticket,
            "dtype": dtype_name(layout.dtype),
            "shape": shape,
            "offset": 0,
        }
        return desc

    return describe
