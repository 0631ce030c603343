"""The LMDB tier on a real environment: values, the writer, reads, rebuild, limits, and
the controller paths that meet its edges (shutdown, admin deletes, a shrunk budget)."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from collections import OrderedDict

import numpy as np
import pytest

from hicache.controller.admin.ops import clear
from hicache.controller.config import ControllerConfig
from hicache.controller.store.page_codec import HEADER_BYTES, decode_header, encode_value
from hicache.controller.tiers import lmdb_tier
from hicache.controller.tiers.lmdb_tier import LmdbTier, ReadStatus, WriteJob
from hicache.controller_api import ControllerError
from hicache.types import ComponentType, Tier
from tests.support.controller import (
    PAGE,
    registered_controller,
)

FULL = ComponentType.FULL
DIGEST = b"L" * 16
PAGE_BYTES = 8192


def skey(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest() + b"\0"


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PAGE_BYTES, dtype=np.uint8)


class FakeIndex:
    """The controller's side of the tier: committed pages in LRU order."""

    def __init__(self) -> None:
        self.pages: OrderedDict[bytes, int] = OrderedDict()
        self.results = []
        self.evict_calls: list[int] = []
        self.lock = threading.Lock()
        self.raise_once = False

    def live_bytes(self) -> int:
        return sum(self.pages.values())

    def evict(self, nbytes: int) -> list[bytes]:
        self.evict_calls.append(nbytes)
        out, freed = [], 0
        while freed < nbytes and self.pages:
            k, n = self.pages.popitem(last=False)
            out.append(k)
            freed += n
        return out

    def on_written(self, results, seconds) -> None:
        with self.lock:
            self.results.extend(results)
            for r in results:
                if r.ok:
                    self.pages[r.job.skey] = r.nbytes
        if self.raise_once:
            self.raise_once = False
            raise RuntimeError("a bug in the callback")


def open_tier(
    tmp_path, index: FakeIndex, digest: bytes = DIGEST, page_bytes: int = PAGE_BYTES, **overrides
) -> LmdbTier:
    kw = dict(disk_path=tmp_path / "lmdb", disk_budget_bytes=1 << 20, disk_sync=False)
    kw.update(overrides)
    tier = LmdbTier(
        ControllerConfig(**kw),
        digest,
        {FULL: page_bytes},
        index.live_bytes,
        index.evict,
        index.on_written,
    )
    for r in tier.scan():
        index.pages[r.skey] = r.nbytes
    tier.start()
    return tier


def write(tier: LmdbTier, ids, parent: bytes = b"P" * 16) -> None:
    for i in ids:
        tier.submit_write(WriteJob(skey(i), FULL, parent, payload(i)))
    assert tier.flush(10.0)


def test_value_header_round_trip_and_rejections():
    value = encode_value(FULL, DIGEST, b"P" * 16, payload(1))
    hdr = decode_header(value)
    assert hdr.component is FULL and hdr.layout_digest == DIGEST
    assert hdr.parent_hash == b"P" * 16 and hdr.payload_nbytes == PAGE_BYTES
    assert len(value) == HEADER_BYTES + PAGE_BYTES
    for offset in (0, 4, 40):  # magic, version, parent hash (caught by the header CRC)
        bad = bytearray(value)
        bad[offset] ^= 1
        assert decode_header(bytes(bad)) is None
    assert decode_header(value[:10]) is None


def test_written_pages_read_back_exactly_and_are_batched(tmp_path):
    index = FakeIndex()
    tier = open_tier(tmp_path, index, writer_flush_interval_s=0.05)
    write(tier, range(40))
    assert all(r.ok for r in index.results) and len(index.results) == 40
    stats = tier.stats()
    assert stats["pages_written"] == 40 and stats["batches"] < 40
    assert stats["file_bytes"] >= index.live_bytes() == 40 * (HEADER_BYTES + PAGE_BYTES)
    dst = np.empty(PAGE_BYTES, np.uint8)
    for i in (0, 17, 39):
        assert tier.read_into(skey(i), dst) is ReadStatus.OK
        assert np.array_equal(dst, payload(i))
    tier.close()


def test_reads_report_missing_corrupt_and_foreign_values(tmp_path):
    index = FakeIndex()
    tier = open_tier(tmp_path, index)
    write(tier, range(2))
    dst = np.empty(PAGE_BYTES, np.uint8)
    assert tier.read_into(skey(99), dst) is ReadStatus.MISSING
    with tier.env.begin(write=True) as txn:
        value = bytearray(txn.get(skey(0)))
        value[HEADER_BYTES + 5] ^= 0xFF
        txn.put(skey(0), bytes(value))
        txn.put(skey(1), encode_value(FULL, b"X" * 16, b"P" * 16, payload(1)))
    assert tier.read_into(skey(0), dst) is ReadStatus.CORRUPT
    assert tier.read_into(skey(1), dst) is ReadStatus.FOREIGN
    assert tier.read_into(skey(1), np.empty(100, np.uint8)) is ReadStatus.FOREIGN
    tier.close()


def test_reopen_rebuilds_records_with_parents_and_drops_invalid_values(tmp_path):
    index = FakeIndex()
    tier = open_tier(tmp_path, index)
    write(tier, range(3), parent=b"Q" * 16)
    with tier.env.begin(write=True) as txn:
        txn.put(b"short-key", b"junk")
        txn.put(skey(50), b"not a page")
        txn.put(skey(51), encode_value(FULL, b"X" * 16, b"P" * 16, payload(51)))
    tier.close()

    tier = LmdbTier(
        ControllerConfig(disk_path=tmp_path / "lmdb", disk_sync=False),
        DIGEST,
        {FULL: PAGE_BYTES},
        lambda: 0,
        lambda n: [],
        lambda r, s: None,
    )
    records = tier.scan()
    assert [r.skey for r in records] == [skey(i) for i in range(3)]  # oldest first
    assert all(r.parent_hash == b"Q" * 16 and r.component is FULL for r in records)
    stats = tier.stats()
    assert stats["invalid_dropped"] == 2 and stats["foreign_pages"] == 1
    assert tier.stored_keys() == {skey(0), skey(1), skey(2), skey(51)}
    tier.close()


def test_one_controller_per_folder(tmp_path):
    tier = open_tier(tmp_path, FakeIndex())
    with pytest.raises(ControllerError, match="in use by another controller"):
        open_tier(tmp_path, FakeIndex())
    tier.close()


def test_the_budget_evicts_least_recently_used_pages_before_a_batch(tmp_path):
    index = FakeIndex()
    value = HEADER_BYTES + PAGE_BYTES
    tier = open_tier(tmp_path, index, disk_budget_bytes=5 * value)
    write(tier, range(5))
    write(tier, range(5, 8))
    assert index.evict_calls and index.live_bytes() == 5 * value
    assert tier.stored_keys() == {skey(i) for i in range(3, 8)}
    assert tier.stats()["pages_deleted"] == 3
    tier.close()


def test_a_page_larger_than_the_budget_is_rejected_with_the_reason(tmp_path):
    index = FakeIndex()
    tier = open_tier(tmp_path, index, disk_budget_bytes=PAGE_BYTES)
    write(tier, [1])
    (result,) = index.results
    assert not result.ok and result.map_full and "disk_budget_bytes" in result.reason
    assert tier.stats()["pages_rejected_full"] == 1
    tier.close()


def test_disk_errors_fail_the_batch_and_the_writer_lives_on(tmp_path):
    index = FakeIndex()
    tier = open_tier(tmp_path, index)
    armed = {"disk_write": 1}
    tier.fault_hook = lambda what: armed.get(what, 0) > 0 and not armed.update({what: 0})
    write(tier, [1])
    assert not index.results[0].ok and "check free space" in index.results[0].reason
    index.raise_once = True  # a failing callback must not kill the writer either
    write(tier, [2])
    write(tier, [3])
    assert [r.ok for r in index.results] == [False, True, True]
    assert tier.stats()["write_errors"] == 1
    tier.close()


def test_close_drains_every_queued_write(tmp_path):
    index = FakeIndex()
    tier = open_tier(tmp_path, index)
    for i in range(100):
        tier.submit_write(WriteJob(skey(i), FULL, b"P" * 16, payload(i)))
    assert tier.close(30.0)
    assert len(index.results) == 100 and all(r.ok for r in index.results)
    reopened = open_tier(tmp_path, FakeIndex())
    assert len(reopened.stored_keys()) == 100
    reopened.close()


def test_a_write_or_read_after_close_is_settled_as_a_failure(tmp_path):
    """A backup or a load racing shutdown has marked its page queued or being filled
    before it submits: the submit must not raise and strand that mark, but end the way
    a failed write or read does."""
    index = FakeIndex()
    tier = open_tier(tmp_path, index)
    write(tier, [1])
    assert tier.close(10.0)
    late = WriteJob(skey(2), FULL, b"P" * 16, payload(2))
    tier.submit_write(late)
    assert index.results[-1].job is late and not index.results[-1].ok
    assert "closed" in index.results[-1].reason
    dst = np.empty(PAGE_BYTES, np.uint8)
    read = tier.submit_read(tier.read_into, skey(1), dst)
    assert read.result(5.0) is ReadStatus.ERROR  # the job ran; LMDB was not touched


def test_the_reader_pool_has_at_most_one_thread_per_usable_cpu(tmp_path, monkeypatch):
    """Readers beyond the CPUs only take turns with the interpreter's lock: the pool is
    ``reader_threads`` threads, at most one per CPU the process may run on."""
    monkeypatch.setattr(lmdb_tier, "_usable_cpus", lambda: 2)
    for asked, got in ((4, 2), (1, 1)):
        index = FakeIndex()
        tier = open_tier(tmp_path / str(asked), index, reader_threads=asked)
        assert tier.readers == got
        write(tier, [1, 2, 3])
        reads = [tier.submit_read(tier.read_into, skey(i), np.empty(PAGE_BYTES, np.uint8))
                 for i in (1, 2, 3)]  # fmt: skip
        assert [r.result(5.0) for r in reads] == [ReadStatus.OK] * 3
        assert tier._readers._max_workers == got
        assert tier.close(10.0)


def test_a_backup_and_a_load_racing_shutdown_leave_their_pages_consistent(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    stored = engine.write_chain(range(2 * PAGE))
    assert ctl.backup(stored.refs([FULL])).wait(10.0) and ctl.flush(10.0)
    clear(ctl, None, [Tier.HOST])  # on disk only: a load reads it back
    ctl.store._disk.close(10.0)  # shutdown got there first
    assert ctl.prefetch(stored.page_keys([FULL])).wait(10.0) is False
    fresh = engine.write_chain(range(100, 100 + 2 * PAGE))
    assert ctl.backup(fresh.refs([FULL])).wait(10.0)  # on host; the disk write failed
    assert ctl.store.tiers_of(stored.page_keys([FULL])) == [{Tier.DISK}] * 2
    assert ctl.store.tiers_of(fresh.page_keys([FULL])) == [{Tier.HOST}] * 2
    ctl.check_invariants()
    ctl.close()


def test_an_admin_clear_racing_a_new_backup_of_the_page_never_deletes_the_new_copy(tmp_path):
    """``clear`` drops pages from the index and queues their LMDB deletes; a backup of the
    same pages that gets in between must be committed after those deletes, not deleted
    by them (the index would say on disk, LMDB would have nothing)."""
    _, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(2 * PAGE))
    assert ctl.backup(chain.refs([FULL])).wait(10.0) and ctl.flush(10.0)
    tier = ctl.store._disk.lmdb
    queue_deletes = tier.submit_delete
    backups: list[threading.Thread] = []

    def submit_delete_as_the_page_comes_back(keys) -> None:
        again = threading.Thread(target=lambda: ctl.backup(chain.refs([FULL])).wait(10.0))
        again.start()
        backups.append(again)
        again.join(0.5)  # runs now unless clear still holds the lock
        tier.flush(0.5)
        queue_deletes(keys)

    tier.submit_delete = submit_delete_as_the_page_comes_back
    clear(ctl, None, [Tier.HOST, Tier.DISK])
    tier.submit_delete = queue_deletes
    backups[0].join(10.0)
    assert ctl.flush(10.0)
    assert ctl.store.tiers_of(chain.page_keys([FULL])) == [{Tier.HOST, Tier.DISK}] * 2
    ctl.check_invariants(deep=True)  # what the index says is on disk is in LMDB
    ctl.close()


def test_a_framed_page_is_stored_from_its_own_buffer(tmp_path):
    index = FakeIndex()
    tier = open_tier(tmp_path, index)
    frame = np.zeros(HEADER_BYTES + PAGE_BYTES, np.uint8)
    frame[HEADER_BYTES:] = payload(7)
    tier.submit_write(WriteJob(skey(7), FULL, b"P" * 16, frame, framed=True))
    assert tier.flush(10.0) and index.results[0].ok
    assert decode_header(frame.tobytes()).payload_nbytes == PAGE_BYTES  # filled in place
    dst = np.empty(PAGE_BYTES, np.uint8)
    assert tier.read_into(skey(7), dst) is ReadStatus.OK
    assert np.array_equal(dst, payload(7))
    tier.close()


# -- the budget on a map that is tight -------------------------------------------------


def big_page_bytes(tier: LmdbTier) -> int:
    """A payload whose value fills exactly 16 LMDB pages (no overflow slack)."""
    return 16 * tier.env.stat()["psize"] - 16 - HEADER_BYTES


def write_big(tier: LmdbTier, ids, nbytes: int) -> None:
    for i in ids:
        tier.submit_write(WriteJob(skey(i), FULL, b"P" * 16, np.full(nbytes, i % 251, np.uint8)))
    assert tier.flush(30.0)


def test_a_budget_shrunk_at_restart_keeps_the_newest_pages_up_to_it(tmp_path):
    """The controller evicts least recently used pages down to a budget that shrank since
    the last run. The file is bigger than the new map (LMDB keeps the file's size as the
    map), and the values being deleted still fill it until their deletion commits. The
    writer sizes its room from the map LMDB really uses (it used the configured one and
    evicted every page); it keeps the newest pages, within a page or two of the budget
    (it measures room before the queued deletions commit, so it may evict a little more)."""
    index = FakeIndex()
    tier = open_tier(tmp_path, index, disk_budget_bytes=8 << 20)
    nbytes = big_page_bytes(tier)
    value = HEADER_BYTES + nbytes
    write_big(tier, range(100), nbytes)
    tier.close()

    budget = 16 * value
    index = FakeIndex()
    tier = open_tier(
        tmp_path,
        index,
        page_bytes=nbytes,
        disk_budget_bytes=budget,
        lmdb_map_size_bytes=budget * 5 // 4,
    )
    assert len(index.pages) == 100
    tier.submit_delete(index.evict(index.live_bytes() - budget))  # as PageStore.open_locked
    assert tier.flush(30.0)
    kept = index.live_bytes() // value
    assert budget - 2 * value <= index.live_bytes() <= budget, kept
    assert tier.stored_keys() == {skey(i) for i in range(100 - kept, 100)}
    # New pages are stored and the newest kept; at this floor map size the writer evicts
    # more than the budget asks (docs/operations.md), half of it at worst here.
    write_big(tier, range(100, 108), nbytes)
    kept = index.live_bytes() // value
    assert all(r.ok for r in index.results)
    assert budget // 2 <= index.live_bytes() <= budget, kept
    assert tier.stored_keys() == {skey(i) for i in range(108 - kept, 108)}
    tier.close()


def test_at_the_smallest_map_batches_keep_being_stored_and_the_newest_kept(tmp_path):
    """With ``lmdb_map_size_bytes`` at its floor (1.25 x the budget), a batch of a quarter
    of the budget cannot share a transaction with the deletions that make room for it
    (LMDB reuses freed pages only after a later commit). The writer evicts more than the
    budget asks then (docs/operations.md: 0.70 of the budget or more stays), but every
    batch is stored, the newest pages are the ones kept, and the budget is never passed."""
    index = FakeIndex()
    probe = open_tier(tmp_path / "probe", FakeIndex())
    nbytes = big_page_bytes(probe)
    probe.close()
    value = HEADER_BYTES + nbytes
    budget = 64 * value
    tier = open_tier(
        tmp_path,
        index,
        page_bytes=nbytes,
        disk_budget_bytes=budget,
        lmdb_map_size_bytes=budget * 5 // 4,
        writer_batch_pages=16,
        writer_flush_interval_s=5.0,  # every batch is exactly the 16 pages submitted
    )
    for batch in range(12):
        write_big(tier, range(16 * batch, 16 * batch + 16), nbytes)
        live = index.live_bytes()
        assert live <= budget, f"batch {batch}"
        if batch >= 4:
            assert live >= budget // 2, f"batch {batch}: {live / budget:.2f} of the budget"
        kept = live // value
        end = 16 * batch + 16
        assert tier.stored_keys() == {skey(i) for i in range(end - kept, end)}
    assert all(r.ok for r in index.results)
    tier.close()


def test_small_values_at_the_smallest_map_keep_being_stored(tmp_path):
    """Values that LMDB keeps inside leaf pages, at the floor map size: every commit
    copies the leaves its keys touch, so a writer that counted only the values' bytes
    filled the map until not one deletion could commit and rejected every later write
    (a rewrite of the writer did, and was reverted). Every batch must be stored."""
    import hashlib

    budget, batch, nbytes = 1 << 20, 64, 1000
    pages: dict[bytes, int] = {}
    results = []

    def evict(n):
        out, freed = [], 0
        while freed < n and pages:
            k = next(iter(pages))
            freed += pages.pop(k)
            out.append(k)
        return out

    def on_written(res, seconds):
        results.extend(res)
        for r in res:
            if r.ok:
                pages[r.job.skey] = r.nbytes

    cfg = ControllerConfig(
        disk_path=tmp_path / "lmdb",
        disk_budget_bytes=budget,
        lmdb_map_size_bytes=budget * 5 // 4,
        disk_sync=False,
    )
    tier = LmdbTier(cfg, b"L" * 16, {FULL: nbytes}, lambda: sum(pages.values()), evict, on_written)
    tier.start()
    try:
        for start in range(0, 4 * budget // nbytes, batch):
            for i in range(start, start + batch):
                key = hashlib.blake2b(str(i).encode(), digest_size=16).digest() + b"\0"
                payload = np.full(nbytes, i % 251, np.uint8)
                tier.submit_write(WriteJob(key, FULL, b"P" * 16, payload))
            assert tier.flush(30)
        rejected = [r for r in results if not r.ok]
        assert not rejected, f"{len(rejected)} of {len(results)} writes rejected"
        assert sum(pages.values()) <= budget
    finally:
        tier.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own niceness")
@pytest.mark.parametrize("nice", [0, 7])
def test_the_writer_thread_runs_nicer_than_the_sidecar_by_its_setting(tmp_path, nice):
    """``disk_writer_nice``: the writer thread alone is that much nicer than the process
    (its copying and hashing yield a busy CPU); the calling thread's priority is
    untouched, and the pages are stored as ever."""
    index = FakeIndex()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    tier = open_tier(tmp_path, index, disk_writer_nice=nice)
    try:
        write(tier, range(3))
        assert all(r.ok for r in index.results) and len(index.results) == 3
        writer = tier.writer._thread
        assert writer.is_alive() and writer.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == min(19, base + nice)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    finally:
        tier.close()


@pytest.mark.parametrize("nice", [-1, 20])
def test_a_writer_niceness_outside_0_to_19_is_refused(nice):
    from hicache.controller.config import ConfigError

    with pytest.raises(ConfigError, match="disk_writer_nice"):
        ControllerConfig(disk_writer_nice=nice)
