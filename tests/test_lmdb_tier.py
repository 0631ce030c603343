"""The LMDB tier on a real environment: values, the writer, reads, rebuild, limits."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import numpy as np
import pytest

from hicache.controller.config import ControllerConfig
from hicache.controller.lmdb_tier import LmdbTier, ReadStatus, WriteJob
from hicache.controller.page_codec import HEADER_BYTES, decode_header, encode_value
from hicache.controller_api import ControllerError
from hicache.types import ComponentType

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


def open_tier(tmp_path, index: FakeIndex, digest: bytes = DIGEST, **overrides) -> LmdbTier:
    kw = dict(disk_path=tmp_path / "lmdb", disk_budget_bytes=1 << 20, disk_sync=False)
    kw.update(overrides)
    tier = LmdbTier(
        ControllerConfig(**kw),
        digest,
        {FULL: PAGE_BYTES},
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
    with pytest.raises(ControllerError, match="closed"):
        tier.submit_write(WriteJob(skey(0), FULL, b"P" * 16, payload(0)))
    reopened = open_tier(tmp_path, FakeIndex())
    assert len(reopened.stored_keys()) == 100
    reopened.close()


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
