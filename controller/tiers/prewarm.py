"""Warm start: which disk pages come back to host after a restart, and bringing them back.

* :class:`UseLog` records when each disk page last served a load, in a file beside LMDB
  (``last-use.bin``: 17-byte storage key and 8-byte time in ns, little endian, a record
  per use). A use costs an append to a list under the store's lock; a thread writes what
  gathered once a second (one ``write``, the last use of each page), so the serving path
  never waits on the file. At open the file is read (a torn last record is ignored),
  reduced to the newest use of each page still stored, and rewritten. What a crash loses
  is at most the last second of uses: the order of a prewarm, never a page.
* :class:`Prewarm` reads the most recently used pages (last use, or the write of a page
  never used since) into free host pages, hottest first, up to ``prewarm_bytes``, one
  batch at a time on the tier's readers while the sidecar serves: a load that needs a
  page still on disk reads it as always, and waits behind at most one prewarm batch. It
  never evicts a host page (it stops when the host tier has no free page), and its reads
  are the load path's: a page that fails its checksum is dropped, never served. Before
  them, the next hottest pages, up to ``prewarm_disk_bytes``, are handed to the OS to read
  into its page cache (``madvise(MADV_WILLNEED)`` over their values in LMDB's map), then
  faulted into this process's map on a thread of their own (``MADV_POPULATE_READ``), so a
  restart's first loads of those pages neither read a cold file nor take a page fault per
  OS page.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from hicache.controller.store.page_codec import KEY_BYTES
from hicache.controller.wire.security import PRIVATE_FILE_MODE
from hicache.controller_api import PageKey
from hicache.types import ComponentType

log = logging.getLogger(__name__)

__all__ = ["Prewarm", "UseLog", "prewarm_order"]

USE_LOG_NAME = "last-use.bin"
_RECORD = struct.Struct(f"<{KEY_BYTES}sQ")
FLUSH_INTERVAL_S = 1.0
_COMPONENTS = {int(c): c for c in ComponentType}
# A prewarm batch: about one reader batch of bytes (see disk_tier.READ_BATCH_BYTES).
BATCH_BYTES = 8 << 20
BATCH_WAIT_S = 60.0
ADVISE_BATCH = 1024  # pages a readahead hint names at once (one read transaction)


class UseLog:
    """The last use of each disk page, kept in a file beside LMDB (see the module)."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / USE_LOG_NAME
        self._pending: dict[bytes, int] = {}
        self._lock = threading.Lock()  # the pending map: the store's lock and the writer
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.records_written = 0

    def read(self) -> dict[bytes, int]:
        """The newest recorded use of each storage key (ns); empty without a file."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        uses: dict[bytes, int] = {}
        whole = len(raw) - len(raw) % _RECORD.size  # a torn last record is ignored
        for skey, ns in _RECORD.iter_unpack(memoryview(raw)[:whole]):
            if ns > uses.get(skey, -1):
                uses[skey] = ns
        return uses

    def rewrite(self, uses: dict[bytes, int]) -> None:
        """Replace the file with one record per key of ``uses`` (atomically)."""
        tmp = self.path.with_suffix(".tmp")
        data = b"".join(_RECORD.pack(k, ns) for k, ns in uses.items())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hicache-use-log", daemon=True)
        self._thread.start()

    def record(self, *skeys: bytes) -> None:
        """Pages served a load now (any thread, the store's lock may be held)."""
        ns = time.time_ns()
        with self._lock:
            self._pending.update(dict.fromkeys(skeys, ns))

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(FLUSH_INTERVAL_S)
            self.flush()

    def flush(self) -> None:
        """Append what gathered since the last flush (one write)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        data = b"".join(_RECORD.pack(k, ns) for k, ns in pending.items())
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE_MODE)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            self.records_written += len(pending)
        except OSError as exc:  # the order of a later prewarm only: never an error
            log.warning("last-use records not written (%s)", exc)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.flush()


def prewarm_order(records: Sequence[Any], uses: dict[bytes, int]) -> list[tuple[PageKey, int]]:
    """The pages of ``records`` (:class:`DiskRecord`) hottest first: by last use, or by
    their write for a page not used since; each with its stored size."""
    ranked = sorted(records, key=lambda r: max(uses.get(r.skey, 0), r.written_at_ns), reverse=True)
    return [(PageKey(r.component, r.page_hash), r.nbytes) for r in ranked]


def _pages_within(order: list[tuple[PageKey, int]], start: int, budget: int) -> int:
    """How many pages of ``order`` from ``start`` on fit in ``budget`` bytes, in order."""
    planned = n = 0
    for _, nbytes in order[start:]:
        if planned + nbytes > budget:
            break
        planned += nbytes
        n += 1
    return n


class Prewarm:
    """Brings the hottest disk pages back to host in the background (see the module)."""

    def __init__(
        self,
        order: list[tuple[PageKey, int]],
        budget_bytes: int,
        fill: Callable[[Sequence[PageKey]], tuple[list[Future], int, int, bool]],
        disk_budget_bytes: int = 0,
        advise: Callable[..., int] | None = None,
    ) -> None:
        """``fill(keys)`` starts reading those of ``keys`` still only on disk into free host
        pages (no eviction): the futures of those reads, the pages and bytes started, and
        False when the host tier ran out of free pages. ``advise(keys)`` has the OS read
        those pages into its page cache in the background (the bytes advised): the next
        hottest pages after the host's, up to ``disk_budget_bytes``, before the host's
        reads start; ``advise(keys, populate=True)`` then, on a thread of its own, has them
        mapped into this process too (a first read of a fresh map pays a page fault per OS
        page otherwise)."""
        self._order = order
        self._fill = fill
        self._advise = advise
        self.budget_bytes = max(0, budget_bytes)
        self.target_pages = _pages_within(order, 0, self.budget_bytes)
        self.target_bytes = sum(n for _, n in order[: self.target_pages])
        self.disk_budget_bytes = max(0, disk_budget_bytes) if advise is not None else 0
        self.disk_pages = _pages_within(order, self.target_pages, self.disk_budget_bytes)
        self.bytes_advised = 0
        self.bytes_mapped = 0  # of those, faulted into the process's map
        self.pages_read = 0  # read into host pages (those that engines had not loaded)
        self.bytes_read = 0
        self.batches_failed = 0  # batches with a page that failed its read (dropped)
        self.state = "running" if self.target_pages or self.disk_pages else "off"
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.state == "running":
            self._thread = threading.Thread(target=self._run, name="hicache-prewarm", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            ahead = self._order[self.target_pages : self.target_pages + self.disk_pages]
            for i in range(0, len(ahead), ADVISE_BATCH):  # the OS reads them meanwhile
                if self._stop.is_set():
                    return
                assert self._advise is not None
                self.bytes_advised += self._advise([k for k, _ in ahead[i : i + ADVISE_BATCH]])
            if ahead:
                threading.Thread(
                    target=self._map, args=(ahead,), name="hicache-prewarm-map", daemon=True
                ).start()
            batch: list[tuple[PageKey, int]] = []
            size = 0
            for item in self._order[: self.target_pages]:
                batch.append(item)
                size += item[1]
                if size >= BATCH_BYTES:
                    if not self._batch(batch):
                        return
                    batch, size = [], 0
            if batch:
                self._batch(batch)
        except Exception:  # a prewarm that fails leaves pages on disk: loads read them
            log.exception("prewarm stopped")
        finally:
            self.seconds = time.perf_counter() - t0
            self.state = "stopped" if self._stop.is_set() else "done"
            log.info(
                "prewarm %s: %d pages (%d bytes) read in %.2fs, %d batches with a bad page",
                self.state,
                self.pages_read,
                self.bytes_read,
                self.seconds,
                self.batches_failed,
            )

    def _map(self, ahead: list[tuple[PageKey, int]]) -> None:
        """Fault the advised pages into the process's map, hottest first."""
        try:
            for i in range(0, len(ahead), ADVISE_BATCH):
                if self._stop.is_set():
                    return
                assert self._advise is not None
                keys = [k for k, _ in ahead[i : i + ADVISE_BATCH]]
                self.bytes_mapped += self._advise(keys, populate=True)
        except Exception:  # the readahead only
            log.exception("prewarm mapping stopped")

    def _batch(self, batch: list[tuple[PageKey, int]]) -> bool:
        """Read one batch; False when the prewarm must end (stopped, host full)."""
        if self._stop.is_set():
            return False
        fills, pages, nbytes, room = self._fill([k for k, _ in batch])
        done, _ = futures.wait(fills, timeout=BATCH_WAIT_S)
        for f in done:
            with contextlib.suppress(Exception):
                if not f.result():
                    self.batches_failed += 1
        self.pages_read += pages
        self.bytes_read += nbytes
        return room

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=BATCH_WAIT_S)

    def stats(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "budget_bytes": self.budget_bytes,
            "target_pages": self.target_pages,
            "target_bytes": self.target_bytes,
            "pages_read": self.pages_read,
            "bytes_read": self.bytes_read,
            "batches_failed": self.batches_failed,
            "disk_budget_bytes": self.disk_budget_bytes,
            "disk_pages": self.disk_pages,
            "bytes_advised": self.bytes_advised,
            "bytes_mapped": self.bytes_mapped,
            "seconds": round(self.seconds, 3),
        }
