"""``DiskTier``: the LMDB tier behind the host pool, as a
:class:`~hicache.controller.tiers.lower_tier.LowerTier`.

The indexed lower tier: the page index records which pages it holds (their disk state),
so a lookup finds them without asking, and the page store asks it to read a page that is
there only. What it adds to the storage (:class:`~hicache.controller.tiers.lmdb_tier.LmdbTier`:
the environment, its writer thread and reader pool) is the policy:

* **Writes.** ``write_through`` queues a page to the writer as soon as it is ready on
  host (from a device, or from the remote tier with ``remote_fill_to_disk``), zero-copy
  from its host page, which the queued write holds; ``write_back`` queues it when the
  host tier evicts it, from a copy that serves reads until the write commits, and at
  close every page held only on host.
* **Reads.** A page on disk only gets a host page (filling) and a read on the reader
  pool; a value whose checks fail is never served: the store forgets it and it is
  deleted.
* **Room.** The writer asks the store to forget least-recently-used pages until a batch
  fits the budget (``disk_budget_bytes``), and deletes them.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from hicache.controller.config import ControllerConfig, DiskWritePolicy
from hicache.controller.store.cost_rule import ReadCost
from hicache.controller.store.counters import Counters, Failure
from hicache.controller.store.page_codec import HEADER_BYTES, ReadStatus
from hicache.controller.store.page_entry import DiskState, PageEntry
from hicache.controller.tiers import lmdb_fsck
from hicache.controller.tiers.lmdb_tier import DiskRecord, LmdbTier, WriteJob, WriteResult
from hicache.controller.tiers.lower_tier import (
    DirectSink,
    FillResult,
    FsckResult,
    TierHost,
    flush_deletes,
)
from hicache.controller.tiers.prewarm import Prewarm, UseLog, prewarm_order
from hicache.controller_api import PageKey
from hicache.types import ComponentType, Tier

log = logging.getLogger(__name__)

# The most bytes one reader reads in one transaction for a load (see ``fill_locked``).
READ_BATCH_BYTES = 8 << 20
# A load whose pages are all smaller than this is read on one thread, its batches one
# after another (``LmdbTier.submit_read(serial=True)``): every copy and check of such a
# page holds the interpreter's lock, so readers beside each other only hand it over. On
# the 2-core development box, in one process, loads of 2,048 pages of 32 KiB from disk
# into an engine's CPU slots took 14.1-14.6 us a page read this way against 16.3-16.8
# spread over four readers (medians of 20 loads each, taking turns); pages of 64 KiB
# read alike either way, and at 256 KiB two readers were 1.3 x one.
SERIAL_READ_BELOW_BYTES = 64 << 10

_OK = ReadStatus.OK
_ON_DISK = DiskState.READY
_READ_FAILURES = {
    ReadStatus.CORRUPT: Failure.CHECKSUM,
    ReadStatus.FOREIGN: Failure.LAYOUT_MISMATCH,
    ReadStatus.MISSING: Failure.DISK_MISSING,
    ReadStatus.ERROR: Failure.DISK_READ_ERROR,
}


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No automatic garbage collection inside: for the index rebuild at start, which makes
    millions of long-lived, acyclic objects. Every collection the growing heap would
    trigger scans all of them, and that doubled the rebuild's time (200 k pages: 9 s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class DiskTier:
    """The LMDB tier's policy over its storage (see the module docstring)."""

    tier = Tier.DISK

    def __init__(
        self,
        config: ControllerConfig,
        host: TierHost,
        fingerprint: bytes,
        page_bytes: dict[ComponentType, int],
        counters: Counters,
    ) -> None:
        """Open LMDB at ``config.disk_path`` (see :meth:`open`)."""
        self.config = config
        self._host = host
        self._counters = counters
        self.lmdb = LmdbTier(
            config,
            fingerprint,
            page_bytes,
            live_bytes=host.stored_bytes,
            evict=host.evict_stored,
            on_written=self._written,
        )
        self.uses = UseLog(self.lmdb.path)
        self._read_cost = ReadCost(self.lmdb.readers)
        self._value_bytes = {c: HEADER_BYTES + n for c, n in page_bytes.items()}
        self.prewarm = Prewarm([], 0, host.prewarm_fill)

    @classmethod
    def open(
        cls,
        config: ControllerConfig,
        host: TierHost,
        fingerprint: bytes,
        page_bytes: dict[ComponentType, int],
        counters: Counters,
    ) -> DiskTier:
        """Open LMDB at ``config.disk_path`` and index what it holds in ``host``'s store
        (oldest first, so the LRU order survives the restart); the writer starts once the
        index is rebuilt, so its callbacks find it."""
        tier = cls(config, host, fingerprint, page_bytes, counters)
        lmdb = tier.lmdb
        with _gc_paused():
            try:
                records = lmdb.scan()
            except BaseException:
                lmdb.close()
                raise
            host.restore_stored(records)
            order = tier._last_uses(records)
        over = host.stored_bytes() - config.disk_budget_bytes
        if over > 0:  # the budget shrank since the last run
            lmdb.submit_delete(host.evict_stored(over))
        lmdb.fault_hook = host.fault
        lmdb.start()
        log.info("LMDB tier %s: %d pages found", config.disk_path, len(records))
        budget = config.prewarm_bytes
        if budget is None:
            budget = config.host_pool_bytes // 2
        ahead = config.prewarm_disk_bytes
        if ahead is None:
            ahead = config.host_pool_bytes
        tier.prewarm = Prewarm(order, budget, host.prewarm_fill, ahead, tier._advise)
        tier.uses.start()
        tier.prewarm.start()
        return tier

    def _advise(self, keys: Sequence[PageKey], populate: bool = False) -> int:
        """Have the OS read ``keys``' values into its page cache, or with ``populate``
        into this process's map (the bytes advised)."""
        return self.lmdb.advise([k.storage_key() for k in keys], populate)

    def _last_uses(self, records: list[DiskRecord]) -> list[tuple[PageKey, int]]:
        """The pages found, hottest first (:func:`prewarm_order`); the use log is reduced
        to the pages still stored and rewritten."""
        try:
            uses = self.uses.read()
            kept = {r.skey: uses[r.skey] for r in records if r.skey in uses}
            if kept != uses:
                self.uses.rewrite(kept)
        except OSError as exc:  # the order of the prewarm only
            log.warning("last-use records not read (%s): prewarm by write order", exc)
            kept = {}
        return prewarm_order(records, kept)

    # -- what it holds -------------------------------------------------------------------

    def probe(self, page_hashes: Sequence[bytes], rows: dict[ComponentType, list[int]]) -> None:
        """Nothing to add: the index holds every page of this tier."""

    def offers(self, key: PageKey) -> bool:
        """Never: the index holds every page of this tier."""
        return False

    def refusing(self) -> bool:
        """Never: the index answers for this tier."""
        return False

    def holds_foreign(self, first_hash: Callable[[bytes], bytes]) -> bool:
        """Whether a chain of another layout's values found at open starts with it."""
        full = bytes((int(ComponentType.FULL),))
        return any(self.lmdb.holds_foreign(first_hash(r) + full) for r in self.lmdb.foreign_roots)

    # -- reads ---------------------------------------------------------------------------

    def fill_locked(
        self, keys: Sequence[PageKey], then: Callable[[list[PageEntry]], None] | None = None
    ) -> bool:
        """Read each of ``keys`` (on this tier only) into a host page on the reader pool,
        in batches that keep every reader busy, each at most ``READ_BATCH_BYTES`` and
        submitted as soon as its host pages are reserved (the first reads run while the
        rest are reserved); ``then``: see :meth:`LowerTier.fill_locked`. False when one
        found no host page (counted: the others are still read)."""
        sizes = self._value_bytes
        total = sum(sizes[k.component] for k in keys)
        target = max(1, min(READ_BATCH_BYTES, -(-total // self.lmdb.readers)))
        serial = self._serial({k.component for k in keys})
        ok = True
        begin = self._host.begin_fill_locked
        batch: list[PageEntry] = []
        size = 0
        for key in keys:
            page = begin(key, None)
            if page is None:
                self._counters.fail(Failure.HOST_FULL)
                ok = False
                continue
            if size and size + page.disk_nbytes > target:
                self._submit_locked(batch, then, serial)
                batch, size = [], 0
            batch.append(page)
            size += page.disk_nbytes
        if batch:
            self._submit_locked(batch, then, serial)
        return ok

    def _serial(self, components: set[ComponentType]) -> bool:
        """Whether a load of pages of ``components`` is read on one thread (see
        ``SERIAL_READ_BELOW_BYTES``)."""
        sizes = self._value_bytes
        return all(sizes[c] - HEADER_BYTES < SERIAL_READ_BELOW_BYTES for c in components)

    def read_direct_locked(
        self, pages: Sequence[PageEntry], sink: DirectSink, serial: bool = False
    ) -> list[Future]:
        """Read ``pages`` (held, on this tier only) straight into where ``sink`` puts them
        (a load's slots in an engine's memory), no host page between: batched and spread
        over the reader pool as :meth:`fill_locked` does (``serial``, or small pages: on
        the serial reader); the futures of the batches, each True when every page of it
        was served. A value that fails its checks is forgotten here and deleted, as on a
        read into host."""
        sizes = self._value_bytes
        total = sum(sizes[p.component] for p in pages)
        target = max(1, min(READ_BATCH_BYTES, -(-total // self.lmdb.readers)))
        serial = serial or self._serial({p.component for p in pages})
        submit, read = self.lmdb.submit_read, self._read_direct
        futures: list[Future] = []
        batch: list[PageEntry] = []
        size = 0
        for page in pages:
            if size and size + sizes[page.component] > target:
                futures.append(submit(read, batch, sink, serial, serial=serial))
                batch, size = [], 0
            batch.append(page)
            size += sizes[page.component]
        if batch:
            futures.append(submit(read, batch, sink, serial, serial=serial))
        return futures

    def _read_direct(self, pages: list[PageEntry], sink: DirectSink, serial: bool) -> bool:
        """A batch of :meth:`read_direct_locked` (a reader thread, one transaction;
        ``serial``: on the serial reader)."""
        t0 = time.perf_counter()
        faults = self._host.faults
        if faults is not None and faults.disk_read_delay_s:
            time.sleep(faults.disk_read_delay_s)
        pieces = sink.pieces(pages)
        if pieces is None:  # the load has ended or failed: nothing is read
            return False
        statuses = [ReadStatus.ERROR] * len(pages)
        try:
            skeys = [p.skey for p in pages]
            sizes = [self._value_bytes[p.component] - HEADER_BYTES for p in pages]
            statuses = self.lmdb.read_pieces(skeys, sizes, pieces, sink)
        except Exception:
            log.exception("disk read of %d pages into an engine failed", len(pages))
        finally:
            sink.ended(pages, statuses)
        served = [p for p, st in zip(pages, statuses) if st is _OK]
        nbytes = sum(self._value_bytes[p.component] - HEADER_BYTES for p in served)
        if served:
            seconds = time.perf_counter() - t0
            self._observe(nbytes, seconds, serial)
            self._counters.transfer("disk_to_device", len(served), nbytes, seconds)
        if len(served) < len(pages):
            self._host.finish_direct_reads([FillResult(p, st) for p, st in zip(pages, statuses)])
            ended = sink.closed  # pages left unread by a load that gave up: no failure
            for status in statuses:
                if status is not _OK and not (ended and status is ReadStatus.ERROR):
                    self._counters.fail(_READ_FAILURES[status])
        return len(served) == len(pages)

    def _observe(self, nbytes: int, seconds: float, serial: bool) -> None:
        """A batch's read time to the cost rule, which takes it as one of the tier's
        readers side by side: a serial batch had the CPU to itself."""
        self._read_cost.observe(nbytes, seconds * (self.lmdb.readers if serial else 1))

    def _submit_locked(
        self,
        pages: list[PageEntry],
        then: Callable[[list[PageEntry]], None] | None,
        serial: bool = False,
    ) -> None:
        # A reader settles its pages under the store's lock, which the caller holds: the
        # fill is recorded on them before any can be settled.
        future = self.lmdb.submit_read(self._read, pages, then, serial, serial=serial)
        self._host.fill_started_locked(pages, future)

    def _read(
        self,
        pages: list[PageEntry],
        then: Callable[[list[PageEntry]], None] | None = None,
        serial: bool = False,
    ) -> bool:
        """Fill the host pages of ``pages`` with their stored bytes (a reader thread, one
        LMDB transaction), hand ``then`` those read well, and settle them; True when
        every one is served (``serial``: read on the serial reader)."""
        t0 = time.perf_counter()
        statuses = [ReadStatus.ERROR] * len(pages)
        try:
            faults = self._host.faults
            if faults is not None and faults.disk_read_delay_s:
                time.sleep(faults.disk_read_delay_s)
            skeys, dsts, stored = [], [], []
            for i, page in enumerate(pages):
                dst = self._host.host_row(page)
                frame = page.pending_payload  # write-back: not committed, served from memory
                if frame is not None:
                    dst[:] = np.frombuffer(frame, np.uint8, offset=HEADER_BYTES)
                    statuses[i] = ReadStatus.OK
                else:
                    skeys.append(page.skey)
                    dsts.append(dst)
                    stored.append(i)
            if skeys:
                for i, status in zip(stored, self.lmdb.read_many(skeys, dsts)):
                    statuses[i] = status
                self._observe(sum(d.nbytes for d in dsts), time.perf_counter() - t0, serial)
        except Exception:
            log.exception("disk read of %d pages failed", len(pages))
        if then is not None:
            good = [p for p, st in zip(pages, statuses) if st is _OK]
            if good:
                then(good)
        results = [FillResult(p, st) for p, st in zip(pages, statuses)]
        nbytes = self._host.finish_fills(results, Tier.DISK)
        for status in statuses:
            if status is not ReadStatus.OK:
                self._counters.fail(_READ_FAILURES[status])
        served = sum(st is ReadStatus.OK for st in statuses)
        if served:
            self._counters.transfer("disk_to_host", served, nbytes, time.perf_counter() - t0)
        return served == len(pages)

    # -- writes --------------------------------------------------------------------------

    def read_cost(self) -> ReadCost:
        """Seconds per byte of the reads of a load, measured on every batch."""
        return self._read_cost

    def on_host_ready_locked(self, page: PageEntry, source: Tier) -> None:
        """Write-through: queue a page that reached host from a device (or, with
        ``remote_fill_to_disk``, from the remote tier), zero-copy from its host page."""
        if self.config.disk_write_policy is not DiskWritePolicy.WRITE_THROUGH:
            return
        if source is Tier.DEVICE or (source is Tier.REMOTE and self.config.remote_fill_to_disk):
            self._queue_locked(page, keep_copy=False)

    def on_host_evict_locked(self, page: PageEntry) -> None:
        """Write-back: copy a page out before its host page is reused, and queue it."""
        if self.config.disk_write_policy is DiskWritePolicy.WRITE_BACK:
            self._queue_locked(page, keep_copy=True)

    def on_served_locked(self, pages: Sequence[PageEntry]) -> None:
        """Record the use of the pages this tier holds (the order of the next prewarm)."""
        self.uses.record(*[p.skey for p in pages if p.disk_state is _ON_DISK])

    def engine_reads(self) -> dict[str, Any]:
        return {"path": str(self.lmdb.path.resolve()), "digest": self.lmdb.layout_digest}

    def read_by_engine_locked(self, pages: Sequence[PageEntry], nbytes: int, s: float) -> None:
        # Read by one thread of the engine, as a whole load: a serial batch's cost.
        self._observe(nbytes, s, serial=True)
        self._counters.transfer("disk_to_device", len(pages), nbytes, max(s, 0.0))

    def clear_stale_readers(self) -> None:
        try:
            stale = self.lmdb.env.reader_check()
        except Exception as exc:  # closed, or LMDB refused: the next check tries again
            log.debug("LMDB reader check failed: %s", exc)
            return
        if stale:
            log.info("freed %d LMDB reader slots of processes gone", stale)

    def on_close_locked(self) -> None:
        """Write-back keeps pages in memory only: queue every page held only on host, so
        that a clean shutdown does not lose them."""
        if self.config.disk_write_policy is DiskWritePolicy.WRITE_BACK:
            for page in self._host.unwritten_host_pages_locked():
                self._queue_locked(page, keep_copy=False)

    def _queue_locked(self, page: PageEntry, keep_copy: bool) -> None:
        frame = self._host.begin_write_locked(page, keep_copy)
        if frame is not None:
            job = WriteJob(page.skey, page.component, page.parent_hash, frame, page, True)
            self.lmdb.submit_write(job)

    def _written(self, results: list[WriteResult], seconds: float) -> None:
        """A writer batch: committed pages are on disk, rejected ones are not."""
        self._host.finish_writes([(r.job.token, _stored(r)) for r in results])
        failed = [r for r in results if not r.ok]
        if failed:  # one line per batch, not per page: a full disk must not flood the log
            log.warning(
                "%d of %d pages not stored: %s", len(failed), len(results), failed[0].reason
            )
        ok_bytes = sum(r.nbytes for r in results if r.ok)
        self._counters.transfer("host_to_disk", len(results) - len(failed), ok_bytes, seconds)

    def delete_locked(self, skeys: Sequence[bytes]) -> None:
        """Queue the deletes of pages the index has forgotten."""
        self.lmdb.submit_delete(skeys)

    # -- upkeep --------------------------------------------------------------------------

    def flush(self, timeout_s: float | None) -> bool:
        return self.lmdb.flush(timeout_s)

    def stats(self) -> dict[str, Any]:
        return {**self.lmdb.stats(), **self._read_cost.stats(), "prewarm": self.prewarm.stats()}

    def health(self, timeout_s: float) -> dict[str, Any]:
        """:meth:`stats`, and whether the writer thread (its only way in) is running."""
        return {**self.stats(), "writer_alive": self.lmdb.writer.alive}

    def fsck(self, repair: bool, progress: Callable[[int, int], None] | None) -> FsckResult:
        """Check every value; with ``repair``, the corrupt ones are forgotten and deleted
        (a page in flight is left to the read path, which never serves a bad checksum
        either), and ``repaired`` counts the deletes committed when it returns."""
        out = FsckResult()
        env, digest = self.lmdb.env, self.lmdb.layout_digest
        bad = lmdb_fsck.scan(env, digest, out, progress)
        if repair and bad:
            deletes = self._host.forget_stored(
                bad, lambda keys: lmdb_fsck.still_corrupt(env, keys, digest)
            )
            # Repaired means gone from LMDB, not only queued.
            if deletes and flush_deletes(self, len(deletes)):
                left = self.lmdb.pending_deletes  # deletes the writer must retry
                out.repaired = sum(1 for k in deletes if k not in left)
        return out

    def check_invariants(self, ready: set[bytes], queued: set[bytes]) -> None:
        """Every page the index has committed is in LMDB, and every value LMDB holds is
        indexed (committed or queued), being deleted, or of another layout."""
        stored = self.lmdb.stored_keys()
        assert ready <= stored, f"{len(ready - stored)} indexed pages missing in LMDB"
        extra = stored - ready - queued - self.lmdb.pending_deletes
        extra -= self.lmdb.foreign_keys
        assert not extra, f"{len(extra)} LMDB values unknown to the index"

    def close(self, timeout_s: float) -> bool:
        """Stop the prewarm, write the last uses, drain the writer and close LMDB; True
        when drained."""
        self.prewarm.stop()
        self.uses.close()
        return self.lmdb.close(timeout_s)


def _stored(result: WriteResult) -> int | Failure:
    """The bytes a write stored, or why it stored nothing."""
    if result.ok:
        return result.nbytes
    return Failure.DISK_FULL if result.map_full else Failure.DISK_WRITE_ERROR
