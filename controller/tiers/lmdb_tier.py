"""The disk tier: one LMDB environment, one writer thread, a pool of reader threads.

A stored value is a small header followed by the page's bytes (see
:mod:`hicache.controller.store.page_codec`) under the key ``PageKey.storage_key()``. Reads run
in the reader pool against LMDB's memory map (``buffers=True``): one copy from the map
into the host page, then the checksum over what will be served.

Writes go through :class:`hicache.controller.tiers.lmdb_writer.LmdbWriter` (one thread,
batched commits, the byte budget and the full-map policy).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from hicache.controller.config import ControllerConfig
from hicache.controller.store.page_codec import (
    HEADER_BYTES,
    KEY_BYTES,
    ReadStatus,
    decode_header,
    payload_checksum,
    verify_into,
    verify_runs,
)
from hicache.controller.tiers.lmdb_writer import (
    LmdbWriter,
    TierCounters,
    WriteJob,
    WriteResult,
    reserve_pages,
)
from hicache.controller.wire.security import PRIVATE_FILE_MODE, check_private_dir, make_private_dir
from hicache.controller_api import ControllerError
from hicache.keys import HASH_BYTES
from hicache.types import ComponentType

log = logging.getLogger(__name__)

_OS_PAGE = mmap.PAGESIZE
_MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)
#: Linux 5.14+: fault the range into this process's page tables (reading what is not
#: cached), so that a reader's first touch of a value takes no page fault.
_MADV_POPULATE_READ = 22
_POPULATE = [sys.platform.startswith("linux")]  # cleared where the kernel refuses it


def _libc_madvise():
    """libc's ``madvise`` (address, length, advice) -> int, or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


def _usable_cpus() -> int:
    """The CPUs this process may run on: readers beyond them only take turns, and each
    hand-over of the interpreter's lock costs (on the 2-core development box, 256 KiB to
    8 MiB pages loaded into an engine's slots 10-15% slower on four threads than on two)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


__all__ = ["DiskRecord", "LmdbTier", "ReadStatus", "WriteJob", "WriteResult"]


@dataclass
class DiskRecord:
    """A committed page found when the environment was opened."""

    skey: bytes
    component: ComponentType
    page_hash: bytes
    parent_hash: bytes
    nbytes: int
    written_at_ns: int


class LmdbTier:
    """LMDB storage of pages; eviction decisions stay with the controller's index.

    ``live_bytes()`` returns the committed bytes the index holds; ``evict(nbytes)`` asks
    the controller to drop at least ``nbytes`` of least-recently-used disk pages from its
    index and returns their keys (the writer then deletes them); ``on_written(results,
    seconds)`` reports each batch. All three are called from the writer thread (only a
    write submitted after ``close`` is reported from the submitting thread).
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
        self.counters = TierCounters()
        self._fault_hook: Callable[[str], bool] | None = None
        self._foreign: dict[bytes, int] = {}
        # The seeds of the chains that other layouts' values found at open start from.
        self.foreign_roots: frozenset[bytes] = frozenset()
        self._closed = False
        self._closing = threading.Lock()  # a read is submitted wholly before or after close
        check_private_dir(self.path, "disk_path", warn=False)
        make_private_dir(self.path)
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
                mode=PRIVATE_FILE_MODE,  # data.mdb and lock.mdb: pages of users' prompts
            )
            # Reader slots of processes gone: an engine that keeps its map open over a
            # restart (client/disk_share.py) keeps lock.mdb's table too, with the slots a
            # killed sidecar held, which would keep old pages from reuse.
            stale = self.env.reader_check()
            if stale:
                log.info("freed %d LMDB reader slots of processes gone", stale)
            self._leave_room_to_delete()
        except lmdb.Error as exc:
            os.close(self._lock_fd)
            raise ControllerError(f"cannot open the LMDB tier at {self.path}: {exc}") from exc
        self.writer = LmdbWriter(
            self.env,
            config,
            layout_digest,
            self.counters,
            self._foreign,
            live_bytes,
            evict,
            on_written,
        )
        self.readers = min(config.reader_threads, _usable_cpus())
        self._readers = ThreadPoolExecutor(self.readers, thread_name_prefix="hicache-lmdb-reader")
        # Reads whose every step holds the interpreter's lock (small pages: see
        # ``submit_read``) run here, one after another.
        self._serial = ThreadPoolExecutor(1, thread_name_prefix="hicache-lmdb-serial-reader")

    def _take_lock(self) -> int:
        fd = os.open(self.path / "hicache.lock", os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
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

    def _leave_room_to_delete(self) -> None:
        """Give a file that fills the configured map the writer's reserve on top.

        When the file outgrew the map (the budget shrank since it grew), LMDB takes the
        file's used size as the map, which leaves no page for the transactions that
        delete down to the new budget (copy on write needs some even to delete).
        """
        psize = self.env.stat()["psize"]
        used_pages = self.env.info()["last_pgno"] + 1
        if used_pages * psize >= self.config.map_size_bytes:
            self.env.set_mapsize((used_pages + reserve_pages(used_pages)) * psize)

    def scan(self) -> list[DiskRecord]:
        """Every committed page of this layout, oldest first; drops invalid values.

        Only headers are read (one page of the map per value) unless
        ``disk_verify_on_open`` asks for every payload's checksum. Another layout's
        values are kept but never served; they are the first to go when room is needed.
        """
        records: list[DiskRecord] = []
        invalid: list[bytes] = []
        foreign_parents: set[bytes] = set()
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
                    if skey[-1] == int(ComponentType.FULL):
                        foreign_parents.add(hdr.parent_hash)
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
        full = bytes((int(ComponentType.FULL),))
        self.foreign_roots = frozenset(p for p in foreign_parents if p + full not in self._foreign)
        records.sort(key=lambda r: r.written_at_ns)
        return records

    def start(self) -> None:
        """Start the writer (after the index is rebuilt, so its callbacks find it), and the
        reader threads (the serial one too), each with its slot in LMDB's reader table: a
        first load pays for neither."""
        self.writer.start()
        n = self.readers
        gate = threading.Barrier(n)

        def begin_one() -> None:
            with self.env.begin(buffers=True):
                pass

        def begin() -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                gate.wait(5.0)  # every task on a thread of its own
            begin_one()

        for f in [self._readers.submit(begin) for _ in range(n)]:
            f.result()
        self._serial.submit(begin_one).result()

    # -- submission ----------------------------------------------------------------------

    def submit_write(self, job: WriteJob) -> None:
        """Queue a page for the writer; its result comes through ``on_written`` (at once,
        as a failure, when the tier is closed)."""
        self.writer.submit_write(job)

    def submit_delete(self, skeys: Sequence[bytes]) -> None:
        """Queue deletions (pages the index has already dropped)."""
        self.writer.submit_delete(skeys)

    def submit_read(self, fn: Callable[..., Any], *args: Any, serial: bool = False) -> Future:
        """Run ``fn(*args)`` on a reader thread; ``serial``: on the one thread that runs
        such reads one after another, for reads that hold the interpreter's lock from end
        to end (small pages' copies and checks), which more threads only slow down: each
        hand-over of the lock between readers costs more than it lets run beside it.

        Once the tier is closed (a load racing shutdown) ``fn`` still runs, on a thread
        of its own, and :meth:`read_into` answers ERROR there without touching LMDB: the
        caller, which reserved a host page for the read, settles it like any failed read.
        """
        with self._closing:
            if not self._closed:
                return (self._serial if serial else self._readers).submit(fn, *args)
        done: Future = Future()

        def run() -> None:
            try:
                done.set_result(fn(*args))
            except BaseException as exc:
                done.set_exception(exc)

        threading.Thread(target=run, name="hicache-lmdb-closed-read", daemon=True).start()
        return done

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued before the call is committed (or failed)."""
        return self.writer.flush(timeout_s)

    @property
    def pending(self) -> int:
        return self.writer.pending

    @property
    def fault_hook(self) -> Callable[[str], bool] | None:
        """Test hook: called with "disk_read" / "disk_write"; True makes that step fail."""
        return self._fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Callable[[str], bool] | None) -> None:
        self._fault_hook = hook
        self.writer.fault_hook = hook

    # -- reading -------------------------------------------------------------------------

    def read_into(self, skey: bytes, dst: np.ndarray) -> ReadStatus:
        """Copy the page ``skey`` into ``dst`` (uint8, its exact size) and verify it.

        Blocking: call it on a reader thread. Anything but OK leaves ``dst`` undefined.
        A closed tier reads nothing (ERROR), so a read still queued at ``close`` or
        submitted after it never touches an environment that may be unmapped.
        """
        return self.read_many([skey], [dst])[0]

    def read_many(self, skeys: Sequence[bytes], dsts: Sequence[np.ndarray]) -> list[ReadStatus]:
        """:meth:`read_into` of each page of ``skeys`` into the matching ``dsts``, in one
        read transaction (a batch of a load costs one, not one a page)."""
        digest = self.layout_digest

        def serve(i: int, value: Any) -> ReadStatus:
            return verify_into(value, (value[HEADER_BYTES:],), skeys[i][-1], digest, dsts[i])

        return self._read_each(skeys, serve)

    def read_pieces(
        self, skeys: Sequence[bytes], nbytes: Sequence[int], pieces: Sequence[Sequence], stop: Any
    ) -> list[ReadStatus]:
        """:meth:`read_many` for pages whose bytes go elsewhere than one row each: page
        ``i``'s ``nbytes[i]`` payload bytes copied where ``pieces[i]`` (runs, slot) says
        and checked there (:func:`~hicache.controller.store.page_codec.verify_runs`). Pages
        left when ``stop.closed`` turns true are not read (ERROR)."""
        digest = self.layout_digest

        def serve(i: int, value: Any) -> ReadStatus:
            runs, slot = pieces[i]
            return verify_runs(value, skeys[i][-1], digest, nbytes[i], runs, slot)

        return self._read_each(skeys, serve, stop)

    def _read_each(
        self, skeys: Sequence[bytes], serve: Callable[[int, Any], ReadStatus], stop: Any = None
    ) -> list[ReadStatus]:
        """``serve(i, value)`` of each present value of ``skeys`` in one read transaction
        (the map's pages stay valid inside it); a missing one is MISSING."""
        out = [ReadStatus.ERROR] * len(skeys)
        if self._closed:
            return out
        hook = self.fault_hook
        try:
            with self.env.begin(buffers=True) as txn:
                get = txn.get
                for i, skey in enumerate(skeys):
                    if stop is not None and stop.closed:
                        break
                    if hook is not None and hook("disk_read"):
                        continue
                    value = get(skey)
                    out[i] = ReadStatus.MISSING if value is None else serve(i, value)
        except lmdb.Error as exc:
            log.error("LMDB read of %d pages failed: %s", len(skeys), exc)
        return out

    def advise(self, skeys: Sequence[bytes], populate: bool = False) -> int:
        """Ask the OS to read the values of ``skeys`` into its page cache in the background
        (``madvise(MADV_WILLNEED)`` over each value's range of the map), so that a later
        load finds them cached; the bytes advised. ``populate``: instead fault them into
        this process's map now (``MADV_POPULATE_READ``, reading what is not cached; blocks
        until done), so that a reader's first touch costs no page fault; where the kernel
        has no such advice, WILLNEED. Changes no value; a key not held is skipped."""
        if self._closed or _MADVISE is None:
            return 0
        advised = 0
        try:
            with self.env.begin(buffers=True) as txn:
                for skey in skeys:
                    value = txn.get(skey)
                    if value is None:
                        continue
                    addr = np.frombuffer(value, np.uint8).ctypes.data
                    start = addr - addr % _OS_PAGE
                    length = addr + len(value) - start
                    if populate and _POPULATE[0]:
                        if _MADVISE(start, length, _MADV_POPULATE_READ) == 0:
                            advised += len(value)
                            continue
                        if ctypes.get_errno() == errno.EINVAL:  # an older kernel
                            _POPULATE[0] = False
                    if _MADVISE(start, length, _MADV_WILLNEED) == 0:
                        advised += len(value)
        except lmdb.Error as exc:
            log.warning("LMDB readahead of %d pages failed: %s", len(skeys), exc)
        return advised

    # -- the writer ----------------------------------------------------------------------

    # -- state ---------------------------------------------------------------------------

    def stored_keys(self) -> set[bytes]:
        """Every key in the environment (for deep consistency checks)."""
        with self.env.begin() as txn:
            return {bytes(k) for k in txn.cursor().iternext(keys=True, values=False)}

    @property
    def pending_deletes(self) -> frozenset[bytes]:
        return self.writer.pending_deletes

    def holds_foreign(self, skey: bytes) -> bool:
        """Whether ``skey`` is another layout's value (found at open, not deleted since)."""
        return skey in self._foreign

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
        with self._closing:
            if self._closed:
                return True
            self._closed = True
        self._readers.shutdown(wait=True)
        self._serial.shutdown(wait=True)
        drained = self.writer.stop(timeout_s)
        if drained:
            self.env.sync(True)
            self.env.close()
        os.close(self._lock_fd)
        return drained
