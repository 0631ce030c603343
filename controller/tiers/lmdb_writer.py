"""The LMDB tier's writer thread: batched commits within a byte budget and a full map.

Writes are queued to one thread, which commits them in batches (group commit: what
queued up while the previous batch was syncing goes into the next one). Before a batch
it asks the controller to evict least-recently-used disk pages until the batch fits in
``disk_budget_bytes``. A write transaction needs free map pages even to delete (copy on
write), so puts leave a reserve of the map untouched. When LMDB's map is full anyway
(fragmentation, readers holding old pages), the writer evicts more, commits the
deletions on their own, and retries; what still does not fit is rejected with a
counted, explained failure. A committed page is never lost to a failed write. The
writer never dies: an unexpected error fails that batch's pages and the thread goes on.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lmdb

from hicache.controller.config import ControllerConfig
from hicache.controller.store.page_codec import HEADER_BYTES, KEY_BYTES, encode_into, write_header
from hicache.controller_api import ControllerError
from hicache.types import ComponentType

log = logging.getLogger(__name__)


def lower_priority(nice: int) -> bool:
    """Give the calling thread ``nice`` more niceness than the process (Linux: a thread's
    own priority), so that a background thread's copying and hashing yields a busy CPU to
    the threads that serve requests and to the engines' copies; whether it was done
    (measured in docs/operations.md, "disk_writer_nice")."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:  # not expected: raising one's niceness needs no privilege
        log.warning("the LMDB writer keeps the sidecar's priority: %s", exc)
        return False
    return True


def reserve_pages(map_pages: int) -> int:
    """Map pages that puts leave free for transactions that delete (see
    ``LmdbWriter._store``): 2% of the map, at least 8 pages, at most a quarter of a tiny
    map."""
    return min(max(8, map_pages // 50), map_pages // 4)


@dataclass
class WriteJob:
    """A page to store; ``token`` is the caller's, handed back in the result.

    ``framed``: ``payload`` starts with HEADER_BYTES of room for the header (a host page
    frame), so the writer fills them in and stores the buffer as it is, without a copy.
    """

    skey: bytes
    component: ComponentType
    parent_hash: bytes
    payload: Any
    token: Any = None
    framed: bool = False

    @property
    def value_bytes(self) -> int:
        n = memoryview(self.payload).nbytes
        return n if self.framed else HEADER_BYTES + n


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


class LmdbWriter:
    """The queue and thread that commit pages to one LMDB environment.

    ``live_bytes()`` returns the committed bytes the index holds; ``evict(nbytes)`` asks
    the controller to drop at least ``nbytes`` of least-recently-used disk pages from its
    index and returns their keys (the writer then deletes them); ``on_written(results,
    seconds)`` reports each batch. All three are called from the writer thread.
    ``foreign`` (key -> bytes of another layout's values) is shared with the tier: those
    go first when room is needed.
    """

    def __init__(
        self,
        env: lmdb.Environment,
        config: ControllerConfig,
        layout_digest: bytes,
        counters: TierCounters,
        foreign: dict[bytes, int],
        live_bytes: Callable[[], int],
        evict: Callable[[int], list[bytes]],
        on_written: Callable[[list[WriteResult], float], None],
    ) -> None:
        self.env = env
        self.config = config
        self.layout_digest = layout_digest
        self.counters = counters
        self.fault_hook: Callable[[str], bool] | None = None
        self._foreign = foreign
        self._live_bytes = live_bytes
        self._evict = evict
        self._on_written = on_written
        self._pending_deletes: list[bytes] = []
        self._scratch = bytearray()  # the value buffer, reused
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._submitted = 0
        self._finished = 0
        self._closed = False
        self._psize = env.stat()["psize"]
        # The map LMDB really uses: at least the file's size, which may exceed the
        # configured map when the budget was lowered since the file was written.
        self._map_pages = self.env.info()["map_size"] // self._psize
        # Kept free for transactions that delete (see _store): 2% of the map, at least 8
        # pages, at most a quarter of a tiny map.
        self._reserve_pages = reserve_pages(self._map_pages)
        self._thread = threading.Thread(target=self._run, name="hicache-lmdb-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _submit(self, item: object) -> None:
        with self._cv:
            if self._closed:
                raise ControllerError("the LMDB tier is closed")
            self._submitted += 1
            self._queue.put(item)

    def submit_write(self, job: WriteJob) -> None:
        """Queue a page for the writer; its result comes through ``on_written``.

        Once the writer is stopped (a backup racing shutdown) the page fails at once,
        through ``on_written`` on the calling thread: the caller, which marked the page
        as queued, sees it settled like any other failed write.
        """
        try:
            self._submit(job)
        except ControllerError as exc:
            reason = f"{exc}: page not stored (the controller is shutting down)"
            self._on_written([WriteResult(job, False, reason=reason)], 0.0)

    def submit_delete(self, skeys: Sequence[bytes]) -> None:
        """Queue deletions (pages the index has already dropped)."""
        if skeys:
            self._submit(_Delete(list(skeys)))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued before the call is committed (or failed)."""
        with self._cv:
            target = self._submitted
            return self._cv.wait_for(lambda: self._finished >= target, timeout_s)

    @property
    def pending(self) -> int:
        """Queued items the writer has not finished."""
        return self._submitted - self._finished

    @property
    def pending_deletes(self) -> frozenset[bytes]:
        return frozenset(self._pending_deletes)

    @property
    def alive(self) -> bool:
        """Whether the writer thread runs (it is the tier's only way in)."""
        return self._thread.is_alive()

    def stop(self, timeout_s: float | None) -> bool:
        """Refuse new items, drain the queue, stop the thread; True when drained."""
        with self._cv:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("LMDB writer did not drain within %ss; pending pages are lost", timeout_s)
                return False
        return True

    def _run(self) -> None:
        lower_priority(self.config.disk_writer_nice)
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
        sized: list[tuple[WriteJob, int]] = []
        for job in jobs:
            size = job.value_bytes
            if size > self.config.disk_budget_bytes:
                reason = (
                    f"a {size}-byte page exceeds disk_budget_bytes="
                    f"{self.config.disk_budget_bytes}; raise the budget"
                )
                results.append(WriteResult(job, False, reason=reason, map_full=True))
            else:
                sized.append((job, size))
        try:
            results.extend(self._store(sized))
        except Exception as exc:
            log.exception("LMDB writer: unexpected failure")
            done = {id(r.job) for r in results}
            results.extend(
                WriteResult(j, False, reason=f"LMDB write failed: {exc}")
                for j, _ in sized
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

    def _commit(self, puts: list[tuple[WriteJob, int]], deletes: bool) -> None:
        if self.fault_hook is not None and puts and self.fault_hook("disk_write"):
            raise lmdb.DiskError("injected disk write failure")
        with self.env.begin(write=True) as txn:
            if deletes:
                for skey in self._pending_deletes:
                    txn.delete(skey)
            for job, _ in puts:
                if job.framed:
                    write_header(job.payload, job.component, self.layout_digest, job.parent_hash)
                    txn.put(job.skey, job.payload)
                    continue
                value = encode_into(
                    self._scratch, job.component, self.layout_digest, job.parent_hash, job.payload
                )
                try:
                    txn.put(job.skey, value)  # LMDB copies it: the buffer is free again
                finally:
                    value.release()
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

    def _pages_needed(self, encoded: list[tuple[WriteJob, int]]) -> int:
        """A generous estimate of the map pages a put of ``encoded`` allocates."""
        psize = self._psize
        big = sum(-(-(n + 16) // psize) for _, n in encoded if n > psize // 2 - 64)
        small = sum(n + KEY_BYTES + 16 for _, n in encoded if n <= psize // 2 - 64)
        depth = self.env.stat()["depth"]
        # Leaves run about half full; every touched leaf and branch is copied on write.
        return big + -(-2 * small // psize) + 2 * (depth + 1)

    def _pages_free(self) -> int:
        """Map pages that puts may still use: all but the B-tree's and the reserve."""
        st = self.env.stat()
        used = 2 + st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return self._map_pages - self._reserve_pages - used

    def _store(self, encoded: list[tuple[WriteJob, int]]) -> list[WriteResult]:
        incoming = sum(n for _, n in encoded)
        self._make_room(incoming)
        ok = [WriteResult(j, True, nbytes=n) for j, n in encoded]
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
        for job, size in encoded:
            try:
                if self._pages_needed([(job, size)]) > self._pages_free():
                    raise lmdb.MapFullError("no room outside the reserve")
                self._commit([(job, size)], deletes=False)
                results.append(WriteResult(job, True, nbytes=size))
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
        where = self.config.disk_path
        reason = f"LMDB write failed ({exc}); check free space and permissions under {where}"
        log.error("%s", reason)
        return WriteResult(job, False, reason=reason)


def _job_bytes(item: object) -> int:
    return item.value_bytes if isinstance(item, WriteJob) else 0
