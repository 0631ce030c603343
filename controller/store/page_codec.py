"""The stored form of a page: a fixed header, then the page's bytes.

::

    magic "HCPG" | format version u16 | component u8 | flags u8 | layout digest 16B |
    parent hash 16B | payload length u64 | payload xxh3-64 u64 | written at (ns) u64 |
    header crc32 u32 | pad 4B  (72 bytes, little endian)   then the payload

The parent hash lets the index rebuild chains after a restart; the layout digest (the
layout fingerprint) keeps another model's pages from ever being served; the payload
checksum catches rot in the page, the header CRC rot in the header itself. xxh3 runs at
memory speed, so checking every page on every read costs little next to the copy.
"""

from __future__ import annotations

import enum
import struct
import time
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import xxhash

from hicache.keys import HASH_BYTES
from hicache.types import ComponentType

FORMAT_VERSION = 1
_MAGIC = b"HCPG"
_HEADER = struct.Struct("<4sHBB16s16sQQQI4x")
HEADER_BYTES = _HEADER.size
_CRC_SPAN = HEADER_BYTES - 8  # the header CRC covers every field before it
KEY_BYTES = HASH_BYTES + 1
_COMPONENTS = {int(c): c for c in ComponentType}
# Parts up to this size are copied holding the GIL (a few microseconds); larger ones
# through numpy, which lets the engine's threads run during the copy.
_GIL_FREE_COPY_BYTES = 256 << 10
# Pages larger than this are copied and hashed a chunk at a time (``_copy_and_hash``):
# a chunk hashed right after its copy is read from the cache, not from memory again.
_HASH_CHUNK_BYTES = 256 << 10
# Runs of a page read into an engine's slots this long or longer are copied without the
# GIL (``verify_runs``), so that reader threads copy in parallel.
_RUN_GIL_FREE_BYTES = 64 << 10


class ReadStatus(enum.Enum):
    """The outcome of reading one stored page (from LMDB or the remote tier)."""

    OK = "ok"
    MISSING = "missing"  # not stored (evicted meanwhile)
    CORRUPT = "corrupt"  # bad header, length or checksum: never served
    FOREIGN = "foreign"  # another layout's page: never served
    ERROR = "error"  # the store failed; the value may be fine


def payload_checksum(payload: Any) -> int:
    """xxh3-64 of a page's bytes (any contiguous buffer)."""
    return xxhash.xxh3_64_intdigest(payload)


class PageHeader(NamedTuple):
    # A tuple, not a dataclass: it is decoded on every disk read.
    component: ComponentType
    layout_digest: bytes
    parent_hash: bytes
    payload_nbytes: int
    checksum: int
    written_at_ns: int


def write_header(
    frame: Any, component: ComponentType, layout_digest: bytes, parent_hash: bytes
) -> None:
    """Fill the first HEADER_BYTES of ``frame`` (a writable buffer whose rest is the
    payload) so that the whole frame is a stored value: no copy of the payload."""
    out = memoryview(frame).cast("B")
    _HEADER.pack_into(
        out,
        0,
        _MAGIC,
        FORMAT_VERSION,
        int(component),
        0,
        layout_digest,
        parent_hash,
        out.nbytes - HEADER_BYTES,
        payload_checksum(out[HEADER_BYTES:]),
        time.time_ns(),
        0,
    )
    struct.pack_into("<I", out, _CRC_SPAN, zlib.crc32(out[:_CRC_SPAN]))


def encode_into(
    buffer: bytearray,
    component: ComponentType,
    layout_digest: bytes,
    parent_hash: bytes,
    payload: Any,
) -> memoryview:
    """Header + a copy of ``payload`` in ``buffer`` (grown as needed); a view of the value.

    For payloads without room for a header in front (see :func:`write_header`). The
    writer reuses one buffer, so a value costs one copy and no fresh allocation.
    """
    view = memoryview(payload).cast("B")
    size = HEADER_BYTES + view.nbytes
    if len(buffer) < size:
        buffer.extend(bytes(size - len(buffer)))
    out = memoryview(buffer)[:size]
    out[HEADER_BYTES:] = view
    write_header(out, component, layout_digest, parent_hash)
    return out


def encode_value(
    component: ComponentType, layout_digest: bytes, parent_hash: bytes, payload: Any
) -> bytes:
    """Header + payload as a new bytes object."""
    return bytes(encode_into(bytearray(), component, layout_digest, parent_hash, payload))


def read_header(value: Any) -> tuple | None:
    """The raw header fields of a stored value, or None when its magic, version or CRC
    is wrong: ``(magic, version, tag, flags, digest, parent, nbytes, checksum, written,
    crc)``. The lean form of :func:`decode_header`, for the read path."""
    if len(value) < HEADER_BYTES:
        return None
    fields = _HEADER.unpack_from(value, 0)
    if fields[0] != _MAGIC or fields[1] != FORMAT_VERSION:
        return None
    if zlib.crc32(value[:_CRC_SPAN]) != fields[9]:
        return None
    return fields


def decode_header(value: Any) -> PageHeader | None:
    """The header of a stored value; None when it is malformed (wrong magic, version, CRC)."""
    if len(value) < HEADER_BYTES:
        return None
    magic, version, tag, _flags, digest, parent, nbytes, checksum, written, crc = (
        _HEADER.unpack_from(value, 0)
    )
    component = _COMPONENTS.get(tag)
    if magic != _MAGIC or version != FORMAT_VERSION or component is None:
        return None
    if zlib.crc32(value[:_CRC_SPAN]) != crc:
        return None
    return PageHeader(component, digest, parent, nbytes, checksum, written)


def verify_into(
    header: Any, parts: Sequence[Any], tag: int, layout_digest: bytes, dst: np.ndarray
) -> ReadStatus:
    """Check a stored page and copy its payload into ``dst`` (uint8, the page's size).

    ``header`` starts with the stored header; ``parts`` are the payload's bytes in
    order (one part for an LMDB value, two for the remote tier's split layout). Every
    tier reads through this one function, so a value served from any of them passed the
    same checks: header CRC, component tag, layout digest, length, then the payload
    checksum over the bytes as copied into ``dst`` (what is checked is what is served).
    Anything but OK leaves ``dst`` undefined.
    """
    hdr = read_header(header)
    if hdr is None or hdr[2] != tag:
        return ReadStatus.CORRUPT
    if hdr[4] != layout_digest:
        return ReadStatus.FOREIGN
    if hdr[6] != dst.nbytes or sum(len(p) for p in parts) != dst.nbytes:
        return ReadStatus.CORRUPT
    if dst.nbytes <= _HASH_CHUNK_BYTES:
        at = 0
        for part in parts:
            n = len(part)
            if n > _GIL_FREE_COPY_BYTES:
                # numpy copies without the GIL: engine threads run meanwhile.
                np.copyto(dst[at : at + n], np.frombuffer(part, np.uint8))
            elif n:  # a short copy: cheaper to call than numpy's
                memoryview(dst)[at : at + n] = part
            at += n
        checksum = payload_checksum(dst)
    else:
        checksum = _copy_and_hash(parts, dst)
    if checksum != hdr[7]:
        return ReadStatus.CORRUPT
    return ReadStatus.OK


def verify_runs(
    value: Any, tag: int, layout_digest: bytes, nbytes: int, runs: Sequence, slot: int = 0
) -> ReadStatus:
    """:func:`verify_into` for a page whose bytes go elsewhere than one host row: the
    payload of ``value`` (a whole stored value, header first) copied in pieces, each
    ``(dst, at, stride, n, offset)``: payload bytes ``[offset, +n)`` into ``dst[p : p + n]``
    (a writable byte memoryview) at ``p = at + slot * stride``, the pieces in payload
    order and covering its ``nbytes`` exactly. The same checks as :func:`verify_into`,
    the checksum over the bytes as copied into the pieces' destinations (what is checked
    is what is served); anything but OK leaves them undefined."""
    hdr = read_header(value)
    if hdr is None or hdr[2] != tag:
        return ReadStatus.CORRUPT
    if hdr[4] != layout_digest:
        return ReadStatus.FOREIGN
    if hdr[6] != nbytes or len(value) != HEADER_BYTES + nbytes:
        return ReadStatus.CORRUPT
    src = value[HEADER_BYTES:]
    h = xxhash.xxh3_64()
    update = h.update
    for dst, at, stride, n, offset in runs:
        at += slot * stride
        if n < _RUN_GIL_FREE_BYTES:  # a short copy: cheaper to call than numpy's
            out = dst[at : at + n]
            out[:] = src[offset : offset + n]
            update(out)
            continue
        for lo in range(0, n, _HASH_CHUNK_BYTES):  # hashed while still in the cache
            m = min(_HASH_CHUNK_BYTES, n - lo)
            out = dst[at + lo : at + lo + m]
            # numpy copies and xxh3 hashes without the GIL: other readers run meanwhile
            np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(src, np.uint8, m, offset + lo))
            update(out)
    if h.intdigest() != hdr[7]:
        return ReadStatus.CORRUPT
    return ReadStatus.OK


def _copy_and_hash(parts: Sequence[Any], dst: np.ndarray) -> int:
    """Copy ``parts`` into ``dst`` a chunk at a time, hashing each chunk as copied while it
    is still in the cache (one pass over memory, not two; the same xxh3 as a whole-page
    hash, over the bytes as they are in ``dst``)."""
    h = xxhash.xxh3_64()
    at = 0
    for part in parts:
        src = np.frombuffer(part, np.uint8)
        for lo in range(0, src.size, _HASH_CHUNK_BYTES):
            chunk = src[lo : lo + _HASH_CHUNK_BYTES]
            out = dst[at : at + chunk.size]
            np.copyto(out, chunk)  # without the GIL, as the hash
            h.update(out)
            at += chunk.size
    return h.intdigest()
