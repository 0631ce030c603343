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

import numpy as np

from hicache.controller.config import ControllerConfig
from hicache.controller.store.counters import Counters, Failure
from hicache.controller.store.fills import FillTracker, QueuedBackup
from hicache.controller.store.page_index import DiskState, HostState, PageEntry
from hicache.controller.store.page_store import PageStore
from hicache.controller.store.transfer_engine import EngineBuffers, TransferEngine, check_refs
from hicache.controller_api import (
    CompletedTransfer,
    ControllerError,
    PageKey,
    PageRef,
    TransferHandle,
)
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.layout import ModelLayout

log = logging.getLogger("hicache.controller.store.local")

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

    def claim(
        self,
        refs: Sequence[PageRef],
        pin_id: int,
        engine_id: str,
        buffers: EngineBuffers,
        layout: ModelLayout | None,
        inline: bool,
    ) -> list[PageEntry] | tuple[list[PageEntry], list[Future]] | bool | None:
        """Check a load of ``refs`` under pin ``pin_id``, and hold its pages when all are
        on host: their entries. Otherwise the entries and the reads that bring them to
        host, or (``inline``) None with nothing changed. False when the load fails at
        once (counted); raises ControllerError for one that can never succeed."""
        check_refs(refs, buffers, layout)
        if refs and self._store.faults is not None:
            for what, host_only in (("evict_before_load", False), ("evict_host_before_load", True)):
                if self._store.fault(what):
                    with self._store.lock:
                        self._store.drop_locked(refs[-1].key, host_only)
        entries: list[PageEntry] = []
        with self._store.lock:
            self._store.expire_pins_locked()
            rec = self._store.pins.get(pin_id)
            if rec is None:
                self.counters.fail(Failure.PIN_EXPIRED)
                return False
            if rec.engine_id != engine_id:
                raise ControllerError(f"pin {pin_id} belongs to engine {rec.engine_id!r}")
            skeys, index = rec.skeys, self._store.index
            for ref in refs:
                skey = ref.page_hash + _TAG[ref.component]
                if skey not in skeys:
                    raise ControllerError(
                        f"{ref.component.name} page {ref.page_hash.hex()} is not in pin "
                        f"{pin_id}; pin every page before loading it"
                    )
                e = index.get(skey)
                if e is None or not e.held:
                    self.counters.fail(Failure.PAGE_ABSENT)
                    return False
                entries.append(e)
            ready = HostState.READY
            if all(e.host_state is ready for e in entries):
                # All on host already: hold them now, in the same section.
                for e in entries:
                    self._store.hold_locked(e)
                return entries
            if inline:
                return None
            # Only once every page is known to be held: a doomed load reads nothing.
            fills: list[Future] = []
            for e in entries:
                if e.host_state is HostState.FILLING:
                    fills.append(e.fill)
                elif e.host_state is HostState.NONE:
                    fut = self._store.start_read_locked(e)
                    if fut is None:
                        return False
                    fills.append(fut)
        return (entries, fills)

    def pinned_host_pages(self, pin_id: int, keys: Sequence[PageKey]) -> np.ndarray | None:
        """See LocalController.pinned_host_pages."""
        store = self._store
        if any(p.shared is None for p in store.host.components.values()):
            return None
        out = np.full(len(keys), -1, dtype=np.int32)
        with store.lock:
            rec = store.pins.get(pin_id)
            if rec is None:
                return out
            for i, k in enumerate(keys):
                skey = k.page_hash + _TAG[k.component]
                e = store.index.get(skey) if skey in rec.skeys else None
                if e is not None and e.host_state is HostState.READY:
                    out[i] = e.host_page
        return out

    def served_directly_locked(self, entries: list[PageEntry], seconds: float) -> None:
        """An engine copied ``entries`` (pinned, on host) into its slots itself: count the
        transfer and keep the pages as any page that served a load-back."""
        store, nbytes = self._store, 0
        for e in entries:
            if e.host_state is HostState.READY:
                store.index.served(e)
                if store.remote is not None:
                    store.remote.on_served_locked(e)
                nbytes += store.host[e.component].page_bytes
        self.counters.transfer("host_to_device", len(entries), nbytes, max(seconds, 0.0))
        self.counters.inc("load", "engine_copied")  # not a load request: not in ("load", "ok")

    def to_device(
        self, refs: Sequence[PageRef], entries: list[PageEntry], buffers: EngineBuffers
    ) -> bool:
        """Copy held host pages into the engine's slots and release them; True once the
        bytes are there."""
        return self.start_to_device(refs, entries, buffers).finish()

    def start_to_device(
        self, refs: Sequence[PageRef], entries: list[PageEntry], buffers: EngineBuffers
    ) -> DeviceLoad:
        """Issue the copy of held host pages into the engine's slots without waiting for
        it; the pages stay held until the returned load's :meth:`DeviceLoad.finish`."""
        load = DeviceLoad(self, entries, buffers, time.perf_counter())
        try:
            plan = list(zip(entries, refs))
            for comp, group in _by_component(plan).items():
                if self._store.fault("copy_to_device"):
                    raise RuntimeError("injected host-to-device copy failure")
                load.events.append(
                    self.transfer.start_to_device(
                        comp,
                        buffers,
                        [e.host_page for e, _ in group],
                        [r.device_index for _, r in group],
                    )
                )
                load.nbytes += len(group) * self._store.host[comp].page_bytes
        except Exception as exc:
            load.failed(exc)
        return load


class DeviceLoad:
    """A load's copy into the engine's slots, issued: :meth:`done` says (never blocking)
    whether it has ended, :meth:`finish` waits for it, releases the host pages and
    returns whether every byte arrived."""

    def __init__(
        self, copies: PageCopies, entries: list[PageEntry], buffers: EngineBuffers, t0: float
    ) -> None:
        self._copies = copies
        self._entries = entries
        # The engine's tensors stay referenced while the copy may write into them: a
        # sidecar unmaps an engine's memory once nothing holds it (a session that ended).
        self._buffers: EngineBuffers | None = buffers
        self._t0 = t0
        self.events: list[Any] = []  # one per component; None: a CPU copy, done already
        self.nbytes = 0
        self._error: Exception | None = None

    def failed(self, exc: Exception) -> None:
        if self._error is None:
            self._error = exc
            log.error("load copy failed: %s", exc)
            self._copies.counters.fail(Failure.COPY_ERROR)

    def done(self) -> bool:
        try:
            return all(e is None or e.query() for e in self.events)
        except Exception as exc:  # a device error: the copy has ended, badly
            self.failed(exc)
            return True

    def finish(self) -> bool:
        # Every copy issued has ended before its pages are released, a failed load too.
        for e in self.events:
            if e is not None:
                try:
                    e.synchronize()
                except Exception as exc:
                    self.failed(exc)
        self._buffers = None
        ok = self._error is None
        store = self._copies._store
        with store.lock:
            for e in self._entries:
                store.unhold_locked(e)
                if ok:
                    store.index.served(e)
                    if store.remote is not None:
                        store.remote.on_served_locked(e)
        if ok:
            counters = self._copies.counters
            seconds = time.perf_counter() - self._t0
            counters.transfer("host_to_device", len(self._entries), self.nbytes, seconds)
            counters.inc("load", "ok")
        return ok


def _by_component(
    plan: list[tuple[PageEntry, PageRef]],
) -> dict[ComponentType, list[tuple[PageEntry, PageRef]]]:
    out: dict[ComponentType, list[tuple[PageEntry, PageRef]]] = {}
    for item in plan:
        out.setdefault(item[1].component, []).append(item)
    return out
