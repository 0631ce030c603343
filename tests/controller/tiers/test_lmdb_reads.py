"""Values read from LMDB's data file (``FileReads``): the bytes the map holds, read where
the map says; a wrong offset never condemns a sound page, and a flipped bit is never
served whichever way it is read."""

from __future__ import annotations

import hashlib
from pathlib import Path

import lmdb
import numpy as np
import pytest

from hicache.controller.store.page_codec import HASH_CHUNK_BYTES, HEADER_BYTES, encode_value
from hicache.controller.tiers.lmdb_reads import FileReads
from hicache.controller.tiers.lmdb_tier import ReadStatus
from hicache.types import ComponentType

FULL = ComponentType.FULL
TAG = int(FULL)
DIGEST = b"R" * 16
# One page of a hash chunk or less (one call), and two larger ones (read chunk by chunk).
SIZES = (4096, HASH_CHUNK_BYTES, 2 * HASH_CHUNK_BYTES + 4096 + 8)


def skey(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest() + bytes((TAG,))


def payload(i: int, n: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def env(tmp_path: Path):
    e = lmdb.open(str(tmp_path), map_size=64 << 20, readahead=False)
    with e.begin(write=True) as txn:
        for i, n in enumerate(SIZES):
            txn.put(skey(i), encode_value(FULL, DIGEST, b"p" * 16, payload(i, n)))
    reads = FileReads(tmp_path / "data.mdb")
    yield e, reads
    reads.close()
    e.close()


def read(e: lmdb.Environment, reads: FileReads, i: int, digest: bytes = DIGEST):
    dst = np.zeros(SIZES[i], np.uint8)
    with e.begin(buffers=True) as txn:
        status = reads.read_into(txn.get(skey(i)), TAG, digest, dst)
    return status, dst


def test_every_size_reads_the_stored_bytes_from_the_file(env) -> None:
    e, reads = env
    for i, n in enumerate(SIZES):
        status, dst = read(e, reads, i)
        assert status is ReadStatus.OK
        assert np.array_equal(dst, payload(i, n))
    lo, hi, _ = reads._map  # found in this process's maps: the file path was taken
    assert lo < hi


def test_a_wrong_offset_falls_back_to_the_map_and_serves_the_sound_page(env) -> None:
    e, reads = env
    status, _ = read(e, reads, 0)  # locates the map
    lo, hi, file_off = reads._map
    for shift in (HEADER_BYTES, 4096, -4096):
        reads._map = (lo, hi, file_off + shift)  # every offset off by ``shift`` bytes
        for i, n in enumerate(SIZES):
            status, dst = read(e, reads, i)
            assert status is ReadStatus.OK
            assert np.array_equal(dst, payload(i, n))


def test_a_map_not_found_reads_through_the_map(env) -> None:
    e, reads = env
    reads._map = None
    for i, n in enumerate(SIZES):
        status, dst = read(e, reads, i)
        assert status is ReadStatus.OK
        assert np.array_equal(dst, payload(i, n))


@pytest.mark.parametrize("where", ["payload_first", "payload_last", "header"])
def test_a_flipped_bit_is_corrupt_whichever_way_it_is_read(env, where: str) -> None:
    e, reads = env
    for i, n in enumerate(SIZES):
        with e.begin(write=True) as txn:
            value = bytearray(txn.get(skey(i)))
            at = {"payload_first": HEADER_BYTES, "payload_last": HEADER_BYTES + n - 1}.get(where, 8)
            value[at] ^= 0x10
            txn.put(skey(i), bytes(value))
        for broken_map in (False, True):
            if broken_map:
                reads._map = None
            status, _ = read(e, reads, i)
            assert status is ReadStatus.CORRUPT
            reads._map = (0, 0, 0)  # found again on the next read


def test_another_layouts_page_is_foreign(env) -> None:
    e, reads = env
    for i in range(len(SIZES)):
        status, _ = read(e, reads, i, digest=b"X" * 16)
        assert status is ReadStatus.FOREIGN


def test_after_close_values_are_read_through_the_map(env) -> None:
    e, reads = env
    reads.close()
    status, dst = read(e, reads, 1)
    assert status is ReadStatus.OK
    assert np.array_equal(dst, payload(1, SIZES[1]))
