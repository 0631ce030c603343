"""fsck of the LMDB tier: read every value and check its header and payload checksum.

A value of another layout is counted as foreign (never served, not corrupt). The open
tier checks its environment with :func:`scan` and repairs through the page store
(:meth:`hicache.controller.tiers.disk_tier.DiskTier.fsck`); before any layout has opened
the tier, :func:`fsck_unopened` checks the environment on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from hicache.controller.config import ControllerConfig
from hicache.controller.store.counters import Counters, Failure
from hicache.controller.store.page_codec import (
    HEADER_BYTES,
    KEY_BYTES,
    decode_header,
    payload_checksum,
)
from hicache.controller.tiers.lower_tier import FsckResult
from hicache.controller.wire.security import PRIVATE_FILE_MODE

log = logging.getLogger(__name__)

_FSCK_BATCH = 1024  # values per read transaction: a long read would pin old LMDB pages


def verdict(skey: bytes, value: Any, digest: bytes | None) -> str:
    """``corrupt`` (bad header, length or checksum), ``foreign`` (another layout) or
    ``ok``, for one LMDB value; with no ``digest`` the layout is not compared."""
    hdr = decode_header(value) if len(skey) == KEY_BYTES else None
    if (
        hdr is None
        or int(hdr.component) != skey[-1]
        or len(value) != HEADER_BYTES + hdr.payload_nbytes
    ):
        return "corrupt"
    if digest is not None and hdr.layout_digest != digest:
        return "foreign"
    if payload_checksum(value[HEADER_BYTES:]) != hdr.checksum:
        return "corrupt"
    return "ok"


def still_corrupt(env: lmdb.Environment, skeys: list[bytes], digest: bytes | None) -> list[bytes]:
    """The keys of ``skeys`` whose value is corrupt now (one read transaction): a value
    gone, or stored again since a scan, is not one to delete."""
    with env.begin(buffers=True) as txn:
        out = []
        for skey in skeys:
            now = txn.get(skey)
            if now is not None and verdict(skey, now, digest) == "corrupt":
                out.append(skey)
        return out


def scan(
    env: lmdb.Environment,
    digest: bytes | None,
    out: FsckResult,
    progress: Callable[[int, int], None] | None,
) -> list[bytes]:
    """Check every value of ``env`` in short read transactions (a long one would pin old
    pages); counts into ``out`` and returns the keys of the corrupt values."""
    total = env.stat()["entries"]
    bad: list[bytes] = []
    last: bytes | None = None
    while True:
        batch = 0
        with env.begin(buffers=True) as txn:
            cur = txn.cursor()
            more = cur.set_range(last) if last is not None else cur.first()
            if more and last is not None and bytes(cur.key()) == last:
                more = cur.next()
            while more and batch < _FSCK_BATCH:
                skey, value = bytes(cur.key()), cur.value()
                last = skey
                batch += 1
                out.checked += 1
                found = verdict(skey, value, digest)
                if found == "corrupt":
                    bad.append(skey)
                elif found == "foreign":
                    out.foreign += 1
                else:
                    out.ok += 1
                more = cur.next()
        if progress is not None:
            progress(out.checked, max(total, out.checked))
        if batch < _FSCK_BATCH:
            break
    out.corrupt = len(bad)
    if digest is None:
        out.layout_unchecked = out.ok
    if bad:
        log.warning("fsck: %d corrupt values of %d", len(bad), out.checked)
    return bad


def fsck_unopened(
    config: ControllerConfig,
    counters: Counters,
    repair: bool,
    progress: Callable[[int, int], None] | None,
) -> FsckResult:
    """fsck of a disk tier no layout has opened (the store's opening lock held): nothing
    else in this process uses the environment, so corrupt values are deleted directly."""
    out = FsckResult()
    path = Path(config.disk_path)
    if not (path / "data.mdb").exists():
        return out
    env = lmdb.open(
        str(path),
        map_size=config.map_size_bytes,
        subdir=True,
        create=False,
        readonly=not repair,
        readahead=False,
        max_dbs=0,
        mode=PRIVATE_FILE_MODE,
    )
    try:
        bad = scan(env, None, out, progress)
        if repair and bad:
            with env.begin(write=True, buffers=True) as txn:
                for skey in bad:
                    now = txn.get(skey)
                    if now is not None and verdict(skey, now, None) == "corrupt":
                        txn.delete(skey)
                        out.repaired += 1
            counters.fail(Failure.CHECKSUM, out.repaired)
    finally:
        env.close()
    return out
