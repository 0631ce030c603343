"""Reading LMDB values out of the data file with ``preadv`` rather than through the map.

A read transaction gives a value as a view of LMDB's memory map. Copying a page out of
that view costs a page fault for every 4 KiB the process has not touched yet (after a
restart, every byte of the first load) and a TLB miss for every 4 KiB after that, where
the kernel's copy out of its page cache pays neither. So :class:`FileReads` reads a value
from ``data.mdb`` at the offset its place in the map gives, inside the same read
transaction (which keeps LMDB from reusing its pages meanwhile), header and payload in one
call into the host page, and hashes the payload a chunk at a time as it is read (a chunk
is hashed while it is still in the cache). ``preadv`` runs without the GIL, so the reader
threads' copies run in parallel.

The map stays the authority: a value whose header or checksum does not hold as read from
the file is read again through the map (:func:`~hicache.controller.store.page_codec.
verify_into`), so a wrong offset costs a second read and never condemns a sound page.
Where the map cannot be located (no ``/proc/self/maps``), every value is read through it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from hicache.controller.store.page_codec import (
    HASH_CHUNK_BYTES,
    HEADER_BYTES,
    ReadStatus,
    check_header,
    verify_into,
)

log = logging.getLogger(__name__)

_OK = ReadStatus.OK
_MAPS = Path("/proc/self/maps")
_U8 = np.uint8
_frombuffer, _preadv, _xxh3 = np.frombuffer, os.preadv, xxhash.xxh3_64_intdigest


class FileReads:
    """Reads of the values of one LMDB environment (opened by this process) from its
    data file; see the module docstring."""

    def __init__(self, data_file: Path) -> None:
        self._path = str(data_file.resolve())  # as /proc/self/maps names it
        self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
        # Random page reads: the kernel reads what is asked, no neighbours (as LMDB's map).
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        # (first address, end, file offset) of the map a value was last found in; None
        # once the map could not be found (every value then read through it).
        self._map: tuple[int, int, int] | None = (0, 0, 0)

    def read_into(self, value: Any, tag: int, layout_digest: bytes, dst: np.ndarray) -> ReadStatus:
        """Check the stored value ``value`` (a view of the map, its transaction open) and
        copy its payload into ``dst`` (uint8, the page's size), as ``verify_into`` does."""
        n = dst.nbytes
        found = self._map
        if found is not None and len(value) == HEADER_BYTES + n:
            addr = _frombuffer(value, _U8).ctypes.data
            if not found[0] <= addr < found[1]:
                found = self._locate(addr)
            if found is not None:
                off = addr - found[0] + found[2]
                if n > HASH_CHUNK_BYTES:
                    if self._pread_chunks(off, tag, layout_digest, dst) is _OK:
                        return _OK
                else:  # the common case, inline: one call reads header and payload
                    header = bytearray(HEADER_BYTES)
                    if _preadv(self._fd, [header, dst], off) == HEADER_BYTES + n:
                        status, expected = check_header(header, tag, layout_digest, n)
                        if status is _OK and _xxh3(dst) == expected:
                            return _OK
        return verify_into(value, (value[HEADER_BYTES:],), tag, layout_digest, dst)

    def _locate(self, addr: int) -> tuple[int, int, int] | None:
        """The map that holds ``addr`` (remembered), or None (then never looked for again)."""
        found = self._map = _find_map(self._path, addr)
        if found is None:
            log.warning("LMDB's map of %s not found: values read through the map", self._path)
        return found

    def _pread_chunks(self, off: int, tag: int, digest: bytes, dst: np.ndarray) -> ReadStatus:
        """A page larger than a hash chunk: header and first chunk in one call, then each
        chunk hashed as it is read (the rest read ahead meanwhile)."""
        fd, n = self._fd, dst.nbytes
        first = HASH_CHUNK_BYTES
        os.posix_fadvise(fd, off + HEADER_BYTES + first, n - first, os.POSIX_FADV_WILLNEED)
        header = bytearray(HEADER_BYTES)
        if _preadv(fd, [header, dst[:first]], off) != HEADER_BYTES + first:
            return ReadStatus.ERROR
        status, expected = check_header(header, tag, digest, n)
        if status is not _OK:
            return status
        h = xxhash.xxh3_64(dst[:first])
        at, off = first, off + HEADER_BYTES
        while at < n:
            chunk = dst[at : at + HASH_CHUNK_BYTES]
            if _preadv(fd, [chunk], off + at) != chunk.nbytes:
                return ReadStatus.ERROR
            h.update(chunk)
            at += chunk.nbytes
        return _OK if h.intdigest() == expected else ReadStatus.CORRUPT

    def close(self) -> None:
        """Close the file (the tier's readers have ended); later reads go through the map."""
        self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _find_map(path: str, addr: int) -> tuple[int, int, int] | None:
    """The mapping of ``path`` in this process that holds ``addr``: (first address, end,
    file offset of the first address); None when there is none or no maps file."""
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == path:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return lo, hi, int(fields[2], 16)
    return None
