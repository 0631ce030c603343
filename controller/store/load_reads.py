"""Where a load's disk reads put their pages besides host pages: the engine's slots.

A load of pages that are only on disk reads them on the reader threads. Two ways reach
the engine's slots sooner than a copy of every page once the last read has ended:

* **Straight into the slots.** An engine whose pools are in memory the controller can
  write (a CPU engine's pools, mapped by the sidecar) has each page read from the LMDB
  map into its slot, one copy, and checked there (``page_codec.verify_runs``: the
  checksum over the bytes as they lie in the slot); the page stays on disk only. Such a
  pool is host memory already, so a second copy of what the engine now holds would fill
  the host tier with pages the engine has. On with ``disk_load_direct`` (the default);
  the cost: the next load of such a page reads disk again. Off, a page read is kept on
  host (two copies: LMDB map -> host page -> slot).
* **Copied as read.** Otherwise each read's pages are copied on into the slots from the
  reader as the read ends, beside the reads still to come, for loads of pages of
  ``copy_as_read_min_page_bytes`` or more.

Pages a load names twice, pages on host or being read by another request, and pages of
a write-back queue are copied from host when the reads have ended, as before.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hicache.controller.store.counters import Failure
from hicache.controller.store.page_codec import ReadStatus
from hicache.controller.store.page_entry import TAGS as _TAG
from hicache.controller.store.page_index import DiskState, PageEntry
from hicache.controller.store.transfer_engine import EngineBuffers
from hicache.controller_api import PageRef
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.controller.store.host_pool import HostComponentPool
    from hicache.kernels import PreparedTransfer

_OK = ReadStatus.OK
_ON_DISK = DiskState.READY
_GEOMETRY: weakref.WeakKeyDictionary[EngineBuffers, dict] = weakref.WeakKeyDictionary()
_GEOMETRY_LOCK = threading.Lock()


class SlotGeometry:
    """Where the bytes of a stored page go in one engine slot: spans ``(memory, at, item
    stride, nbytes, payload offset)``, in payload order, covering the payload exactly
    (rows next to each other on both sides merged)."""

    def __init__(self, spans: list[tuple], keep: list[Any]) -> None:
        self.spans = spans
        self._keep = keep  # the engine's storages, mapped while this is used

    @classmethod
    def of(cls, plan: PreparedTransfer, host: HostComponentPool) -> SlotGeometry | None:
        """The geometry of ``plan`` (host pages -> CPU slots) for ``host``'s pages; None
        where it is not one run per row of writable CPU memory (nothing read straight)."""
        row0 = host.row(0).ctypes.data
        row_stride = host.rows.strides[0]
        found: list[tuple] = []  # (payload offset, storage index, at, stride, nbytes)
        keep: list[Any] = []
        mems: list[memoryview] = []
        for copy in plan.copies:
            src, dst = copy.src, copy.dst
            es = src.tensor.element_size()
            t = dst.tensor
            if t.device.type != "cpu" or t.element_size() != es:
                return None
            if src.item_stride * es != row_stride:
                return None
            storage = t.untyped_storage()
            keep.append(storage)
            raw = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
            mems.append(memoryview(raw).cast("B"))
            base = t.data_ptr() - storage.data_ptr()
            for a in range(copy.rows_a):
                for b in range(copy.rows_b):
                    off = src.tensor.data_ptr() + (a * src.a_stride + b * src.b_stride) * es - row0
                    at = base + (a * dst.a_stride + b * dst.b_stride) * es
                    found.append((off, len(mems) - 1, at, dst.item_stride * es, copy.row_bytes))
        found.sort()
        runs: list[list] = []
        end = 0
        for off, m, at, stride, n in found:
            if off != end:
                return None  # a gap or an overlap: not this page's layout
            end += n
            last = runs[-1] if runs else None
            if last and last[0] is mems[m] and last[2] == stride and last[1] + last[3] == at:
                last[3] += n
            else:
                runs.append([mems[m], at, stride, n, off])
        if end != host.page_bytes:
            return None
        return cls([tuple(r) for r in runs], keep)


def geometry(copies: Any, buffers: EngineBuffers) -> dict[ComponentType, SlotGeometry]:
    """The slot geometry of each of ``buffers``' components that pages can be read straight
    into (built once per engine's buffers); ``copies``: the
    :class:`~hicache.controller.store.page_copies.PageCopies` whose transfer engine copies
    into them."""
    with _GEOMETRY_LOCK:
        found = _GEOMETRY.get(buffers)
    if found is not None:
        return found
    found = {}
    host_pool = copies.transfer.host_pool
    for comp in host_pool.components:
        try:
            plan = copies.transfer.prepared(comp, buffers, to_host=False)
        except Exception:  # a component this engine has no pool for
            continue
        g = SlotGeometry.of(plan, host_pool[comp])
        if g is not None:
            found[comp] = g
    with _GEOMETRY_LOCK:
        _GEOMETRY[buffers] = found
    return found


class CopyAsRead:
    """A load's pages read from disk into the engine's slots as the reads go (see the
    module docstring): read straight into their slots where ``geometry`` covers their
    component (``takes``, ``pieces``, ``ended``: a
    :class:`~hicache.controller.tiers.lower_tier.DirectSink`), else, with
    ``copy_filled``, copied from their host pages on the reader thread as soon as the
    read has checked them (the host page still held by the read: see
    ``LowerTier.fill_locked``). The load copies the rest when its reads have ended.

    :meth:`close` ends it: no copy starts after, and every copy issued has ended when it
    returns, so that a load that gives up (its reads too slow) leaves nothing writing
    into the engine's slots.
    """

    def __init__(
        self,
        copies: Any,
        refs: Sequence[PageRef],
        buffers: EngineBuffers,
        copy_filled: bool = True,
        geometry: dict[ComponentType, SlotGeometry] | None = None,
    ):
        self._copies = copies
        self._buffers: EngineBuffers | None = buffers
        self._copy_filled = copy_filled
        self._geometry = geometry or {}
        self.closed = False
        # The slot of each page the load names once (a page named twice is copied at the
        # end, into each of its slots).
        slots: dict[bytes, int] = {}
        twice: set[bytes] = set()
        for r in refs:
            skey = r.page_hash + _TAG[r.component]
            if skey in slots:
                twice.add(skey)
            slots[skey] = r.device_index
        for skey in twice:
            del slots[skey]
        self._slots = slots
        self._lock = threading.Condition()
        self._running = 0  # copies under way on reader threads
        self.copied: set[bytes] = set()
        self.events: list[Any] = []  # CUDA: one per copy issued
        self.nbytes = 0
        self.error: Exception | None = None

    def takes(self, page: PageEntry) -> bool:
        """Whether ``page`` (on disk only) is read straight into its slot."""
        return (
            page.component in self._geometry
            and page.skey in self._slots
            and page.disk_state is _ON_DISK
            and page.pending_payload is None
        )

    def pieces(self, pages: list[PageEntry]) -> list[tuple] | None:
        """Where each of ``pages`` goes: its component's spans and its slot; None once
        closed or failed (a reader thread; the load then fails)."""
        with self._lock:
            if self._buffers is None or self.error is not None:
                return None
            if self._copies._store.fault("copy_to_device"):
                self.error = RuntimeError("injected host-to-device copy failure")
                self._copies.counters.fail(Failure.COPY_ERROR)
                return None
            self._running += 1  # close() waits for these reads
        slots, geometry = self._slots, self._geometry
        return [(geometry[p.component].spans, slots[p.skey]) for p in pages]

    def ended(self, pages: list[PageEntry], statuses: list[ReadStatus]) -> None:
        """The reads that :meth:`pieces` placed have ended: those served are copied."""
        with self._lock:
            self.copied.update(p.skey for p, st in zip(pages, statuses) if st is _OK)
            self._running -= 1
            self._lock.notify_all()

    def __call__(self, pages: list[PageEntry]) -> None:
        """Copy ``pages`` (checked, their host pages held) into their slots: a reader thread."""
        if not self._copy_filled:
            return
        slots = self._slots
        plan: dict[ComponentType, tuple[list[int], list[int]]] = {}
        named = []
        for e in pages:
            slot = slots.get(e.skey)
            if slot is not None:
                host, dev = plan.setdefault(e.component, ([], []))
                host.append(e.host_page)
                dev.append(slot)
                named.append(e.skey)
        if not named:
            return
        copies = self._copies
        with self._lock:
            buffers = self._buffers
            if buffers is None or self.error is not None:
                return
            self._running += 1  # close() waits for this copy (readers copy in parallel)
        events: list[Any] = []
        nbytes = 0
        error = None
        try:
            page_bytes = copies._store.host_page_bytes()
            for comp, (host, dev) in plan.items():
                if copies._store.fault("copy_to_device"):
                    raise RuntimeError("injected host-to-device copy failure")
                event = copies.transfer.start_to_device(comp, buffers, host, dev)
                if event is not None:
                    events.append(event)
                nbytes += len(host) * page_bytes[comp]
        except Exception as exc:
            error = exc
        with self._lock:
            self.events += events
            self.nbytes += nbytes
            if error is not None:
                self.error = self.error or error
            else:
                self.copied.update(named)
            self._running -= 1
            self._lock.notify_all()

    def close(self) -> CopyAsRead:
        """No copy starts from now on; wait for those issued (CUDA). Returns itself."""
        self.closed = True  # a reader stops before its next page
        with self._lock:
            self._buffers = None
            self._lock.wait_for(lambda: not self._running)
        for event in self.events:
            try:
                event.synchronize()
            except Exception as exc:  # a broken device: the copy has ended, badly
                if self.error is None:
                    self.error = exc
        return self
