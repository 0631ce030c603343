"""An engine's own KV blocks to and from the sidecar's host pages, one copy each way.

For an engine whose KV cache lives in tensors of its own (vLLM's blocks), the sidecar's
host pool is mapped read-write into the worker (``SidecarController.map_host_pages``) and
the worker moves the bytes itself, once:

* a **store** asks the sidecar for host pages (``store_begin``: a page per block not held
  yet), copies each block's segments (every layer's part of it) straight into its page
  (:class:`hicache.kernels.SegmentCopy`: one kernel launch per group on a GPU, numpy
  assignments by runs of consecutive sources and ``memmove`` on a CPU), and commits them
  (``store_commit``): only then can a lookup find them. A store that fails is given
  back, and nothing of it was visible. A store known a step before it runs has its
  pages asked for then (:meth:`EngineBlocks.prebook`): the ``store_begin`` answers are
  in by the time it copies, so no round trip to the sidecar precedes its first copy;
* a **load** pins the pages with their host page numbers, has the sidecar read the ones
  that are only on disk (or the remote tier) into host pages first, copies each page's
  segments into its block, and unpins, telling the sidecar the copy was served;
* a **load handed its pages** (:meth:`EngineBlocks.load_handed`: another session of the
  engine pinned them and named their host pages) copies at once, its own pin of them
  sent meanwhile and made only while that pin still holds; a refused pin voids the copy;
* a **layer-wise load** (:meth:`EngineBlocks.start_layer_load`) pins the same way, then
  starts one copy per layer (that layer's segments of every block), in layer order, and
  returns at once: :meth:`BlockLayerLoad.wait` makes the caller's stream wait for one
  layer's copy (on a CPU a copy thread copies layer after layer), so that the layers the
  engine computes first are there first.

No staging buffer sits between the engine's memory and the host pool. The engine writes
only pages the sidecar handed it for a store in flight; a page becomes visible only at
its commit; an engine that dies mid-store leaves pages that the sidecar takes back when
its lease lapses.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from hicache import PageKey
from hicache.controller.client import SidecarController
from hicache.integrations.engine_block_layers import BlockLayerLoad, wait_all
from hicache.integrations.engine_block_stores import BlockStores
from hicache.kernels import Segment, SegmentCopy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HandedPages:
    """A load's pages as another session of the engine pinned them: the pin, the sidecar
    instance that issued it (``SidecarController.sidecar_instance``), its deadline
    (monotonic seconds) and the host page of each page (-1: not on host)."""

    pin_id: int
    instance: int
    deadline: float
    host_pages: tuple[int, ...]


@dataclass(frozen=True)
class BlockSegment:
    """Bytes ``[src_offset, +nbytes)`` of a block row of ``tensor`` are bytes
    ``[dst_offset, +nbytes)`` of the block's page payload."""

    tensor: torch.Tensor
    src_offset: int
    nbytes: int
    dst_offset: int


class EngineBlocks(BlockStores):
    """One copy per byte between an engine's block tensors and the sidecar's host pages.

    ``groups[g]`` are the segments of a block of group ``g`` (a page holds one block of
    one group). Every page is a page of ``component`` in the sidecar's layout.
    """

    def __init__(
        self,
        client: SidecarController,
        groups: Sequence[Sequence[BlockSegment]],
        device: torch.device,
        component,
        chunk_bytes: int | None = None,
    ) -> None:
        """``chunk_bytes``: how much of a store or a load is handed out, copied and
        committed at a time (see :meth:`store`); by default 64 MiB on a GPU, and on a
        CPU as many pages as the sidecar answers at once on its I/O thread
        (``client.io_part_pages``), with no smaller first part: there the copy runs in
        the calling thread, so parts overlap nothing of the engine's and only add
        messages (on the 2-core development box, a 256 MiB store of 1 MiB pages took 0.71
        of a memcpy in parts of 64 MiB and 0.96 whole)."""
        self.client = client
        self.groups = [list(g) for g in groups]
        self.device = device
        self.component = component
        self._host = None
        self._copies: list[SegmentCopy | None] = []
        page_bytes = max((sum(s.nbytes for s in g) for g in self.groups), default=1)
        if chunk_bytes is None and device.type == "cuda":
            chunk_bytes = 64 << 20
        if chunk_bytes is None:
            self.chunk_pages = self._first_pages = client.io_part_pages
        else:
            self.chunk_pages = max(1, chunk_bytes // max(page_bytes, 1))
            # The first part an eighth of the others: the first copy starts early.
            self._first_pages = self.chunk_pages // 8
        self._layer_copies: dict[str, SegmentCopy] = {}
        self._layers_host = None
        self._layer_thread: ThreadPoolExecutor | None = None  # CPU layer-wise loads
        self.handed_voided = 0  # load_handed copies made again: the pin had let go
        self.begins_on_path = 0  # store_begin requests a store sent itself (not prebooked)
        self.prebook_missed = 0  # prebooked parts asked for again: stale, or failed

    def _copies_now(self) -> list[SegmentCopy | None] | None:
        """The group copies over the current session's host pages (built again after a
        reconnect); None when the sidecar's pages are not mapped here."""
        host = self.client.map_host_pages(self.device)
        if host is None:
            return None
        if host is not self._host:
            rows = host.pages[self.component]
            self._copies = [
                SegmentCopy(
                    [Segment(s.tensor, s.src_offset, s.nbytes, s.dst_offset) for s in g],
                    rows,
                    payload_offset=host.payload_offset,
                )
                if g
                else None
                for g in self.groups
            ]
            self._host = host
        return self._copies

    def warm(self) -> None:
        """Compile the copies' kernels now, both ways (on a GPU; :meth:`SegmentCopy.warm`),
        so that the first store or load costs what later ones do; nothing while the host
        pages are not mapped here. A failure is logged: the copies still run without it."""
        if self.device.type != "cuda":  # nothing to compile: numpy and memmove
            return
        try:
            for copy in self._copies_now() or []:
                if copy is not None:
                    copy.warm()
        except Exception as exc:
            log.warning("the copy kernels could not be prepared ahead: %s", exc)

    @property
    def available(self) -> bool:
        """Whether the host pages are mapped here (else the caller takes another path)."""
        return self._copies_now() is not None

    def _start(
        self, copies: list, groups: np.ndarray, blocks: np.ndarray, pages: np.ndarray,
        to_host: bool,
    ) -> list:  # fmt: skip
        """Begin the copies of one chunk, a launch per group; their events."""
        if groups.size and groups[0] == groups[-1] and (groups == groups[0]).all():
            mine = pages >= 0  # one group (a model without hybrid groups): one launch
            if mine.all():
                return [copies[int(groups[0])].start(blocks, pages, to_host)]
            return [copies[int(groups[0])].start(blocks[mine], pages[mine], to_host)]
        events = []
        for g in np.unique(groups).tolist():
            mine = (groups == g) & (pages >= 0)
            if mine.any():
                events.append(copies[g].start(blocks[mine], pages[mine], to_host))
        return events

    def _parts(self, n: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` of each part of a store of ``n`` pages: ``chunk_pages`` each, but
        in parts the first one an eighth of that, so that the first copy starts early and
        the pipeline fills (a part's pages are handed out while the one before is copied)."""
        first = max(1, self._first_pages)
        bounds = [0, min(n, first)]
        while bounds[-1] < n:
            bounds.append(min(n, bounds[-1] + self.chunk_pages))
        return list(itertools.pairwise(bounds))

    def load(
        self, hashes: Sequence[bytes], groups: Sequence[int], blocks: Sequence[int],
        pin_ttl_s: float, timeout_s: float,
    ) -> bool:  # fmt: skip
        """Copy the pages ``hashes`` into block ``blocks[i]`` of group ``groups[i]``;
        True when every byte arrived (else the blocks are undefined: recompute them).
        In parts (as :meth:`store`), the next part pinned while this one's copy runs."""
        copies = self._copies_now()
        if copies is None:
            return False
        keys = [PageKey(self.component, h) for h in hashes]
        g_arr, b_arr = np.asarray(groups), np.asarray(blocks, dtype=np.int64)
        parts = self._parts(len(keys))
        if len(parts) == 1:
            return self._load_whole(copies, keys, g_arr, b_arr, pin_ttl_s, timeout_s)
        pending: list = []  # (pin, events, started)
        asked = self.client.send_pin(keys[parts[0][0] : parts[0][1]], pin_ttl_s)
        ok = False
        try:
            for i, (lo, hi) in enumerate(parts):
                pin = self._on_host(asked, keys[lo:hi], pin_ttl_s, timeout_s)
                asked = None
                if pin is None:
                    return False
                if i + 1 < len(parts):  # the sidecar pins the next part meanwhile
                    nlo, nhi = parts[i + 1]
                    asked = self.client.send_pin(keys[nlo:nhi], pin_ttl_s)
                t0 = time.perf_counter()
                pages = np.asarray(pin.host_pages, dtype=np.int64)
                try:
                    events = self._start(copies, g_arr[lo:hi], b_arr[lo:hi], pages, False)
                except Exception as exc:
                    log.error("load from the shared host pages failed: %s", exc)
                    self.client.unpin(pin)
                    return False
                while pending:
                    done, done_events, started = pending[-1]
                    wait_all(done_events)
                    pending.pop()
                    self.client.unpin(done, loaded_s=time.perf_counter() - started)
                pending.append((pin, events, t0))
            ok = True
            return True
        finally:
            if asked is not None:  # a part pinned and not copied: let it go
                unused = self.client.receive_pin(asked)
                if unused is not None:
                    self.client.unpin(unused)
            for done, done_events, started in pending:
                wait_all(done_events, quiet=not ok)
                loaded = time.perf_counter() - started if ok else None
                self.client.unpin(done, loaded_s=loaded)

    def _load_whole(
        self, copies: list, keys: list[PageKey], groups: np.ndarray, blocks: np.ndarray,
        pin_ttl_s: float, timeout_s: float,
    ) -> bool:  # fmt: skip
        """:meth:`load` of one part: pinned (the answer names the host pages), copied,
        unpinned without waiting for the answer."""
        pin = self._on_host(None, keys, pin_ttl_s, timeout_s)
        if pin is None:
            return False
        t0 = time.perf_counter()
        pages = np.asarray(pin.host_pages, dtype=np.int64)
        try:
            wait_all(self._start(copies, groups, blocks, pages, False))
        except Exception as exc:
            log.error("load from the shared host pages failed: %s", exc)
            self.client.unpin(pin)
            return False
        self.client.unpin(pin, loaded_s=time.perf_counter() - t0)
        return True

    def load_handed(
        self, hashes: Sequence[bytes], groups: Sequence[int], blocks: Sequence[int],
        handed: HandedPages, pin_ttl_s: float, timeout_s: float,
    ) -> bool:  # fmt: skip
        """:meth:`load` of pages another session of this engine has pinned and named
        (``handed``: vLLM's scheduler pins a load's pages when it plans it): the copy
        starts at once, while this session's pin of the same pages goes out, made only if
        ``handed.pin_id`` still holds once it is (so the pages stayed put throughout). A
        pin that fails or names other pages voids the copy: the load is made again as
        :meth:`load` makes it (a page gone is a miss, never other bytes)."""
        copies = self._copies_now()
        session = self.client.mapped_session()  # (generation, instance) of these pages
        pages = np.asarray(handed.host_pages, dtype=np.int64)
        if copies is None or session is None or session[1] != handed.instance:
            return self.load(hashes, groups, blocks, pin_ttl_s, timeout_s)
        keys = [PageKey(self.component, h) for h in hashes]
        asked = self.client.send_pin(keys, pin_ttl_s, under=handed.pin_id)
        if asked is None:
            return self.load(hashes, groups, blocks, pin_ttl_s, timeout_s)
        t0 = time.perf_counter()
        g_arr, b_arr = np.asarray(groups), np.asarray(blocks, dtype=np.int64)
        events, copied = [], True
        try:
            events = self._start(copies, g_arr, b_arr, pages, False)
        except Exception as exc:
            log.error("load from the shared host pages failed: %s", exc)
            copied = False
        pin = self.client.receive_pin(asked)  # its answer came while the copy ran
        try:
            wait_all(events)
        except Exception as exc:
            log.error("load from the shared host pages failed: %s", exc)
            copied = False
        held = (
            pin is not None
            and pin.generation == session[0]
            and pin.host_pages is not None
            and np.array_equal(np.asarray(pin.host_pages, dtype=np.int64), pages)
        )
        if pin is not None:
            self.client.unpin(pin, loaded_s=time.perf_counter() - t0 if held else None)
        if not held:
            self.handed_voided += 1
            return self.load(hashes, groups, blocks, pin_ttl_s, timeout_s)
        return copied

    def _layer_copies_now(
        self, layers: dict[str, tuple[int, Sequence[int]]]
    ) -> dict[str, SegmentCopy] | None:
        """Per layer name, the copy of that layer's segments (``layers[name]``: its group
        and the indices of its segments there) over the current session's host pages."""
        host = self.client.map_host_pages(self.device)
        if host is None:
            return None
        if host is not self._layers_host:
            rows = host.pages[self.component]
            self._layer_copies = {
                name: SegmentCopy(
                    [
                        Segment(s.tensor, s.src_offset, s.nbytes, s.dst_offset)
                        for s in (self.groups[g][i] for i in idx)
                    ],
                    rows,
                    payload_offset=host.payload_offset,
                )
                for name, (g, idx) in layers.items()
            }
            self._layers_host = host
        return self._layer_copies

    def start_layer_load(
        self, hashes: Sequence[bytes], groups: Sequence[int], blocks: Sequence[int],
        layers: dict[str, tuple[int, Sequence[int]]], pin_ttl_s: float, timeout_s: float,
    ) -> BlockLayerLoad:  # fmt: skip
        """:meth:`load` started layer by layer (``layers``: each layer's group and
        segment indices, in the order the engine computes them) without waiting for the
        copies. A load that fails before its copies (no mapping, a page gone) fails every
        layer."""
        copies = self._layer_copies_now(layers)
        keys = [PageKey(self.component, h) for h in hashes]
        pin = None if copies is None else self._on_host(None, keys, pin_ttl_s, timeout_s)
        load = BlockLayerLoad(self.client, pin, list(layers), self.device)
        if pin is None:
            return load
        g_arr, b_arr = np.asarray(groups), np.asarray(blocks, dtype=np.int64)
        pages = np.asarray(pin.host_pages, dtype=np.int64)
        work = [(name, *_mine(g_arr, b_arr, pages, g)) for name, (g, _) in layers.items()]

        def copy(name: str, b: np.ndarray, p: np.ndarray) -> object:
            return copies[name].start(b, p, False) if b.size else None

        if self.device.type != "cuda":
            if self._layer_thread is None:
                self._layer_thread = ThreadPoolExecutor(1, thread_name_prefix="hicache-layers")
            self._layer_thread.submit(load.run, work, copy)
        else:
            load.run(work, copy)  # issued on the copy's stream, each layer with its event
        return load

    def _on_host(self, asked, keys: list[PageKey], ttl_s: float, timeout_s: float):
        """The pin of ``keys`` sent as ``asked`` (None: pinned now), once all its pages are
        on host: the ones that are not (disk, remote) are read first; None when a page is
        gone or cannot be brought to host."""
        pin = self.client.receive_pin(asked) if asked is not None else self.client.pin(keys, ttl_s)
        if pin is not None and pin.host_pages is not None:
            missing = [k for k, p in zip(keys, pin.host_pages) if p < 0]
            if not missing:
                return pin
            # Pinned pages stay put while the sidecar reads the missing ones to host.
            read = self.client.prefetch(missing).wait(timeout_s)
            self.client.unpin(pin)
            pin = self.client.pin(keys, ttl_s) if read else None
            if pin is not None and pin.host_pages is not None and min(pin.host_pages) >= 0:
                return pin
        if pin is not None:
            self.client.unpin(pin)
        return None


def _mine(groups: np.ndarray, blocks: np.ndarray, pages: np.ndarray, g: int):
    """The blocks of group ``g`` and their pages."""
    mine = groups == g
    return blocks[mine], pages[mine]
