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


class FileReads:
    """Reads of the values of one LMDB environment (opened by this process) from its
    data file; see the module docstring."""

    def __init__(self, data_file: Path) -> None:
        self._path = str(data_file.resolve())  # as /proc/self/maps names it
        self._fd: int | None = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
        # Random page reads: the kernel reads what is asked, no neighbours (as LMDB's map).
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        # (first address, end, file offset) of the map a value was last found in; None
        # once the map could not be found (every value then read through it).
        self._map: tuple[int, int, int] | None = (0, 0, 0)

    def read_into(self, value: Any, tag: int, layout_digest: bytes, dst: np.ndarray) -> ReadStatus:
        """Check the stored value ``value`` (a view of the map, its transaction open) and
        copy its payload into ``dst`` (uint8, the page's size), as ``verify_into`` does."""
        off = self._offset(value)
        if (
            off is not None
            and len(value) == HEADER_BYTES + dst.nbytes
            and self._pread_into(off, tag, layout_digest, dst) is _OK
        ):
            return _OK
        return verify_into(value, (value[HEADER_BYTES:],), tag, layout_digest, dst)

    def _offset(self, value: Any) -> int | None:
        """The file offset of ``value``, or None where its map is not known."""
        found = self._map
        if found is None or self._fd is None:
            return None
        addr = np.frombuffer(value, np.uint8).ctypes.data
        lo, hi, file_off = found
        if not lo <= addr < hi:
            found = self._map = _find_map(self._path, addr)
            if found is None:
                log.warning("LMDB's map of %s not found: values read through the map", self._path)
                return None
            lo, hi, file_off = found
        return addr - lo + file_off

    def _pread_into(self, off: int, tag: int, digest: bytes, dst: np.ndarray) -> ReadStatus:
        fd = self._fd
        assert fd is not None
        n = dst.nbytes
        first = min(n, HASH_CHUNK_BYTES)
        if n > first:  # the rest of a large page read ahead while the first chunk is hashed
            os.posix_fadvise(fd, off + HEADER_BYTES + first, n - first, os.POSIX_FADV_WILLNEED)
        header = bytearray(HEADER_BYTES)
        if os.preadv(fd, [header, dst[:first]], off) != HEADER_BYTES + first:
            return ReadStatus.ERROR
        status, expected = check_header(header, tag, digest, n)
        if status is not _OK:
            return status
        if n == first:
            checksum = xxhash.xxh3_64_intdigest(dst)
        else:
            h = xxhash.xxh3_64(dst[:first])
            at, off = first, off + HEADER_BYTES
            while at < n:
                chunk = dst[at : at + HASH_CHUNK_BYTES]
                if os.preadv(fd, [chunk], off + at) != chunk.nbytes:
                    return ReadStatus.ERROR
                h.update(chunk)
                at += chunk.nbytes
            checksum = h.intdigest()
        return _OK if checksum == expected else ReadStatus.CORRUPT

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
