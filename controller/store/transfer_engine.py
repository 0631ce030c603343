"""Device ↔ host page copies: the engine's pools on one side, the host pool on the other.

Copies go through :class:`hicache.kernels.PreparedTransfer` (one launch per component per
request, all layers at once): one per engine's buffers, component and direction, made on
the first copy and kept while the engine's :class:`EngineBuffers` live, so a copy's host
time is its index checks and its launch, not the tensors' shape checks.

On CUDA, backups run on a backup stream that first waits for the engine's
``ready_event`` (or, without one, for the engine's current stream), and return an event
the caller polls; loads run on a separate load stream and are waited for before
:meth:`TransferEngine.to_device` returns, so the engine's next kernel sees the bytes.
On CPU every copy is synchronous in the caller's thread.

Host ↔ disk copies are not here: they run on the LMDB tier's writer thread and reader
pool (:mod:`hicache.controller.tiers.lmdb_tier`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hicache.controller.store.host_pool import HostPool
from hicache.controller.store.layer_copies import LayerCopies
from hicache.controller_api import ControllerError, LayerGroups
from hicache.kernels import PreparedTransfer
from hicache.kernels.copy_engine import (
    Copies1D,
    CopyDone,
    RawEvents,
    batched_copy_available,
    issue_2d_copies,
    run_count,
)
from hicache.kernels.tuning import DEFAULT_TUNING, LAYER_COPY_TUNING, TransferTuning
from hicache.keys import HASH_BYTES
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.controller_api import PageRef
    from hicache.layout import ModelLayout
    from hicache.pools import DevicePools


@dataclass(eq=False)
class EngineBuffers:
    """The device tensors of one engine that the controller copies to and from.

    Built from a :class:`DevicePools` in-process, or from mapped IPC / shared-memory
    tensors by the sidecar. ``full_kv`` and ``swa_kv`` are ``[2, layers, slots, heads,
    head_dim]``; ``mamba_conv`` / ``mamba_ssm`` are ``[layers, slots, ...]``. Compared
    and hashed by identity: the transfer engine keys its prepared copies on the object.
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


_Plans = dict[tuple[ComponentType, bool, tuple[int, int] | None], PreparedTransfer]

log = logging.getLogger("hicache.controller.transfer")

#: A load goes as 2-D copies over runs of pages when its runs average at least this many.
RUN_COPY_MIN_ITEMS = 4

#: The copies of one group's layers, per component: (host pages, device pages or slots).
LayerPlan = dict[ComponentType, tuple[Sequence[int], Sequence[int]]]


class TransferEngine:
    """Runs page copies between engines' device buffers and the host pool."""

    #: Where the copies come from, as reported by the controller's stats.
    source = "hicache.kernels"
    #: How the copies of a layer-wise load are launched (beside the engine's compute):
    #: on a GPU whose runtime has batched copies, one per layer group on the copy engines,
    #: which take no SM from the compute; else by kernel, on ``layer_tuning``'s grid.
    layer_dmas: bool = True
    #: ... and as 2-D copies over runs of pages where the pages run (False: 1-D rows); and
    #: a whole load so (False: the kernel). Off until measured on a GPU (``hf_ttft_gpu.py
    #: --layer-copies dma,rows``; ``bench_data_plane.py``'s ``*_load_runs`` rows).
    layer_runs: bool = False
    load_runs: bool = False
    #: Groups of a layer-wise load queued ahead of the one the compute waits for (0: every
    #: group at the start). An upload the engine queues meanwhile (its inputs, a slot
    #: table) may wait on the copy engines behind the copies queued before it; a load
    #: queued whole at the start would then hold it, and the compute after it, until the
    #: whole load has arrived (docs/architecture.md, "Layer-wise load-back").
    layer_ahead: int = 2
    layer_tuning: TransferTuning = LAYER_COPY_TUNING

    def __init__(self, host_pool: HostPool) -> None:
        self.host_pool = host_pool
        self._streams: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        # Per device: the events that order its load and backup streams after a caller's.
        self._order: dict[int, RawEvents] = {}
        # Dropped with the engine's buffers (so a gone engine's tensors are not held).
        self._plans: weakref.WeakKeyDictionary[EngineBuffers, _Plans] = weakref.WeakKeyDictionary()
        self._layer_thread: ThreadPoolExecutor | None = None  # CPU layer-wise loads

    def _streams_for(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """(load stream, backup stream) of a CUDA device, created on first use."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._streams:
            # Loads at the device's highest priority: a load is what a request waits for,
            # and a layer-wise load's copies must be scheduled between the compute's
            # blocks, not after them.
            self._streams[idx] = (torch.cuda.Stream(idx, priority=-1), torch.cuda.Stream(idx))
        return self._streams[idx]

    def prepared(
        self, component: ComponentType, buffers: EngineBuffers, to_host: bool
    ) -> PreparedTransfer:
        """The prepared copy of ``component`` between ``buffers`` and the host pool."""
        return self._plan(component, buffers, to_host)

    def _plan(
        self,
        component: ComponentType,
        buffers: EngineBuffers,
        to_host: bool,
        layers: tuple[int, int] | None = None,
    ) -> PreparedTransfer:
        plans = self._plans.get(buffers)
        if plans is None:
            plans = self._plans.setdefault(buffers, {})
        tuning = DEFAULT_TUNING if layers is None else self.layer_tuning
        key = (
            (component, to_host, layers) if layers is None else (component, to_host, layers, tuning)
        )
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = self._prepare(component, buffers, to_host, layers, tuning)
        return plan

    def _prepare(
        self,
        component: ComponentType,
        buffers: EngineBuffers,
        to_host: bool,
        layers: tuple[int, int] | None,
        tuning: TransferTuning,
    ) -> PreparedTransfer:
        if component is ComponentType.MAMBA:
            if buffers.mamba_conv is None or buffers.mamba_ssm is None:
                raise ControllerError("this engine registered no Mamba pool")
            return PreparedTransfer.states(
                buffers.mamba_conv,
                buffers.mamba_ssm,
                self.host_pool.conv(),
                self.host_pool.ssm(),
                to_host=to_host,
                layers=layers,
                tuning=tuning,
            )
        dev = buffers.full_kv if component is ComponentType.FULL else buffers.swa_kv
        if dev is None:
            raise ControllerError("this engine registered no sliding-window pool")
        host = self.host_pool.kv(component)
        return PreparedTransfer.kv(
            dev, host, buffers.page_size, to_host=to_host, layers=layers, tuning=tuning
        )

    def warm(self, buffers: EngineBuffers) -> None:
        """Build the plans of ``buffers``' components both ways and launch each of their
        kernels once, moving nothing (:meth:`PreparedTransfer.warm`), so that the first
        copy into or out of a newly registered engine costs what later ones do. Nothing to
        do on a CPU; a failure is logged, and the first copy then pays as before."""
        if buffers.device.type != "cuda":
            return
        load, backup = self._streams_for(buffers.device)
        components = [ComponentType.FULL]
        components += [ComponentType.SWA] if buffers.swa_kv is not None else []
        components += [ComponentType.MAMBA] if buffers.mamba_conv is not None else []
        try:
            for component in components:
                for to_host, stream in ((False, load), (True, backup)):
                    with torch.cuda.stream(stream):
                        self._plan(component, buffers, to_host).warm()
            load.synchronize()
            backup.synchronize()
        except Exception as exc:  # an optimisation: the copies still run without it
            log.warning("the copy kernels could not be prepared ahead: %s", exc)

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
        ``ready_event``; returns a CUDA event recorded after the copy (a
        :class:`~hicache.kernels.copy_engine.CopyDone`: ``synchronize``, ``query``, ``wait``).
        """
        copy = self._plan(component, buffers, to_host=True)
        if buffers.device.type != "cuda":
            if ready_event is not None and hasattr(ready_event, "synchronize"):
                ready_event.synchronize()
            copy(device_index, host_pages)
            return None
        if ready_event is not None:
            _, backup = self._streams_for(buffers.device)
            backup.wait_event(ready_event)
            stream = backup.cuda_stream
        else:
            stream = self._after_caller(buffers.device, backup=True)
        copy(device_index, host_pages, stream)
        return CopyDone(stream)

    def to_device(
        self,
        component: ComponentType,
        buffers: EngineBuffers,
        host_pages: Sequence[int],
        device_index: Sequence[int],
    ) -> None:
        """Copy host pages into device pages/slots; the bytes are there on return."""
        done = self.start_to_device(component, buffers, host_pages, device_index)
        if done is not None:
            done.synchronize()

    def start_to_device(
        self,
        component: ComponentType,
        buffers: EngineBuffers,
        host_pages: Sequence[int],
        device_index: Sequence[int],
    ) -> Any:
        """Issue the copy of host pages into device pages/slots without waiting for it.

        CPU: done on return, returns None. CUDA: queued on the load stream; returns a CUDA
        event recorded after the copy (the bytes are there once it has completed).
        """
        copy = self._plan(component, buffers, to_host=False)
        if buffers.device.type != "cuda":
            copy(device_index, host_pages)
            return None
        # The slots were just handed out by the engine; work it queued earlier on them
        # (by their previous owner) must finish before they are overwritten.
        stream = self._after_caller(buffers.device, backup=False)
        two_d = copy.run_copies(device_index, host_pages) if _runs(self.load_runs, {
            component: (host_pages, device_index)}) else None  # fmt: skip
        if two_d is None:
            copy(device_index, host_pages, stream)
        else:
            issue_2d_copies(two_d, stream)
        return CopyDone(stream)

    def _after_caller(self, device: torch.device, backup: bool) -> int:
        """The raw handle of ``device``'s load (or backup) stream, ordered after what the
        calling thread's current stream has queued: raw events, since torch's stream
        waits, stream contexts and events cost several times their host time, and a
        copy's host time before its launch is time the copy has not started."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        order = self._order.get(idx)
        if order is None:
            order = self._order.setdefault(idx, RawEvents(2))
        stream = self._streams_for(device)[int(backup)].cuda_stream
        order.order(int(backup), stream, torch.cuda.current_stream(device).cuda_stream)
        return stream

    def start_layers_to_device(
        self,
        buffers: EngineBuffers,
        plan: LayerPlan,
        groups: LayerGroups,
        on_finish: Callable[[bool], None],
        fault: Callable[[int], bool] | None = None,
    ) -> LayerCopies:
        """Issue the copy of host pages into device pages/slots group of layers by group
        (see :class:`LayerCopies`). ``on_finish(ok)`` runs once every copy issued has
        ended; ``fault(g)`` (tests) makes group ``g``'s copy raise."""
        load = LayerCopies(groups, on_finish, buffers.device)
        on_gpu = buffers.device.type == "cuda"
        dmas = on_gpu and self.layer_dmas and batched_copy_available()

        def group_plans(g: int):
            """Group ``g``'s copies: (component, plan, host pages, device pages/slots)."""
            for comp, (host_pages, device_index) in plan.items():
                span = groups.spans[g].get(comp)
                if span is not None and len(host_pages):
                    prepared = self._plan(comp, buffers, False, span)
                    yield comp, prepared, host_pages, device_index

        first: dict[ComponentType, tuple[PreparedTransfer, tuple]] = {}

        def group_rows(g: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
            """Group ``g``'s copies as DMA rows: the same pages in every group, so the
            first group's rows (planned and checked) moved to this group's layers."""
            rows = []
            for comp, prepared, host_pages, device_index in group_plans(g):
                shifted = prepared.shifted_rows(*first[comp]) if comp in first else None
                if shifted is None:
                    shifted = prepared.row_dmas(device_index, host_pages)
                    first.setdefault(comp, (prepared, shifted))
                rows.append(shifted)
            return rows

        # Where the load's pages run consecutively on both sides (pools hand a request's
        # pages out in order), each group can go as one 2-D copy per row of each run: a
        # few large DMAs instead of one 128 KiB DMA per page and row (``layer_runs``).
        runs = dmas and _runs(self.layer_runs, plan)
        # DMAs: every group's rows made here, at once (a fraction of a millisecond), so
        # that issuing a group is one call as the compute reaches it (LayerCopies).
        bounds, unplanned = [0], None
        copies = None
        if dmas and not runs:
            parts: list = []
            for g in range(len(groups)):
                try:
                    rows = group_rows(g)
                except Exception as exc:  # this group and every later one fail
                    unplanned = (g, exc)
                    break
                parts += rows
                bounds.append(bounds[-1] + sum(r[0].size for r in rows))
            if parts:
                stream = self._streams_for(buffers.device)[0]
                copies = Copies1D(*map(np.concatenate, zip(*parts)), stream.cuda_stream, True)

        def copy_group(g: int) -> None:
            if fault is not None and fault(g):
                raise RuntimeError(f"injected copy failure at layer group {g}")
            if not dmas or runs:
                for _, prepared, host_pages, device_index in group_plans(g):
                    two_d = prepared.run_copies(device_index, host_pages) if runs else None
                    if two_d is None:
                        prepared(device_index, host_pages)
                    else:
                        issue_2d_copies(two_d, torch.cuda.current_stream().cuda_stream)
            elif unplanned is not None and g >= unplanned[0]:
                raise unplanned[1]
            elif copies is not None:  # one batched copy for the group, on the copy engines
                copies.issue(bounds[g], bounds[g + 1])

        if not on_gpu:
            if self._layer_thread is None:
                self._layer_thread = ThreadPoolExecutor(1, thread_name_prefix="hicache-layers")
            self._layer_thread.submit(load.run_cpu, copy_group)
            return load
        stream, _ = self._streams_for(buffers.device)
        stream.wait_stream(torch.cuda.current_stream(buffers.device))  # as start_to_device
        # Issued by the caller's thread a few groups ahead of the layer its compute waits
        # for (LayerCopies.issue_gpu): a thread of its own would issue them only as often as
        # the interpreter lock that the compute's Python holds lets it run.
        load.issue_gpu(copy_group, stream, self.layer_ahead)
        return load


def _runs(wanted: bool, plan: dict) -> bool:
    """Whether ``plan``'s (host pages, device pages) go as 2-D copies over their runs."""
    if not wanted:
        return False
    count = sum(run_count(np.asarray(h), np.asarray(d)) for h, d in plan.values())
    return count * RUN_COPY_MIN_ITEMS <= sum(len(h) for h, _ in plan.values())


def check_refs(refs: Sequence[PageRef], buffers: EngineBuffers, layout: ModelLayout | None) -> None:
    """Raise ControllerError unless every ref names a component of ``layout``, a page or
    slot inside the engine's ``buffers``, well-formed hashes, and no device page twice."""
    comps = layout.components if layout else ()
    caps = {c: buffers.capacity(c) for c in comps}
    # One device page holds one page of one prefix: two pages copied into it would
    # leave a blend of both, two hashes read from it would store one prefix's bytes
    # under another's hash. (The same ref twice is one page.)
    named: dict[tuple[ComponentType, int], bytes] = {}
    for ref in refs:
        cap = caps.get(ref.component)
        if cap is None:
            raise ControllerError(f"the layout has no {ref.component.name} component")
        if not 0 <= ref.device_index < cap:
            raise ControllerError(
                f"{ref.component.name} device index {ref.device_index} is outside the "
                f"engine's {cap} pages/slots"
            )
        if len(ref.page_hash) != HASH_BYTES or len(ref.parent_hash) != HASH_BYTES:
            raise ControllerError(f"page and parent hashes must be {HASH_BYTES} bytes")
        seen = named.setdefault((ref.component, ref.device_index), ref.page_hash)
        if seen != ref.page_hash:
            raise ControllerError(
                f"{ref.component.name} device page/slot {ref.device_index} is named by "
                "two different pages in one request"
            )
