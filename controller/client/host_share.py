"""Load-backs an engine copies itself, from the sidecar's host pages mapped read-only.

Through the sidecar, a load-back of pages held on host is a request, a copy the sidecar
issues into the engine's memory (CUDA IPC), and a reply: on a GPU host about a
millisecond more than the same copy in-process, most of it thread hand-offs and two
processes' Python around a copy of a few hundred microseconds (docs/performance.md).
A sidecar whose host pool lives in ``memfd`` memory (``ControllerConfig.host_shared``,
on by default in ``hicache serve``) hands its descriptors to its engines over the
descriptor socket (controller/client/fd_pass.py). An engine maps them read-only, registers them
with CUDA (page-locked, as the sidecar's are), and then:

* its **pin** asks for the host page of each key; the sidecar answers them for pages
  ready on host (``-1`` for a page only on disk, or still being filled);
* its **load** of pages that all have one copies them with the same kernels as an
  in-process controller (:class:`TransferEngine`), on its own load stream, and waits
  for the copy;
* its **unpin** (sent after the copy has ended) says the pages were loaded, so the
  sidecar counts the transfer and keeps those pages as it keeps any page that served a
  load-back.

A pinned page is never freed or rewritten, so the copy reads what the pin promised. A
pin within ``TTL_MARGIN_S`` of its deadline, a page not on host (unless a CPU engine
reads it from disk itself, :attr:`HostShare.disk`, controller/client/disk_share.py), a
sidecar of another session: the load goes through the sidecar as before. This mapping
is ``PROT_READ``; an engine that copies its own stores maps the pages read-write instead
(:class:`WritableHostPages`, docs/protocol.md, "Stores an engine copies itself").

The sidecar's side is :func:`hicache.controller.sidecar.host_share.describe`: the
description and descriptors it sends.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgpack
import numpy as np
import torch

from hicache.controller.client.fd_pass import fd_socket_path, receive_fds
from hicache.controller.store.host_pool import FRAME_BYTES, HostPool, row_bytes
from hicache.controller.store.transfer_engine import (
    EngineBuffers,
    LayerPlan,
    TransferEngine,
    check_refs,
)
from hicache.controller.wire.verbs import UnpinArgs
from hicache.controller_api import (
    ControllerError,
    LayerGroups,
    LayerLoad,
    LoadResult,
    WholeLayerLoad,
)
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.controller.client.disk_share import DiskShare
    from hicache.controller_api import PageRef, PinReceipt
    from hicache.layout import ModelLayout
    from hicache.pools import DevicePools

log = logging.getLogger("hicache.sidecar.host_share")

TTL_MARGIN_S = 1.0  # a pin with less left than this is loaded by the sidecar
SHARE_VERSION = 1
_CUDA_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly


class HostShare:
    """The sidecar's host pages mapped into this engine, and the copies out of them."""

    def __init__(
        self, pool: HostPool, registered: list[int], generation: int, buffers: EngineBuffers
    ) -> None:
        self.pool = pool
        self.generation = generation  # the client's session these pages belong to
        self.buffers = buffers
        self._engine = TransferEngine(pool)
        self._registered = registered
        # pin id -> (seconds its load here took, of which reading disk pages here or None)
        self._loaded: dict[int, tuple[float, float | None]] = {}
        self.disk: DiskShare | None = None  # pages only on disk read here (disk_share.py)
        self.open_s = 0.0  # how long mapping (and page-locking) the pages took

    @classmethod
    def open(
        cls,
        fd_path: str | os.PathLike,
        layout: ModelLayout,
        page_size: int,
        buffers: EngineBuffers,
        generation: int,
        disk_reads: int | None = None,
        kept: DiskShare | None = None,
    ) -> HostShare | None:
        """Map the host pages of the sidecar at ``fd_path``; None (logged) when it shares
        none, they are not this layout's, or they cannot be page-locked here. With
        ``disk_reads`` (a sidecar of another process), a CPU engine also reads pages only
        on disk itself where the sidecar names its disk tier (:attr:`disk`), those of
        ``disk_reads`` bytes or more beside the sidecar (``engine_split_read_bytes``),
        through ``kept``'s map where that is still of the same file
        (:meth:`DiskShare.open`)."""
        t0 = time.perf_counter()
        try:
            header, fds = receive_fds(fd_path)
        except OSError as exc:
            log.info("no shared host pages from the sidecar (%s): loads go through it", exc)
            return None
        try:
            if not header:
                return None
            mapped = _map(header, fds, layout, page_size)
        except (ValueError, OSError) as exc:
            log.warning("the sidecar's shared host pages are unusable: %s", exc)
            return None
        finally:
            for fd in fds:
                os.close(fd)
        registered: list[int] = []
        if buffers.device.type == "cuda":
            for buf in mapped.values():
                ptr, n = buf.data_ptr(), buf.numel()
                if not n:
                    continue
                rc = torch.cuda.cudart().cudaHostRegister(ptr, n, _CUDA_HOST_REGISTER_READ_ONLY)
                if int(rc) != 0:
                    log.warning("cudaHostRegister of the shared host pages failed (%s)", rc)
                    _unregister(registered)
                    return None
                registered.append(ptr)
        pool = HostPool(layout, page_size, None, mapped=mapped)
        share = cls(pool, registered, generation, buffers)
        share._engine.warm(buffers)  # the copies' plans and kernels now, not at a first load
        if disk_reads is not None and buffers.device.type == "cpu":
            entry = msgpack.unpackb(header, raw=False).get("disk")
            if entry is not None:
                from hicache.controller.client.disk_share import DiskShare

                share.disk = DiskShare.open(
                    entry, layout, page_size, pool, share._engine, buffers, disk_reads, kept
                )
        share.open_s = time.perf_counter() - t0
        log.info(
            "mapped the sidecar's host pages (%.1f GiB, %.2f s): load-backs of host pages "
            "copy here", pool.resident_bytes / (1 << 30), share.open_s,
        )  # fmt: skip
        return share

    @classmethod
    def for_session(
        cls,
        endpoint: str,
        layout: ModelLayout,
        page_size: int,
        pools: DevicePools | None,
        generation: int,
        disk_reads: int | None = None,
        kept: DiskShare | None = None,
    ) -> HostShare | None:
        """:meth:`open` for a client of ``endpoint`` whose ``pools`` are registered; None
        for a TCP endpoint or a client without pools."""
        if pools is None or not endpoint.startswith("ipc://"):
            return None
        path = fd_socket_path(endpoint[len("ipc://") :])
        buffers = EngineBuffers.from_pools(pools)
        return cls.open(path, layout, page_size, buffers, generation, disk_reads, kept)

    def try_load(
        self,
        refs: Sequence[PageRef],
        pin: PinReceipt,
        counters: Counter | None = None,
        pages: list[int] | None = None,
    ) -> bool | None:
        """Copy ``refs`` here when every page has a host page under ``pin`` or, with
        :attr:`disk`, is only on disk and read here: whether the bytes arrived (recorded
        for the unpin, :meth:`unpin_args`); None when the sidecar must load them (a read
        from disk that was not OK: counted in ``counters``). ``pages``: what
        :meth:`host_pages` answered for them, where the caller asked it already."""
        disk = self.disk
        pages = self.host_pages(pin, refs, disk) if pages is None else pages
        if pages is None:
            return None
        t0 = time.perf_counter()
        if self.buffers.device.type == "cuda":  # the slots' earlier work ends first
            torch.cuda.current_stream(self.buffers.device).synchronize()
        read_s = None
        try:
            if disk is not None and -1 in pages:
                check_refs(refs, self.buffers, self.pool.layout)
                reads = [(r.component, r.page_hash, r.device_index)
                         for r, p in zip(refs, pages) if p < 0]  # fmt: skip
                read = disk.read(reads)
                read_s = time.perf_counter() - t0
                if counters is not None:
                    counters["load_engine_read" + ("" if read else "_fell_back")] += 1
                if not read:
                    return None
                refs = [r for r, p in zip(refs, pages) if p >= 0]
                pages = [p for p in pages if p >= 0]
            ok = self.load(refs, pages)
        except ControllerError as exc:  # refs outside this engine's pools: as the sidecar
            log.warning("load-back refused: %s", exc)  # would answer, a failed load
            return False
        if ok:
            self._loaded[pin.pin_id] = (time.perf_counter() - t0, read_s)
        return ok

    def forget(self, pin: PinReceipt) -> None:
        """Forget what a load under ``pin`` copied here (the load as a whole failed)."""
        self._loaded.pop(pin.pin_id, None)

    def unpin_args(self, pin: PinReceipt, loaded_s: float | None) -> UnpinArgs:
        """The unpin of ``pin``: how long its load here took (``loaded_s`` if given) and
        what it read from disk here (forgotten once asked)."""
        took, read_s = self._loaded.pop(pin.pin_id, (None, None))
        return UnpinArgs(pin.pin_id, took if loaded_s is None else loaded_s, read_s)

    def host_pages(
        self, pin: PinReceipt, refs: Sequence[PageRef], disk: DiskShare | None = None
    ) -> list[int] | None:
        """The host page of each ref (-1 for a page only on disk that ``disk`` reads), or
        None when the sidecar must load them (a page not on host nor read here, a pin
        close to its deadline or of another session)."""
        pages = pin.host_pages
        if pages is None or pin.deadline - time.monotonic() < TTL_MARGIN_S:
            return None
        by_key = dict(zip(pin.keys, pages))
        out = []
        for ref in refs:
            page = by_key.get(ref.key)
            if page is None or (page < 0 and (disk is None or not disk.reads(ref.component))):
                return None
            out.append(page)
        return out

    def split(
        self, refs: Sequence[PageRef], pages: list[int]
    ) -> tuple[list[PageRef], list[PageRef], list[int]] | None:
        """A load (``pages``: what :meth:`host_pages` answered for ``refs``) whose pages
        only on disk include pages :attr:`disk` reads beside the sidecar
        (``DiskShare.shares``), parted: (the refs the sidecar loads, the refs loaded here,
        their host pages), the first ``DiskShare.sidecar_share`` of those pages the
        sidecar's; None for any other load (:meth:`try_load` takes it whole)."""
        disk = self.disk
        if disk is None:
            return None
        shared = [i for i, p in enumerate(pages) if p < 0 and disk.shares(refs[i].component)]
        k = round(len(shared) * disk.sidecar_share)
        if not k:
            return None
        theirs = set(shared[:k])
        ours = [i for i in range(len(refs)) if i not in theirs]
        return [refs[i] for i in shared[:k]], [refs[i] for i in ours], [pages[i] for i in ours]

    def close(self) -> None:
        """Stop reading disk pages here (the LMDB map closed); host copies go on."""
        if self.disk is not None:
            self.disk.close()

    def try_start_layers(
        self, refs: Sequence[PageRef], pin: PinReceipt, groups: LayerGroups
    ) -> LayerLoad | None:
        """:meth:`try_load` as a layer-wise load (:class:`LayerCopies`): None when the
        sidecar must load the pages."""
        pages = self.host_pages(pin, refs)
        if pages is None:
            return None
        try:
            plan = self._plan(refs, pages)
        except ControllerError as exc:
            log.warning("load-back refused: %s", exc)
            plan = None
        if plan is None:
            return WholeLayerLoad(groups, LoadResult.FAILED)
        t0 = time.perf_counter()

        def finished(ok: bool) -> None:
            if ok:
                self._loaded[pin.pin_id] = (time.perf_counter() - t0, None)

        return self._engine.start_layers_to_device(self.buffers, plan, groups, finished)

    def _plan(self, refs: Sequence[PageRef], host_pages: list[int]) -> LayerPlan | None:
        """The copies of a load, by component; None for a page that is not one of this
        pool's (a sidecar answer to distrust). Raises ControllerError for refs that name
        no slot of this engine (or one twice)."""
        check_refs(refs, self.buffers, self.pool.layout)
        groups: dict[ComponentType, tuple[list[int], list[int]]] = {}
        for ref, page in zip(refs, host_pages):
            if not 0 <= page < self.pool[ref.component].num_pages:
                return None
            src, dst = groups.setdefault(ref.component, ([], []))
            src.append(page)
            dst.append(ref.device_index)
        return groups

    def load(self, refs: Sequence[PageRef], host_pages: list[int]) -> bool:
        """Copy ``host_pages`` into the slots of ``refs``; True once the bytes are there.
        Raises ControllerError for refs that name no slot of this engine (or one twice)."""
        groups = self._plan(refs, host_pages)
        if groups is None:
            return False
        try:
            events = [
                self._engine.start_to_device(c, self.buffers, src, dst)
                for c, (src, dst) in groups.items()
            ]
            for e in events:
                if e is not None:
                    e.synchronize()
        except Exception as exc:  # a device error: the slots are undefined, a miss
            log.error("load-back from the shared host pages failed: %s", exc)
            return False
        return True

    def __del__(self) -> None:
        _unregister(self._registered)
        self.close()


def _map(
    header: bytes, fds: list[int], layout: ModelLayout, page_size: int, writable: bool = False
) -> dict[ComponentType, torch.Tensor]:
    """The pages the description names, one ``[pages, row_bytes]`` buffer per component
    (read-only unless ``writable``); ValueError for a description that does not fit."""
    try:
        desc = msgpack.unpackb(header, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData) as exc:
        raise ValueError(f"the description does not decode ({exc})") from None
    if not isinstance(desc, dict) or desc.get("version") != SHARE_VERSION:
        raise ValueError("a description of another version")
    if desc.get("fingerprint") != layout.fingerprint(page_size):
        raise ValueError("they hold another layout's pages")
    comps = desc.get("components")
    if not isinstance(comps, list) or len(comps) != len(fds):
        raise ValueError("the components and the descriptors do not match")
    names = {c.name.lower(): c for c in layout.components}
    out: dict[ComponentType, torch.Tensor] = {}
    for item, fd in zip(comps, fds):
        comp = names.get(item.get("component")) if isinstance(item, dict) else None
        pages, rb = (item.get("pages"), item.get("row_bytes")) if comp is not None else (0, 0)
        if comp is None or type(pages) is not int or pages < 0 or comp in out:
            raise ValueError(f"a component description {item!r} of no use here")
        if rb != row_bytes(layout.page_bytes(comp, page_size)):
            raise ValueError(f"{comp.name} pages of {rb} bytes, not this layout's")
        nbytes = pages * rb
        if os.fstat(fd).st_size < nbytes:
            raise ValueError(f"{comp.name}: the memory is smaller than {nbytes} bytes")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        # Populated now: a page's first touch here would otherwise fault in the middle of
        # a copy (every page of the pool, once per engine process).
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fd, max(nbytes, 1), flags, prot)
        raw = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
        with warnings.catch_warnings():  # read-only on purpose for loads: nothing writes it
            warnings.simplefilter("ignore", UserWarning)
            out[comp] = torch.from_numpy(raw).view(pages, rb)
    return out


class WritableHostPages:
    """The sidecar's host pages mapped read-write into an engine that copies its own
    stores into the pages the sidecar hands it (``store_begin``) and its loads out of the
    pages a pin names: ``pages[component]`` is ``[num_pages, row_bytes]`` uint8, a page's
    payload at ``payload_offset``. On a GPU they are page-locked here, so a kernel reads
    and writes them through their device-mapped address."""

    payload_offset = FRAME_BYTES

    def __init__(self, pages: dict[ComponentType, torch.Tensor], registered: list[int]) -> None:
        self.pages = pages
        self._registered = registered

    @classmethod
    def open(
        cls, endpoint: str, layout: ModelLayout, page_size: int, device: torch.device
    ) -> WritableHostPages | None:
        """Map the host pages of the sidecar at ``endpoint`` (a Unix socket); None (logged)
        when it shares none or they do not fit ``layout``."""
        if not endpoint.startswith("ipc://"):
            return None
        try:
            header, fds = receive_fds(fd_socket_path(endpoint[len("ipc://") :]))
        except OSError as exc:
            log.info("no shared host pages from the sidecar (%s)", exc)
            return None
        try:
            if not header:
                return None
            pages = _map(header, fds, layout, page_size, writable=True)
        except (ValueError, OSError) as exc:
            log.warning("the sidecar's shared host pages are unusable: %s", exc)
            return None
        finally:
            for fd in fds:
                os.close(fd)
        registered: list[int] = []
        if device.type == "cuda":
            for buf in pages.values():
                if not buf.numel():
                    continue
                rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
                if int(rc) != 0:
                    log.warning("cudaHostRegister of the shared host pages failed (%s)", rc)
                    _unregister(registered)
                    return None
                registered.append(buf.data_ptr())
        return cls(pages, registered)

    def close(self) -> None:
        _unregister(self._registered)

    def __del__(self) -> None:
        _unregister(self._registered)


def _unregister(ptrs: list[int]) -> None:
    for ptr in ptrs:
        with contextlib.suppress(Exception):
            torch.cuda.cudart().cudaHostUnregister(ptr)
    ptrs.clear()
