"""Device ↔ host page copies: the engine's pools on one side, the host pool on the other.

Copies go through the transfer functions of :mod:`hicache.kernels` (one launch per
component per request, all layers at once). Which implementation runs is resolved once,
by :func:`resolve_kernels`: the dispatching functions of ``hicache.kernels`` when that
package provides them, else the torch references of :mod:`hicache.kernels.reference`.

On CUDA, backups run on a backup stream that first waits for the engine's
``ready_event`` (or, without one, for the engine's current stream), and return an event
the caller polls; loads run on a separate load stream and are waited for before
:meth:`TransferEngine.to_device` returns, so the engine's next kernel sees the bytes.
On CPU every copy is synchronous in the caller's thread.

Host ↔ disk copies are not here: they run on the LMDB tier's writer thread and reader
pool (:mod:`hicache.controller.lmdb_tier`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hicache.controller.host_pool import HostPool
from hicache.controller_api import ControllerError
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.pools import DevicePools

log = logging.getLogger(__name__)

_KERNEL_NAMES = (
    "kv_pages_to_host",
    "kv_pages_to_device",
    "mamba_states_to_host",
    "mamba_states_to_device",
)


@dataclass(frozen=True)
class KernelSet:
    kv_pages_to_host: Callable[..., None]
    kv_pages_to_device: Callable[..., None]
    mamba_states_to_host: Callable[..., None]
    mamba_states_to_device: Callable[..., None]
    source: str


def resolve_kernels() -> KernelSet:
    """The transfer functions to use: ``hicache.kernels``'s, else the torch references."""
    try:
        import hicache.kernels as kernels

        fns = [getattr(kernels, name) for name in _KERNEL_NAMES]
        return KernelSet(*fns, source="hicache.kernels")
    except (ImportError, AttributeError) as exc:
        log.info("transfer: using the torch reference copies (%s)", exc)
    from hicache.kernels import reference

    fns = [getattr(reference, name + "_ref") for name in _KERNEL_NAMES]
    return KernelSet(*fns, source="hicache.kernels.reference")


@dataclass
class EngineBuffers:
    """The device tensors of one engine that the controller copies to and from.

    Built from a :class:`DevicePools` in-process, or from mapped IPC / shared-memory
    tensors by the sidecar. ``full_kv`` and ``swa_kv`` are ``[2, layers, slots, heads,
    head_dim]``; ``mamba_conv`` / ``mamba_ssm`` are ``[layers, slots, ...]``.
    """

    page_size: int
    full_kv: torch.Tensor
    swa_kv: torch.Tensor | None = None
    mamba_conv: torch.Tensor | None = None
    mamba_ssm: torch.Tensor | None = None

    @classmethod
    def from_pools(cls, pools: DevicePools) -> EngineBuffers:
        return cls(
            page_size=pools.config.page_size,
            full_kv=pools.full.buffer,
            swa_kv=None if pools.swa is None else pools.swa.buffer,
            mamba_conv=None if pools.mamba is None else pools.mamba.conv,
            mamba_ssm=None if pools.mamba is None else pools.mamba.ssm,
        )

    @property
    def device(self) -> torch.device:
        return self.full_kv.device

    def capacity(self, component: ComponentType) -> int:
        """Device pages (FULL, SWA) or state slots (MAMBA) this engine has."""
        if component is ComponentType.FULL:
            return self.full_kv.shape[2] // self.page_size
        if component is ComponentType.SWA:
            return 0 if self.swa_kv is None else self.swa_kv.shape[2] // self.page_size
        return 0 if self.mamba_conv is None else self.mamba_conv.shape[1]


def _index(values: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64)


class TransferEngine:
    """Runs page copies between engines' device buffers and the host pool."""

    def __init__(self, host_pool: HostPool, kernels: KernelSet | None = None) -> None:
        self.host_pool = host_pool
        self.kernels = kernels or resolve_kernels()
        self._streams: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    def _streams_for(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """(load stream, backup stream) of a CUDA device, created on first use."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._streams:
            self._streams[idx] = (torch.cuda.Stream(idx), torch.cuda.Stream(idx))
        return self._streams[idx]

    def _copy(
        self,
        component: ComponentType,
        buffers: EngineBuffers,
        device_index: torch.Tensor,
        host_pages: torch.Tensor,
        to_host: bool,
    ) -> None:
        k = self.kernels
        if component is ComponentType.MAMBA:
            if buffers.mamba_conv is None or buffers.mamba_ssm is None:
                raise ControllerError("this engine registered no Mamba pool")
            hc, hs = self.host_pool.conv(), self.host_pool.ssm()
            if to_host:
                k.mamba_states_to_host(
                    buffers.mamba_conv, buffers.mamba_ssm, hc, hs, device_index, host_pages
                )
            else:
                k.mamba_states_to_device(
                    hc, hs, buffers.mamba_conv, buffers.mamba_ssm, host_pages, device_index
                )
            return
        dev = buffers.full_kv if component is ComponentType.FULL else buffers.swa_kv
        if dev is None:
            raise ControllerError("this engine registered no sliding-window pool")
        host = self.host_pool.kv(component)
        if to_host:
            k.kv_pages_to_host(dev, host, device_index, host_pages, buffers.page_size)
        else:
            k.kv_pages_to_device(host, dev, host_pages, device_index, buffers.page_size)

    def to_host(
        self,
        component: ComponentType,
        buffers: EngineBuffers,
        device_index: Sequence[int],
        host_pages: Sequence[int],
        ready_event: Any = None,
    ) -> Any:
        """Copy device pages/slots into host pages.

        CPU: done on return, returns None. CUDA: queued on the backup stream after
        ``ready_event``; returns a CUDA event recorded after the copy.
        """
        dev_idx, host_idx = _index(device_index), _index(host_pages)
        if buffers.device.type != "cuda":
            if ready_event is not None and hasattr(ready_event, "synchronize"):
                ready_event.synchronize()
            self._copy(component, buffers, dev_idx, host_idx, to_host=True)
            return None
        _, backup = self._streams_for(buffers.device)
        if ready_event is not None:
            backup.wait_event(ready_event)
        else:
            backup.wait_stream(torch.cuda.current_stream(buffers.device))
        with torch.cuda.stream(backup):
            self._copy(component, buffers, dev_idx, host_idx, to_host=True)
            done = torch.cuda.Event()
            done.record(backup)
        return done

    def to_device(
        self,
        component: ComponentType,
        buffers: EngineBuffers,
        host_pages: Sequence[int],
        device_index: Sequence[int],
    ) -> None:
        """Copy host pages into device pages/slots; the bytes are there on return."""
        dev_idx, host_idx = _index(device_index), _index(host_pages)
        if buffers.device.type != "cuda":
            self._copy(component, buffers, dev_idx, host_idx, to_host=False)
            return
        load, _ = self._streams_for(buffers.device)
        # The slots were just handed out by the engine; work it queued earlier on them
        # (by their previous owner) must finish before they are overwritten.
        load.wait_stream(torch.cuda.current_stream(buffers.device))
        with torch.cuda.stream(load):
            self._copy(component, buffers, dev_idx, host_idx, to_host=False)
            done = torch.cuda.Event()
            done.record(load)
        done.synchronize()
