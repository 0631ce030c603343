"""Device ↔ host page copies of a :class:`LocalController`: a backup's copies issued in
parts, each part's host pages booked under the store's lock and published when its copy
ends, and a load's copy of held host pages into an engine's slots.

The controller checks the request (the engine, its refs) and, for a load, holds the
pages; this module books, copies, counts and releases.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from hicache.controller.config import ControllerConfig
from hicache.controller.counters import Counters, Failure
from hicache.controller.fills import FillTracker, QueuedBackup
from hicache.controller.page_index import DiskState, HostState, PageEntry
from hicache.controller.page_store import PageStore
from hicache.controller.transfer import EngineBuffers, TransferEngine
from hicache.controller_api import CompletedTransfer, ControllerError, PageRef, TransferHandle
from hicache.keys import HASH_BYTES
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.layout import ModelLayout

log = logging.getLogger("hicache.controller.local")

# PageKey.storage_key() without building a PageKey: this runs once per page per call.
_TAG = {c: bytes((int(c),)) for c in ComponentType}


class PageCopies:
    """The copies between engines' device pools and the host pool of one page store."""

    def __init__(
        self,
        store: PageStore,
        fills: FillTracker,
        transfer: TransferEngine,
        counters: Counters,
        config: ControllerConfig,
    ) -> None:
        self._store = store
        self._fills = fills
        self.transfer = transfer
        self.counters = counters
        self.config = config

    def backup(
        self, refs: Sequence[PageRef], buffers: EngineBuffers, ready_event: Any
    ) -> TransferHandle:
        """Copy ``refs``' device pages into host pages (see LocalController.backup)."""
        self._fills.reap(block=False)
        # The copies are issued in parts of ``backup_chunk_bytes``: on a GPU the copy of
        # one part runs while the next part's pages are booked, so the bookkeeping hides
        # behind the copy instead of coming before it. Each part is published (marked
        # ready) on its own, when its copy ends; its pages share one future.
        chunk_bytes = self.config.backup_chunk_bytes or sys.maxsize
        page_bytes = {c: p.page_bytes for c, p in self._store.host.components.items()}
        if self.config.backup_chunk_bytes and len(page_bytes) > 1:
            # One component after the other, so that a part is mostly one copy: each copy
            # a part issues costs as much host time as booking dozens of pages.
            refs = [r for c in ComponentType for r in refs if r.component is c]
        fills: list[Future] = []
        all_held = True
        seen: set[bytes] = set()
        i, n = 0, len(refs)
        while i < n:
            plan: list[tuple[PageEntry, PageRef]] = []
            fill: Future = Future()
            t0 = time.perf_counter()
            planned = 0
            with self._store.lock:
                while i < n and planned < chunk_bytes:
                    ref = refs[i]
                    i += 1
                    skey = ref.page_hash + _TAG[ref.component]
                    if skey in seen:
                        continue
                    seen.add(skey)
                    e = self._store.index.get(skey)
                    if e is not None and e.held:
                        self._store.index.touch(e)
                        self.counters.inc("backup", "deduped_pages")
                        if e.host_state is HostState.FILLING and e.disk_state is DiskState.NONE:
                            # Held only once another copy into it succeeds: wait for it.
                            fills.append(e.fill)
                        continue
                    page = self._store.alloc_host_locked(ref.component)
                    if page is None:
                        self.counters.fail(Failure.HOST_FULL)
                        all_held = False
                        continue
                    if e is None:
                        e = self._store.index.create(ref.component, ref.page_hash, ref.parent_hash)
                    self._fills.begin_locked(e, page, fill)
                    plan.append((e, ref))
                    planned += page_bytes[ref.component]
            if not plan:
                continue
            if not self._issue_backup(plan, fill, buffers, ready_event, t0):
                all_held = False
                break
            fills.append(fill)
            if i < n:  # publish the parts whose copies ended while this one was booked
                self._fills.reap(block=False)
        if not fills:
            return CompletedTransfer(all_held)
        return self._fills.handle(fills, all_held, self.config.load_timeout_s)

    def _issue_backup(
        self,
        plan: list[tuple[PageEntry, PageRef]],
        fill: Future,
        buffers: EngineBuffers,
        ready_event: Any,
        t0: float,
    ) -> bool:
        """Copy the device pages of ``plan`` into their host pages: published here when
        the copy is done on return (CPU), queued until its events complete (CUDA). False,
        with the plan's host pages given back, when a copy could not be issued."""
        events = []
        try:
            for comp, group in _by_component(plan).items():
                if self._store.fault("copy_to_host"):
                    raise RuntimeError("injected device-to-host copy failure")
                events.append(
                    self.transfer.to_host(
                        comp,
                        buffers,
                        [r.device_index for _, r in group],
                        [e.host_page for e, _ in group],
                        ready_event,
                    )
                )
        except Exception as exc:
            log.error("backup copy failed: %s", exc)
            self.counters.fail(Failure.COPY_ERROR)
            # The copies of this part's other components may be running still: their host
            # pages go back only once they end, or a disk read given one of those pages
            # could be overwritten by a late copy.
            for ev in events:
                if ev is not None:
                    try:
                        ev.synchronize()
                    except Exception as sync_exc:  # a broken device: nothing runs any more
                        log.error("waiting for a backup copy failed: %s", sync_exc)
            with self._store.lock:
                self._fills.abort_locked(plan, fill)
            return False
        queued = QueuedBackup(plan, [ev for ev in events if ev is not None], t0, fill, buffers)
        with self._store.lock:
            if queued.events:
                self._fills.queue_locked(queued)
            else:
                self._fills.publish_locked(queued)
        return True

    def to_device(
        self, refs: Sequence[PageRef], entries: list[PageEntry], buffers: EngineBuffers
    ) -> bool:
        t0 = time.perf_counter()
        ok = False
        nbytes = 0
        try:
            plan = list(zip(entries, refs))
            for comp, group in _by_component(plan).items():
                if self._store.fault("copy_to_device"):
                    raise RuntimeError("injected host-to-device copy failure")
                self.transfer.to_device(
                    comp,
                    buffers,
                    [e.host_page for e, _ in group],
                    [r.device_index for _, r in group],
                )
                nbytes += len(group) * self._store.host[comp].page_bytes
            ok = True
        except Exception as exc:
            log.error("load copy failed: %s", exc)
            self.counters.fail(Failure.COPY_ERROR)
        finally:
            with self._store.lock:
                for e in entries:
                    self._store.unhold_locked(e)
                    if ok:
                        self._store.index.served(e)
                        if self._store.remote is not None:
                            self._store.remote.on_served_locked(e)
        if ok:
            self.counters.transfer("host_to_device", len(entries), nbytes, time.perf_counter() - t0)
            self.counters.inc("load", "ok")
        return ok


def _by_component(
    plan: list[tuple[PageEntry, PageRef]],
) -> dict[ComponentType, list[tuple[PageEntry, PageRef]]]:
    out: dict[ComponentType, list[tuple[PageEntry, PageRef]]] = {}
    for item in plan:
        out.setdefault(item[1].component, []).append(item)
    return out


def check_refs(refs: Sequence[PageRef], buffers: EngineBuffers, layout: ModelLayout | None) -> None:
    """Raise ControllerError unless every ref names a component of ``layout``, a page or
    slot inside the engine's ``buffers``, well-formed hashes, and no device page twice."""
    comps = layout.components if layout else ()
    caps = {c: buffers.capacity(c) for c in comps}
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
    # One device page holds one page of one prefix: two pages copied into it would
    # leave a blend of both, two hashes read from it would store one prefix's bytes
    # under another's hash. (The same ref twice is one page.)
    named: dict[tuple[ComponentType, int], bytes] = {}
    for ref in refs:
        slot = (ref.component, ref.device_index)
        seen = named.setdefault(slot, ref.page_hash)
        if seen != ref.page_hash:
            raise ControllerError(
                f"{ref.component.name} device page/slot {ref.device_index} is named by "
                "two different pages in one request"
            )
