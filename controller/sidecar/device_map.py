"""The sidecar's half of device-pool sharing: map an engine's described pools.

:func:`map_pools` turns the maps of :func:`hicache.controller.client.device_share.export_pools`
back into tensors over the same memory, checked against the layout so that a bad
description can never make a copy run outside the engine's pools.

* CPU: a segment is mapped only when it is exactly the tensor plus its key (so the key
  cannot be placed inside another tensor by a shorter shape), the key is not all zero
  (memory nobody wrote), it matches, and the peer that names it is a local process of the
  segment's owner (``SO_PEERCRED`` on the Unix socket): a TCP peer cannot name this
  machine's memory at all.
* CUDA: the sidecar opens the IPC handle with ``UntypedStorage._new_shared_cuda`` on its
  own index of the same GPU (UUIDs, not indices, are compared: two processes may number
  GPUs differently). Only a local peer on the Unix socket may register one (a handle opens
  only on its own node, so a TCP peer could only name a memory that is not its own), and
  the view must lie inside the allocation the handle opens (its real extent is asked of
  the driver).
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hicache.controller.client.device_share import BUFFER_NAMES, gpu_uuid
from hicache.controller.sidecar.cuda_views import (
    RegistrationRefused,
    check_allocation_extent,
    non_overlapping,
)
from hicache.controller.store.host_pool import populate
from hicache.controller.store.transfer_engine import EngineBuffers
from hicache.controller.wire.security import PeerCredentials
from hicache.layout import LayerKind, ModelLayout, dtype_name, parse_dtype
from hicache.pools import SEGMENT_KEY_BYTES
from hicache.types import ConfigError

if TYPE_CHECKING:
    from hicache.controller.sidecar.fd_inbox import FdInbox

log = logging.getLogger(__name__)


__all__ = ["MappedPools", "RegistrationRefused", "map_pools", "open_ready_event"]

_SHM_NAME = re.compile(r"^/?[A-Za-z0-9_.-]{1,200}$")
_THIS_PROCESS = PeerCredentials.of_this_process()


def open_ready_event(handle: bytes, device: torch.device) -> torch.cuda.Event:
    """The engine's event from :func:`export_ready_event`; RegistrationRefused if it
    cannot be opened."""
    try:
        return torch.cuda.Event.from_ipc_handle(device, handle)
    except Exception as exc:
        raise RegistrationRefused(f"cannot open the engine's CUDA event ({exc})") from None


@dataclass
class MappedPools:
    """An engine's pools as the sidecar sees them, and what to release when it leaves."""

    buffers: EngineBuffers
    device: str
    segments: list[shared_memory.SharedMemory] = field(default_factory=list)

    def close(self) -> bool:
        """Unmap shared memory (never unlinks: the engine owns it); True when done.

        False while a tensor view still exports the buffer; call again later.
        """
        left = []
        for seg in self.segments:
            try:
                seg.close()
            except BufferError:
                left.append(seg)
        self.segments = left
        return not left


def _attach_segment(name: str) -> shared_memory.SharedMemory:
    try:
        seg = shared_memory.SharedMemory(name=name, create=False)
    except FileNotFoundError:
        raise RegistrationRefused(
            f"no shared-memory segment named {name!r}: the engine exited or freed its pools"
        ) from None
    # Python < 3.13 registers an attached segment with this process's resource tracker,
    # which would unlink the engine's memory when the sidecar exits: undo that.
    try:
        resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # the tracker is best effort; a failure only costs a warning at exit
        log.debug("resource tracker unregister of %s failed", name)
    return seg


def _check_shape(desc: dict[str, Any]) -> tuple[torch.dtype, list[int]]:
    shape = desc.get("shape")
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= 8
        or not all(type(s) is int and 0 <= s < 1 << 40 for s in shape)
    ):
        raise RegistrationRefused("a buffer's shape must be a list of 1..8 integers >= 0")
    try:
        dtype = parse_dtype(desc.get("dtype"))
    except (ConfigError, TypeError):
        raise RegistrationRefused(f"unknown buffer dtype {desc.get('dtype')!r}") from None
    return dtype, shape


def _map_shm(desc: dict[str, Any], segments: list, peer: PeerCredentials) -> torch.Tensor:
    name = desc["shm_name"]
    dtype, shape = _check_shape(desc)
    key = desc.get("key")
    if not isinstance(key, bytes) or len(key) != SEGMENT_KEY_BYTES:
        raise RegistrationRefused(
            f"buffer in segment {name!r}: 'key' must be the segment's {SEGMENT_KEY_BYTES} key bytes"
        )
    if not any(key):
        # Memory nobody has written is zero: a zero key proves nothing about the sender.
        raise RegistrationRefused(
            f"buffer in segment {name!r}: an all-zero key is never a segment's key"
        )
    seg = _attach_segment(name)
    segments.append(seg)
    owner = os.fstat(seg._fd).st_uid  # type: ignore[attr-defined]
    if owner != peer.uid:
        raise RegistrationRefused(
            f"segment {name!r} belongs to uid {owner}, the registering process (pid "
            f"{peer.pid}) runs as uid {peer.uid}: an engine registers only its own pools"
        )
    nbytes = math.prod(shape) * dtype.itemsize
    end = max(nbytes, 1)
    if seg.size != end + SEGMENT_KEY_BYTES:
        # Exactly the tensor and its key: with a shorter shape "the key" would be bytes
        # inside the pool (zero until written), which anyone can name.
        raise RegistrationRefused(
            f"segment {name!r} holds {seg.size} bytes, not the {end + SEGMENT_KEY_BYTES} of "
            f"its shape {shape} of {dtype_name(dtype)} and its key: send the pool's own shape"
        )
    # Only a reader of the segment knows the bytes after the tensor: another process of
    # the same user that cannot read it (or a stale description) is refused here.
    if not hmac.compare_digest(bytes(seg.buf[end : end + SEGMENT_KEY_BYTES]), key):
        raise RegistrationRefused(
            f"segment {name!r} does not hold the key sent with it: not an engine pool this "
            "client allocated"
        )
    # Through NumPy, whose array holds an export of the segment's buffer for as long as
    # any tensor made from it lives: MappedPools.close() then fails (and is tried again)
    # while a copy could still touch the memory. torch.frombuffer holds no export, so the
    # segment would be unmapped under a live tensor.
    raw = np.frombuffer(seg.buf, dtype=np.uint8, count=max(nbytes, 1))
    flat = torch.from_numpy(raw)[:nbytes]
    return _prefaulted(flat.view(dtype).view(shape))


def _prefaulted(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (an engine's pool just mapped here) with its pages faulted into this
    process at registration, not at the first load's copy into them."""
    populate(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    return tensor


def _segment_names(buffers: dict[str, Any]) -> None:
    """Check every shm buffer's segment name, and that no segment is named twice (two
    pools in one memory would overwrite each other; ``/x`` and ``x`` are one segment)."""
    seen: dict[str, str] = {}
    for buf_name, d in buffers.items():
        if d.get("kind") != "shm":
            continue
        name = d.get("shm_name")
        if not isinstance(name, str) or not _SHM_NAME.match(name):
            raise RegistrationRefused(f"bad shared-memory segment name {name!r}")
        other = seen.setdefault(name.lstrip("/"), buf_name)
        if other != buf_name:
            raise RegistrationRefused(
                f"buffers {other!r} and {buf_name!r} name the same segment {name!r}: each "
                "pool has a segment of its own"
            )


def _map_memfd(
    desc: dict[str, Any], segments: list, peer: PeerCredentials, inbox: FdInbox | None
) -> torch.Tensor:
    """A pool in anonymous shared memory whose descriptor the engine handed over on the
    descriptor socket (controller/client/fd_pass.py), named by its ticket."""
    if inbox is None:
        raise RegistrationRefused("this sidecar takes no memory descriptors (no descriptor socket)")
    dtype, shape = _check_shape(desc)
    try:
        tensor, mapping = inbox.map_descriptor(
            desc.get("ticket"), peer, dtype, shape, desc.get("offset", 0)
        )
    except ValueError as exc:
        raise RegistrationRefused(str(exc)) from None
    segments.append(mapping)
    return _prefaulted(tensor)


def _local_gpu(uuid: str, allowed: Sequence[str]) -> int:
    if not torch.cuda.is_available():
        raise RegistrationRefused(
            f"the engine's GPU {uuid} is not visible to this sidecar (it sees no CUDA "
            "device); run the sidecar on the engine's node with its GPUs visible"
        )
    seen = [gpu_uuid(i) for i in range(torch.cuda.device_count())]
    if uuid not in seen:
        raise RegistrationRefused(
            f"the engine's GPU {uuid} is not one this sidecar sees ({', '.join(seen)}); "
            "register with the sidecar of the engine's node, with that GPU visible to it"
        )
    if allowed and uuid not in allowed:
        raise RegistrationRefused(
            f"GPU {uuid} is not served by this sidecar (gpu_uuids = {list(allowed)})"
        )
    return seen.index(uuid)


def _map_cuda(desc: dict[str, Any], allowed: Sequence[str]) -> torch.Tensor:
    dtype, shape = _check_shape(desc)
    fields = {
        "device_uuid": str,
        "handle": bytes,
        "storage_bytes": int,
        "storage_offset_bytes": int,
        "ref_counter_handle": bytes,
        "ref_counter_offset": int,
        "event_handle": bytes,
        "event_sync_required": bool,
        "stride": list,
        "offset": int,
    }
    for name, kind in fields.items():
        if not isinstance(desc.get(name), kind):
            raise RegistrationRefused(f"CUDA buffer field {name!r} must be {kind.__name__}")
    stride, offset = desc["stride"], desc["offset"]
    if len(stride) != len(shape) or not all(type(s) is int and s >= 0 for s in stride):
        raise RegistrationRefused("a CUDA buffer's stride must match its shape")
    if not non_overlapping(shape, stride):
        # A zero or overlapping stride would make two K/V halves, layers or slots one
        # memory: every copy into one would land in the other.
        raise RegistrationRefused(
            f"a CUDA buffer's strides {stride} make elements of shape {list(shape)} overlap"
        )
    span = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if all(shape) else 0
    if offset < 0 or span * dtype.itemsize > desc["storage_bytes"]:
        raise RegistrationRefused("a CUDA buffer's view reaches past its storage")
    index = _local_gpu(desc["device_uuid"], allowed)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            desc["handle"],
            desc["storage_bytes"],
            desc["storage_offset_bytes"],
            desc["ref_counter_handle"],
            desc["ref_counter_offset"],
            desc["event_handle"],
            desc["event_sync_required"],
        )
    except Exception as exc:
        raise RegistrationRefused(
            f"cannot open the CUDA IPC handle ({exc}); it is stale (the engine's memory was "
            "freed or the engine exited) or malformed: register again from a live engine"
        ) from None
    check_allocation_extent(index, storage.data_ptr(), desc["storage_bytes"])
    t = torch.empty((0,), dtype=dtype, device=torch.device("cuda", index))
    return t.set_(storage, offset, shape, stride)


def _expected_shapes(layout: ModelLayout, page_size: int, tensors: dict) -> dict[str, tuple]:
    """Shapes each buffer must have (slot counts taken from the buffers themselves)."""
    want: dict[str, tuple] = {}
    heads, hd = layout.num_kv_heads, layout.head_dim
    for name, kind in (("full", LayerKind.FULL), ("swa", LayerKind.SWA)):
        if layout.layers_of(kind):
            t = tensors.get(name)
            slots = t.shape[2] if t is not None and t.dim() == 5 else -1
            want[name] = (2, len(layout.layers_of(kind)), slots, heads, hd)
    if layout.has_mamba:
        conv = tensors.get("mamba_conv")
        slots = conv.shape[1] if conv is not None and conv.dim() >= 2 else -1
        n = len(layout.mamba_layers)
        want["mamba_conv"] = (n, slots, *layout.conv_state_shape)
        want["mamba_ssm"] = (n, slots, *layout.ssm_state_shape)
    return want


def map_pools(
    layout: ModelLayout,
    page_size: int,
    desc: dict[str, Any],
    allowed_gpus: Sequence[str] = (),
    peer: PeerCredentials | None = _THIS_PROCESS,
    fd_inbox: FdInbox | None = None,
) -> MappedPools:
    """Map an engine's exported pools; raises RegistrationRefused saying what is wrong.

    Every buffer's dtype and shape are checked against ``layout`` (slot counts must be
    whole pages), so later copies cannot reach outside the engine's memory. ``peer``: the
    registering process as the kernel reports it (None for a TCP peer, which may not
    register at all); the default is this process, for an in-process caller.
    """
    device = desc.get("device")
    buffers = desc.get("buffers")
    if device not in ("cpu", "cuda") or not isinstance(buffers, dict):
        raise RegistrationRefused("register needs device 'cpu' or 'cuda' and a buffers map")
    unknown = set(buffers) - set(BUFFER_NAMES)
    if unknown:
        raise RegistrationRefused(f"unknown buffer name(s) {sorted(map(str, unknown))}")
    if peer is None:
        raise RegistrationRefused(
            "device pools are registered only over the sidecar's Unix socket, by a process "
            "of the node: a TCP peer cannot name this machine's memory"
        )
    kinds = ("shm", "memfd") if device == "cpu" else ("cuda_ipc",)
    for name, d in buffers.items():
        if not isinstance(d, dict):
            raise RegistrationRefused(f"buffer {name!r} must be a map")
        if d.get("kind") not in kinds:
            raise RegistrationRefused(
                f"buffer {name!r}: a {device} pool is shared as {' or '.join(kinds)}"
            )
    if device == "cpu":
        _segment_names(buffers)
    segments: list[shared_memory.SharedMemory] = []
    tensors: dict[str, torch.Tensor] = {}
    try:
        for name, d in buffers.items():
            if d["kind"] == "memfd":
                tensors[name] = _map_memfd(d, segments, peer, fd_inbox)
            elif device == "cpu":
                tensors[name] = _map_shm(d, segments, peer)
            else:
                tensors[name] = _map_cuda(d, allowed_gpus)
        want = _expected_shapes(layout, page_size, tensors)
        if set(want) != set(tensors):
            raise RegistrationRefused(
                f"the layout needs buffers {sorted(want)}, the engine sent {sorted(tensors)}"
            )
        for name, shape in want.items():
            # No tensor in a local: a refusal's traceback would keep it (and so the
            # mapping) alive past the close() below.
            got_shape, got_dtype = tuple(tensors[name].shape), tensors[name].dtype
            dtype = layout.state_dtype if name.startswith("mamba") else layout.dtype
            if got_shape != shape or got_dtype != dtype:
                raise RegistrationRefused(
                    f"buffer {name!r} is {list(got_shape)} {dtype_name(got_dtype)}, the layout "
                    f"needs {list(shape)} {dtype_name(dtype)}"
                )
            if name in ("full", "swa") and shape[2] % page_size:
                raise RegistrationRefused(f"buffer {name!r} is not whole pages of {page_size}")
        buffers_out = EngineBuffers(
            page_size=page_size,
            full_kv=tensors["full"],
            swa_kv=tensors.get("swa"),
            mamba_conv=tensors.get("mamba_conv"),
            mamba_ssm=tensors.get("mamba_ssm"),
        )
    except BaseException:
        tensors.clear()
        if not MappedPools(None, device, segments).close():  # type: ignore[arg-type]
            log.warning("a refused registration left %d segment(s) mapped", len(segments))
        raise
    return MappedPools(buffers_out, device, segments)
