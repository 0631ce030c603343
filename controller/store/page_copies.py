"""Device ↔ host page copies of a :class:`LocalController`: a backup's copies issued in
parts, each part's host pages booked by the page store and published when its copy ends,
and a load's copy of held host pages into an engine's slots.

The controller checks the request (the engine, its refs) and claims a load's pages; this
module copies and counts, and the page store books, publishes and releases the pages
(:class:`~hicache.controller.store.copy_ops.CopyOps`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from hicache.controller.config import ControllerConfig
from hicache.controller.store.counters import Counters, Failure
from hicache.controller.store.fills import QueuedBackup
from hicache.controller.store.layer_copies import LayerCopies
from hicache.controller.store.load_reads import CopyAsRead, geometry
from hicache.controller.store.page_index import PageEntry
from hicache.controller.store.page_store import PageStore
from hicache.controller.store.transfer_engine import EngineBuffers, LayerPlan, TransferEngine
from hicache.controller_api import CompletedTransfer, LayerGroups, PageRef, TransferHandle
from hicache.types import ComponentType

log = logging.getLogger("hicache.controller.store.local")


class PageCopies:
    """The copies between engines' device pools and the host pool of one page store."""

    def __init__(
        self,
        store: PageStore,
        transfer: TransferEngine,
        counters: Counters,
        config: ControllerConfig,
    ) -> None:
        self._store = store
        self.transfer = transfer
        self.counters = counters
        self.config = config

    def backup(
        self,
        refs: Sequence[PageRef],
        buffers: EngineBuffers,
        ready_event: Any,
        tenant: str | None = None,
    ) -> TransferHandle:
        """Copy ``refs``' device pages into host pages (see LocalController.backup)."""
        store = self._store
        store.reap_backups(block=False)
        # The copies are issued in parts of ``backup_chunk_bytes``: on a GPU the copy of
        # one part runs while the next part's pages are booked, so the bookkeeping hides
        # behind the copy instead of coming before it. Each part is published (marked
        # ready) on its own, when its copy ends; its pages share one future.
        chunk_bytes = self.config.backup_chunk_bytes or sys.maxsize
        if self.config.backup_chunk_bytes and len(store.host_page_bytes()) > 1:
            # One component after the other, so that a part is mostly one copy: each copy
            # a part issues costs as much host time as booking dozens of pages.
            refs = [r for c in ComponentType for r in refs if r.component is c]
        fills: list[Future] = []
        all_held = True
        seen: set[bytes] = set()
        i, n = 0, len(refs)
        while i < n:
            fill: Future = Future()
            t0 = time.perf_counter()
            part = store.book_backup(refs, i, chunk_bytes, seen, fill, tenant)
            i = part.end
            fills += part.waits
            all_held = all_held and part.all_held
            if not part.plan:
                continue
            if not self._issue_backup(part.plan, fill, buffers, ready_event, t0):
                all_held = False
                break
            fills.append(fill)
            if i < n:  # publish the parts whose copies ended while this one was booked
                store.reap_backups(block=False)
        if not fills:
            return CompletedTransfer(all_held)
        return store.fill_handle(fills, all_held, self.config.load_timeout_s)

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
            self._store.abort_backup(plan, fill)
            return False
        events = [ev for ev in events if ev is not None]
        self._store.backup_copied(QueuedBackup(plan, events, t0, fill, buffers))
        return True

    def release(self, entries: list[PageEntry], served: bool) -> None:
        """A load's copy has ended: its host pages are released (see DeviceLoad)."""
        self._store.release_load(entries, served)

    def warm(self, buffers: EngineBuffers) -> None:
        """Prepare the copies into and out of ``buffers`` (an engine registering), so that
        its first load costs what later ones do."""
        self.transfer.warm(buffers)
        if self.config.disk_load_direct and buffers.device.type == "cpu":
            geometry(self, buffers)

    def copy_as_read(self, refs: Sequence[PageRef], buffers: EngineBuffers) -> CopyAsRead | None:
        """How a load's disk reads reach the engine's slots (see :mod:`.load_reads`), to
        hand to the load's claim and to :meth:`to_device`: straight into CPU slots
        (``disk_load_direct``); else copied as read for a load of pages of
        ``copy_as_read_min_page_bytes`` or more; None: copied when its reads have ended.

        Copying as read overlaps the copies with the reads still to come, but each read
        then issues its own copy, and a reader's copy holds the interpreter's lock for a
        share of each page that grows as pages shrink. On the 2-core development box (in
        one process, the two ways taking turns, load averages 3-5): 32 KiB pages loaded at
        0.52-0.66 GB/s copied as read against 0.61-0.83 at the end, 64 KiB alike (1.15,
        1.18), 256 KiB at 1.32-1.46 against 0.99-1.16, 1 MiB and 8 MiB within the noise
        (2.03 / 2.26, 1.39 / 1.31), for 10-15% more CPU time from 256 KiB up."""
        if not refs:
            return None
        page_bytes = self._store.host_page_bytes()
        least = self.config.copy_as_read_min_page_bytes * len(refs)
        large = sum(page_bytes[r.component] for r in refs) >= least
        if self.config.disk_load_direct and buffers.device.type == "cpu":
            slots = geometry(self, buffers)
            if slots:
                return CopyAsRead(self, refs, buffers, large, slots)
        return CopyAsRead(self, refs, buffers) if large else None

    @contextlib.contextmanager
    def copying_as_read(
        self, refs: Sequence[PageRef], buffers: EngineBuffers
    ) -> Iterator[CopyAsRead | None]:
        """:meth:`copy_as_read`, closed on leaving (every copy it issued has ended)."""
        early = self.copy_as_read(refs, buffers)
        try:
            yield early
        finally:
            if early is not None:
                early.close()

    def to_device(
        self,
        refs: Sequence[PageRef],
        entries: list[PageEntry],
        buffers: EngineBuffers,
        early: CopyAsRead | None = None,
    ) -> bool:
        """Copy held host pages into the engine's slots and release them; True once the
        bytes are there. Pages ``early`` copied already are not copied again."""
        return self.start_to_device(refs, entries, buffers, early).finish()

    def start_to_device(
        self,
        refs: Sequence[PageRef],
        entries: list[PageEntry],
        buffers: EngineBuffers,
        early: CopyAsRead | None = None,
    ) -> DeviceLoad:
        """Issue the copy of held host pages into the engine's slots without waiting for
        it (but those ``early`` copied: its copies are waited for with these); the pages
        stay held until the returned load's :meth:`DeviceLoad.finish`."""
        load = DeviceLoad(self, entries, buffers, time.perf_counter())
        page_bytes = self._store.host_page_bytes()
        plan = list(zip(entries, refs))
        if early is not None:
            done = early.close()
            load.events += done.events
            load.nbytes += done.nbytes
            if done.error is not None:
                load.failed(done.error)
            if done.copied:
                plan = [(e, r) for e, r in plan if e.skey not in done.copied]
        try:
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
                load.nbytes += len(group) * page_bytes[comp]
        except Exception as exc:
            load.failed(exc)
        return load

    def start_layers_to_device(
        self,
        refs: Sequence[PageRef],
        entries: list[PageEntry],
        buffers: EngineBuffers,
        groups: LayerGroups,
    ) -> LayerCopies:
        """:meth:`start_to_device` group of layers by group (a layer-wise load); the pages
        stay held until the returned load's ``finish()``."""
        t0 = time.perf_counter()
        page_bytes = self._store.host_page_bytes()
        plan: LayerPlan = {}
        for comp, group in _by_component(list(zip(entries, refs))).items():
            plan[comp] = ([e.host_page for e, _ in group], [r.device_index for _, r in group])
        nbytes = sum(len(src) * page_bytes[c] for c, (src, _) in plan.items())

        def finished(ok: bool) -> None:
            self.release(entries, ok)
            if ok:
                seconds = time.perf_counter() - t0
                self.counters.transfer("host_to_device", len(entries), nbytes, seconds)
                self.counters.inc("load", "ok")
            else:
                self.counters.fail(Failure.COPY_ERROR)

        faults = self._store.faults
        fault = None
        if faults is not None:
            size = groups.size

            def fault(g: int) -> bool:
                return faults.take_layer(g * size, (g + 1) * size)

        return self.transfer.start_layers_to_device(buffers, plan, groups, finished, fault)


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
        self._copies.release(self._entries, ok)
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
