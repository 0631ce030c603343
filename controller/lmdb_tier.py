"""The disk tier: one LMDB environment, one writer thread, a pool of reader threads.

A stored value is a small header followed by the page's bytes (see
:mod:`hicache.controller.page_codec`) under the key ``PageKey.storage_key()``. Reads run
in the reader pool against LMDB's memory map (``buffers=True``): one copy from the map
into the host page, then the checksum over what will be served.

Writes are queued to one writer thread, which commits them in batches (group commit:
what queued up while the previous batch was syncing goes into the next one). Before a
batch it asks the controller to evict least-recently-used disk pages until the batch
fits in ``disk_budget_bytes``. When LMDB's map is full anyway (fragmentation, readers
holding old pages), it evicts more, commits the deletions on their own, and retries;
what still does not fit is rejected with a counted, explained failure. A committed page
is never lost to a failed write. The writer never dies: an unexpected error fails that
batch's pages and the thread goes on.
"""

from __future__ import annotations

import enum
import fcntl
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from hicache.controller.config import ControllerConfig
from hicache.controller.page_codec import (
    HEADER_BYTES,
    KEY_BYTES,
    decode_header,
    encode_value,
    payload_checksum,
)
from hicache.controller_api import ControllerError
from hicache.keys import HASH_BYTES
from hicache.types import ComponentType

log = logging.getLogger(__name__)


class ReadStatus(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # not in LMDB (evicted meanwhile)
    CORRUPT = "corrupt"  # bad header, length or checksum: never served
    FOREIGN = "foreign"  # another layout's page: never served
    ERROR = "error"  # LMDB raised; the value may be fine


@dataclass
class DiskRecord:
    """A committed page found when the environment was opened."""

    skey: bytes
    component: ComponentType
    page_hash: bytes
    parent_hash: bytes
    nbytes: int
    written_at_ns: int


@dataclass
class WriteJob:
    """A page to store; ``token`` is the caller's, handed back in the result."""

    skey: bytes
    component: ComponentType
    parent_hash: bytes
    payload: Any
    token: Any = None


@dataclass
class WriteResult:
    job: WriteJob
    ok: bool
    nbytes: int = 0
    reason: str = ""
    map_full: bool = False


@dataclass
class _Delete:
    skeys: list[bytes]


_STOP = object()


@dataclass
class TierCounters:
    batches: int = 0
    pages_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    pages_deleted: int = 0
    map_full_events: int = 0
    pages_rejected_full: int = 0
    write_errors: int = 0
    invalid_dropped: int = 0
    foreign_pages: int = 0
    foreign_dropped: int = 0


class LmdbTier:
    """LMDB storage of pages; eviction decisions stay with the controller's index.

    ``live_bytes()`` returns the committed bytes the index holds; ``evict(nbytes)`` asks
    the controller to drop at least ``nbytes`` of least-recently-used disk pages from its
    index and returns their keys (the writer then deletes them); ``on_written(results,
    seconds)`` reports each batch. All three are called from the writer thread.
    """

    def __init__(
        self,
        config: ControllerConfig,
        layout_digest: bytes,
        expected_nbytes: dict[ComponentType, int],
        live_bytes: Callable[[], int],
        evict: Callable[[int], list[bytes]],
        on_written: Callable[[list[WriteResult], float], None],
    ) -> None:
        assert config.disk_path is not None
        self.config = config
        self.path = Path(config.disk_path)
        self.layout_digest = layout_digest
        self._expected = expected_nbytes
        self._live_bytes = live_bytes
        self._evict = evict
        self._on_written = on_written
        self.counters = TierCounters()
        self.fault_hook: Callable[[str], bool] | None = None
        self._foreign: dict[bytes, int] = {}
        self._pending_deletes: list[bytes] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._submitted = 0
        self._finished = 0
        self._closed = False
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        try:
            self.env = lmdb.open(
                str(self.path),
                map_size=config.map_size_bytes,
                subdir=True,
                sync=config.disk_sync,
                metasync=config.disk_sync,
                readahead=False,  # random page reads: prefetching neighbours wastes I/O
                max_readers=max(126, 4 * config.reader_threads),
                max_dbs=0,
            )
        except lmdb.Error as exc:
            os.close(self._lock_fd)
            raise ControllerError(f"cannot open the LMDB tier at {self.path}: {exc}") from exc
        self._psize = self.env.stat()["psize"]
        self._map_pages = config.map_size_bytes // self._psize
        # Kept free for transactions that delete (see _store): 2% of the map, at least 8
        # pages, at most a quarter of a tiny map.
        self._reserve_pages = min(max(8, self._map_pages // 50), self._map_pages // 4)
        self._readers = ThreadPoolExecutor(
            config.reader_threads, thread_name_prefix="hicache-lmdb-reader"
        )
        self._writer = threading.Thread(target=self._run, name="hicache-lmdb-writer", daemon=True)

    def _take_lock(self) -> int:
        fd = os.open(self.path / "hicache.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ControllerError(
                f"the LMDB tier at {self.path} is in use by another controller; give each "
                "controller its own disk_path"
            ) from None
        return fd

    # -- opening -------------------------------------------------------------------------

    def scan(self) -> list[DiskRecord]:
        """Every committed page of this layout, oldest first; drops invalid values.

        Only headers are read (one page of the map per value) unless
        ``disk_verify_on_open`` asks for every payload's checksum. Another layout's
        values are kept but never served; they are the first to go when room is needed.
        """
        records: list[DiskRecord] = []
        invalid: list[bytes] = []
        with self.env.begin(buffers=True) as txn:
            for k, v in txn.cursor():
                skey = bytes(k)
                hdr = decode_header(v) if len(skey) == KEY_BYTES else None
                if (
                    hdr is None
                    or int(hdr.component) != skey[-1]
                    or len(v) != HEADER_BYTES + hdr.payload_nbytes
                ):
                    invalid.append(skey)
                elif hdr.layout_digest != self.layout_digest:
                    self._foreign[skey] = len(v)
                elif hdr.payload_nbytes != self._expected.get(hdr.component) or (
                    self.config.disk_verify_on_open
                    and payload_checksum(v[HEADER_BYTES:]) != hdr.checksum
                ):
                    invalid.append(skey)
                else:
                    records.append(
                        DiskRecord(
                            skey,
                            hdr.component,
                            skey[:HASH_BYTES],
                            hdr.parent_hash,
                            len(v),
                            hdr.written_at_ns,
                        )
                    )
        if invalid:
            with self.env.begin(write=True) as txn:
                for skey in invalid:
                    txn.delete(skey)
            log.warning("LMDB tier %s: dropped %d invalid values", self.path, len(invalid))
        self.counters.invalid_dropped += len(invalid)
        self.counters.foreign_pages = len(self._foreign)
        records.sort(key=lambda r: r.written_at_ns)
        return records

    def start(self) -> None:
        """Start the writer (after the index is rebuilt, so its callbacks find it)."""
        self._writer.start()

    # -- submission ----------------------------------------------------------------------

    def _submit(self, item: object) -> None:
        with self._cv:
            if self._closed:
                raise ControllerError("the LMDB tier is closed")
            self._submitted += 1
            self._queue.put(item)

    def submit_write(self, job: WriteJob) -> None:
        """Queue a page for the writer; its result comes through ``on_written``."""
        self._submit(job)

    def submit_delete(self, skeys: Sequence[bytes]) -> None:
        """Queue deletions (pages the index has already dropped)."""
        if skeys:
            self._submit(_Delete(list(skeys)))

    def submit_read(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on a reader thread."""
        if self._closed:
            raise ControllerError("the LMDB tier is closed")
        return self._readers.submit(fn, *args)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued before the call is committed (or failed)."""
        with self._cv:
            target = self._submitted
            return self._cv.wait_for(lambda: self._finished >= target, timeout_s)

    @property
    def pending(self) -> int:
        """Queued items the writer has not finished."""
        return self._submitted - self._finished

    # -- reading -------------------------------------------------------------------------

    def read_into(self, skey: bytes, dst: np.ndarray) -> ReadStatus:
        """Copy the page ``skey`` into ``dst`` (uint8, its exact size) and verify it.

        Blocking: call it on a reader thread. Anything but OK leaves ``dst`` undefined.
        """
        if self.fault_hook is not None and self.fault_hook("disk_read"):
            return ReadStatus.ERROR
        try:
            with self.env.begin(buffers=True) as txn:
                value = txn.get(skey)
                if value is None:
                    return ReadStatus.MISSING
                hdr = decode_header(value)
                if hdr is None or int(hdr.component) != skey[-1]:
                    return ReadStatus.CORRUPT
                if hdr.layout_digest != self.layout_digest:
                    return ReadStatus.FOREIGN
                if hdr.payload_nbytes != dst.nbytes or len(value) != HEADER_BYTES + dst.nbytes:
                    return ReadStatus.CORRUPT
                np.copyto(dst, np.frombuffer(value, np.uint8, offset=HEADER_BYTES))
        except lmdb.Error as exc:
            log.error("LMDB read of %s failed: %s", skey.hex(), exc)
            return ReadStatus.ERROR
        # Verified after the copy: what is checked is exactly what will be served.
        if payload_checksum(dst) != hdr.checksum:
            return ReadStatus.CORRUPT
        return ReadStatus.OK

    # -- the writer ----------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            item = self._queue.get()
            items: list[object] = []
            if item is _STOP:
                stopping = True
            else:
                items.append(item)
                stopping = self._gather(items)
            if items or self._pending_deletes:
                try:
                    self._process(items)
                except Exception:  # the writer must survive anything
                    log.exception("LMDB writer: batch failed")
            with self._cv:
                self._finished += len(items)
                self._cv.notify_all()

    def _gather(self, items: list[object]) -> bool:
        """Add queued items to the batch, waiting at most the flush interval; True on stop."""
        cfg = self.config
        nbytes = _job_bytes(items[0])
        deadline = time.monotonic() + cfg.writer_flush_interval_s
        while len(items) < cfg.writer_batch_pages and nbytes < cfg.writer_batch_bytes:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    break
                try:
                    item = self._queue.get(timeout=wait)
                except queue.Empty:
                    break
            if item is _STOP:
                return True
            items.append(item)
            nbytes += _job_bytes(item)
        return False

    def _process(self, items: list[object]) -> None:
        jobs: list[WriteJob] = []
        for it in items:
            if isinstance(it, _Delete):
                self._pending_deletes.extend(it.skeys)
            else:
                jobs.append(it)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        results: list[WriteResult] = []
        encoded: list[tuple[WriteJob, bytes]] = []
        for job in jobs:
            try:
                value = encode_value(
                    job.component, self.layout_digest, job.parent_hash, job.payload
                )
            except Exception as exc:
                results.append(WriteResult(job, False, reason=f"cannot encode the page: {exc}"))
                continue
            if len(value) > self.config.disk_budget_bytes:
                results.append(
                    WriteResult(
                        job,
                        False,
                        reason=f"a {len(value)}-byte page exceeds disk_budget_bytes="
                        f"{self.config.disk_budget_bytes}; raise the budget",
                        map_full=True,
                    )
                )
                continue
            encoded.append((job, value))
        try:
            results.extend(self._store(encoded))
        except Exception as exc:
            log.exception("LMDB writer: unexpected failure")
            done = {id(r.job) for r in results}
            results.extend(
                WriteResult(j, False, reason=f"LMDB write failed: {exc}")
                for j, _ in encoded
                if id(j) not in done
            )
        seconds = time.perf_counter() - t0
        c = self.counters
        c.batches += 1
        c.write_seconds += seconds
        for r in results:
            if r.ok:
                c.pages_written += 1
                c.bytes_written += r.nbytes
            elif r.map_full:
                c.pages_rejected_full += 1
            else:
                c.write_errors += 1
        if results:
            self._on_written(results, seconds)

    def _make_room(self, incoming: int, force: int = 0) -> None:
        """Queue deletions so that ``incoming`` more bytes fit the budget, and free at
        least ``force`` bytes whatever the budget says (the map is full before it)."""
        over = max(
            self._live_bytes()
            + sum(self._foreign.values())
            + incoming
            - self.config.disk_budget_bytes,
            force,
        )
        while over > 0 and self._foreign:
            skey, n = self._foreign.popitem()
            self._pending_deletes.append(skey)
            self.counters.foreign_dropped += 1
            over -= n
        if over > 0:
            self._pending_deletes.extend(self._evict(over))

    def _commit(self, puts: list[tuple[WriteJob, bytes]], deletes: bool) -> None:
        if self.fault_hook is not None and puts and self.fault_hook("disk_write"):
            raise lmdb.DiskError("injected disk write failure")
        with self.env.begin(write=True) as txn:
            if deletes:
                for skey in self._pending_deletes:
                    txn.delete(skey)
            for job, value in puts:
                txn.put(job.skey, value)
        if deletes:
            self.counters.pages_deleted += len(self._pending_deletes)
            self._pending_deletes.clear()

    def _flush_deletes(self) -> bool:
        """Commit the queued deletions on their own; True when none is left.

        On a full map a transaction that deletes many keys may not find the pages its
        copy-on-write needs; one key per transaction needs only a few, and every commit
        makes earlier freed pages reusable.
        """
        try:
            self._commit([], deletes=True)
            return True
        except lmdb.MapFullError:
            self.counters.map_full_events += 1
        while self._pending_deletes:
            try:
                with self.env.begin(write=True) as txn:
                    txn.delete(self._pending_deletes[-1])
            except lmdb.Error:
                return False
            self._pending_deletes.pop()
            self.counters.pages_deleted += 1
        return True

    def _pages_needed(self, encoded: list[tuple[WriteJob, bytes]]) -> int:
        """A generous estimate of the map pages a put of ``encoded`` allocates."""
        psize = self._psize
        big = sum(-(-(len(v) + 16) // psize) for _, v in encoded if len(v) > psize // 2 - 64)
        small = sum(len(v) + KEY_BYTES + 16 for _, v in encoded if len(v) <= psize // 2 - 64)
        depth = self.env.stat()["depth"]
        # Leaves run about half full; every touched leaf and branch is copied on write.
        return big + -(-2 * small // psize) + 2 * (depth + 1)

    def _pages_free(self) -> int:
        """Map pages that puts may still use: all but the B-tree's and the reserve."""
        st = self.env.stat()
        used = 2 + st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return self._map_pages - self._reserve_pages - used

    def _store(self, encoded: list[tuple[WriteJob, bytes]]) -> list[WriteResult]:
        incoming = sum(len(v) for _, v in encoded)
        self._make_room(incoming)
        ok = [WriteResult(j, True, nbytes=len(v)) for j, v in encoded]
        # A write transaction needs free pages even to delete (copy on write): puts
        # leave a reserve of the map untouched, so that an eviction can always commit.
        short = self._pages_needed(encoded) - self._pages_free()
        if short > 0:
            self._make_room(incoming, short * self._psize)
        try:
            # Freed pages are reusable only after their transaction: delete first.
            if short <= 0 or self._flush_deletes():
                self._commit(encoded, deletes=True)
                return ok
        except lmdb.MapFullError:
            self.counters.map_full_events += 1
        except lmdb.Error as exc:
            return [self._failed(j, exc) for j, _ in encoded]
        # The map is full although the budget holds (fragmentation, readers holding old
        # pages): evict what the batch needs (twice as much on every retry), commit the
        # deletions on their own, then try again. Evicting more is pointless while the
        # deletions themselves cannot commit.
        force = max(incoming, self._psize)
        for _ in range(self.config.disk_map_full_retries):
            self._make_room(incoming, force)
            if not self._flush_deletes():
                break
            try:
                self._commit(encoded, deletes=False)
                return ok
            except lmdb.MapFullError:
                self.counters.map_full_events += 1
                force *= 2
            except lmdb.Error as exc:
                return [self._failed(j, exc) for j, _ in encoded]
        # Still full: store what fits the map outside the reserve, one page per
        # transaction, and reject the rest.
        results = []
        for job, value in encoded:
            try:
                if self._pages_needed([(job, value)]) > self._pages_free():
                    raise lmdb.MapFullError("no room outside the reserve")
                self._commit([(job, value)], deletes=False)
                results.append(WriteResult(job, True, nbytes=len(value)))
            except lmdb.Error as exc:
                results.append(self._failed(job, exc))
        return results

    def _failed(self, job: WriteJob, exc: lmdb.Error) -> WriteResult:
        if isinstance(exc, lmdb.MapFullError):
            self.counters.map_full_events += 1
            reason = (
                f"LMDB map full (lmdb_map_size_bytes={self.config.map_size_bytes}, "
                f"live={self._live_bytes()}): page rejected; raise lmdb_map_size_bytes or "
                "lower disk_budget_bytes"
            )
            return WriteResult(job, False, reason=reason, map_full=True)
        reason = f"LMDB write failed ({exc}); check free space and permissions under {self.path}"
        log.error("%s", reason)
        return WriteResult(job, False, reason=reason)

    # -- state ---------------------------------------------------------------------------

    def stored_keys(self) -> set[bytes]:
        """Every key in the environment (for deep consistency checks)."""
        with self.env.begin() as txn:
            return {bytes(k) for k in txn.cursor().iternext(keys=True, values=False)}

    @property
    def pending_deletes(self) -> frozenset[bytes]:
        return frozenset(self._pending_deletes)

    @property
    def foreign_keys(self) -> frozenset[bytes]:
        return frozenset(self._foreign)

    def stats(self) -> dict[str, Any]:
        """File size, LMDB's high-water mark and the writer's counters."""
        info = self.env.info()
        psize = self.env.stat()["psize"]
        try:
            file_bytes = os.stat(self.path / "data.mdb").st_size
        except OSError:
            file_bytes = 0
        c = self.counters
        return {
            "file_bytes": file_bytes,
            "lmdb_used_bytes": (info["last_pgno"] + 1) * psize,
            "map_size_bytes": info["map_size"],
            "foreign_bytes": sum(self._foreign.values()),
            "pending_writes": self.pending,
            "batches": c.batches,
            "pages_written": c.pages_written,
            "bytes_written": c.bytes_written,
            "write_seconds": c.write_seconds,
            "pages_deleted": c.pages_deleted,
            "map_full_events": c.map_full_events,
            "pages_rejected_full": c.pages_rejected_full,
            "write_errors": c.write_errors,
            "invalid_dropped": c.invalid_dropped,
            "foreign_pages": len(self._foreign),
            "foreign_dropped": c.foreign_dropped,
        }

    def close(self, timeout_s: float | None = None) -> bool:
        """Drain queued writes, stop the threads, sync and close; True when fully drained."""
        with self._cv:
            if self._closed:
                return True
            self._closed = True
            self._queue.put(_STOP)
        drained = True
        if self._writer.is_alive():
            self._writer.join(timeout_s)
            if self._writer.is_alive():
                log.error("LMDB writer did not drain within %ss; pending pages are lost", timeout_s)
                drained = False
        self._readers.shutdown(wait=True)
        if drained:
            self.env.sync(True)
            self.env.close()
        os.close(self._lock_fd)
        return drained


def _job_bytes(item: object) -> int:
    if isinstance(item, WriteJob):
        return memoryview(item.payload).nbytes
    return 0
