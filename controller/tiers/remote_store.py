"""The remote tier's store protocol, its key schema, and an in-memory store.

A remote store holds immutable page values under page storage keys. Every call takes a
deadline, answers one :class:`KeyStatus` per key in the order asked, and never raises
for I/O: a dead, slow or full store is per-key ``ERROR`` / ``FULL``, which the remote
tier treats as a miss (or a dropped write). The tier depends only on this protocol; the
Valkey/Redis Cluster store (:mod:`hicache.controller.tiers.remote_cluster`) and
:class:`MemoryStore` (for property tests and fault injection) implement it.

A value is two fields (see :func:`split_value`): ``head``, the page codec's header plus
the payload's last :data:`TAIL_BYTES`, and ``body``, the rest of the payload. Storing the
payload in one piece with the header in front makes it 72 bytes longer than a power of
two, which the server's allocator rounds up to its next size class (~27 % extra on
jemalloc); the split keeps the big field just under the page size.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hicache.controller.store.page_codec import HEADER_BYTES
from hicache.types import ComponentType

KEY_SCHEMA_VERSION = 1
# Room for the server's string header and terminator inside the body's size class.
TAIL_BYTES = 64
FIELD_HEAD = b"h"
FIELD_BODY = b"b"


class KeyStatus(enum.Enum):
    """The outcome of one key of a store call."""

    OK = "ok"  # exists: present; get: value returned; put/delete: done
    MISSING = "missing"  # exists/get: not stored
    FULL = "full"  # put: the store refused it for memory (noeviction)
    ERROR = "error"  # the node failed, timed out or answered nonsense
    SKIPPED = "skipped"  # not asked: the key's node is marked failing (a hint)


@dataclass(slots=True)
class Fetched:
    """One key of a ``get``: the status, and the two fields when OK."""

    status: KeyStatus
    head: bytes | None = None
    body: bytes | None = None


def remote_key(prefix: str, page_hash: bytes, component: ComponentType) -> bytes:
    """The store key of one page: ``<prefix>:<schema>:{<page hash hex>}:<component>``.

    The braces are a cluster hash tag over the whole page hash (uniformly random), so
    pages spread evenly over the slots and the components of one page share a node.
    The page hash is seeded by the layout fingerprint, so layouts never share a key.
    """
    tag = page_hash.hex()
    return f"{prefix}:{KEY_SCHEMA_VERSION}:{{{tag}}}:{component.name.lower()}".encode()


def split_value(frame: Any) -> tuple[bytes, memoryview]:
    """``(head, body)`` of a stored value (header followed by a payload); ``body`` is a
    view into ``frame``, not a copy.

    A payload shorter than :data:`TAIL_BYTES` goes whole into ``head``."""
    view = memoryview(frame).cast("B")
    cut = max(HEADER_BYTES, view.nbytes - TAIL_BYTES)
    head = bytes(view[:HEADER_BYTES]) + bytes(view[cut:])
    return head, view[HEADER_BYTES:cut]


def value_parts(head: bytes, body: bytes) -> tuple[memoryview, tuple[memoryview, memoryview]]:
    """The header and the payload's parts in order, for ``page_codec.verify_into``."""
    h = memoryview(head)
    return h, (memoryview(body), h[HEADER_BYTES:])


class RemoteStore(Protocol):
    """A store of page values; see the module docstring for the rules every call keeps."""

    def exists(
        self, keys: Sequence[bytes], timeout_s: float, bulk: bool = False
    ) -> list[KeyStatus]:
        """OK (present) or MISSING per key, or ERROR / SKIPPED when unknown. ``bulk``: a
        write's existence check, sent with the bulk traffic, not on the lookups' path."""
        ...

    def get(self, keys: Sequence[bytes], timeout_s: float) -> list[Fetched]:
        """Both fields of each key (OK), MISSING, or ERROR / SKIPPED."""
        ...

    def put(self, items: Sequence[tuple[bytes, bytes, bytes]], timeout_s: float) -> list[KeyStatus]:
        """Store ``(key, head, body)`` items: OK, FULL (refused for memory) or ERROR."""
        ...

    def delete(self, keys: Sequence[bytes], timeout_s: float) -> list[KeyStatus]:
        """Remove keys (OK whether or not they existed), or ERROR."""
        ...

    def ping(self, timeout_s: float) -> bool:
        """Whether the store answers at all (any node)."""
        ...

    def info(self, timeout_s: float) -> dict[str, Any]:
        """Health and size: ``{"nodes": [{"addr", "up", "used_memory_bytes", "keys", …}],
        "slots_covered": int, …}`` (JSON-safe)."""
        ...

    def close(self) -> None: ...


class MemoryStore:
    """A :class:`RemoteStore` in this process, with a byte capacity and faults to inject.

    ``capacity_bytes`` bounds the stored fields; when full, ``eviction="allkeys-lru"``
    drops least recently used keys, ``"noeviction"`` answers FULL. Faults:
    ``down`` (every call ERROR), ``delay_s`` (each call sleeps; a call whose delay
    exceeds its deadline returns ERROR at the deadline), ``fail_keys`` (those keys
    ERROR), and :meth:`corrupt` / :meth:`replace` to tamper with a stored value.
    """

    def __init__(self, capacity_bytes: int | None = None, eviction: str = "allkeys-lru") -> None:
        if eviction not in ("allkeys-lru", "noeviction"):
            raise ValueError(f"eviction must be 'allkeys-lru' or 'noeviction', got {eviction!r}")
        self.capacity_bytes = capacity_bytes
        self.eviction = eviction
        self.down = False
        self.delay_s = 0.0
        self.fail_keys: set[bytes] = set()
        self.calls: dict[str, int] = {}
        self._values: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def _begin(self, op: str, timeout_s: float) -> bool:
        """Count the call and apply the faults; False: the call fails as a whole."""
        with self._lock:
            self.calls[op] = self.calls.get(op, 0) + 1
        if self.delay_s:
            time.sleep(min(self.delay_s, timeout_s))
            if self.delay_s > timeout_s:
                return False
        return not self.down

    def exists(
        self, keys: Sequence[bytes], timeout_s: float, bulk: bool = False
    ) -> list[KeyStatus]:
        if not self._begin("exists", timeout_s):
            return [KeyStatus.ERROR] * len(keys)
        with self._lock:
            return [self._status(k, k in self._values) for k in keys]

    def _status(self, key: bytes, present: bool) -> KeyStatus:
        if key in self.fail_keys:
            return KeyStatus.ERROR
        return KeyStatus.OK if present else KeyStatus.MISSING

    def get(self, keys: Sequence[bytes], timeout_s: float) -> list[Fetched]:
        if not self._begin("get", timeout_s):
            return [Fetched(KeyStatus.ERROR) for _ in keys]
        out = []
        with self._lock:
            for k in keys:
                value = self._values.get(k)
                status = self._status(k, value is not None)
                if status is KeyStatus.OK:
                    self._values.move_to_end(k)
                    out.append(Fetched(status, *value))
                else:
                    out.append(Fetched(status))
        return out

    def put(self, items: Sequence[tuple[bytes, bytes, bytes]], timeout_s: float) -> list[KeyStatus]:
        if not self._begin("put", timeout_s):
            return [KeyStatus.ERROR] * len(items)
        out = []
        with self._lock:
            for key, head, body in items:
                if key in self.fail_keys:
                    out.append(KeyStatus.ERROR)
                    continue
                size = len(head) + len(body)
                self._drop(key)
                if self.capacity_bytes is not None:
                    if self.eviction == "noeviction" and self._bytes + size > self.capacity_bytes:
                        out.append(KeyStatus.FULL)
                        continue
                    while self._values and self._bytes + size > self.capacity_bytes:
                        self._drop(next(iter(self._values)))
                self._values[key] = (bytes(head), bytes(body))
                self._bytes += size
                out.append(KeyStatus.OK)
        return out

    def _drop(self, key: bytes) -> None:
        old = self._values.pop(key, None)
        if old is not None:
            self._bytes -= len(old[0]) + len(old[1])

    def delete(self, keys: Sequence[bytes], timeout_s: float) -> list[KeyStatus]:
        if not self._begin("delete", timeout_s):
            return [KeyStatus.ERROR] * len(keys)
        with self._lock:
            for k in keys:
                self._drop(k)
        return [KeyStatus.OK] * len(keys)

    def ping(self, timeout_s: float) -> bool:
        return self._begin("ping", timeout_s)

    def info(self, timeout_s: float) -> dict[str, Any]:
        up = self._begin("info", timeout_s)
        with self._lock:
            node = {"addr": "memory", "up": up, "used_memory_bytes": self._bytes,
                    "keys": len(self._values), "role": "master"}  # fmt: skip
        return {"nodes": [node], "slots_covered": 16384 if up else 0}

    def replace(self, key: bytes, head: bytes, body: bytes) -> None:
        """Store raw fields under ``key`` (tests: a value written by someone else)."""
        with self._lock:
            self._drop(key)
            self._values[key] = (head, body)
            self._bytes += len(head) + len(body)

    def corrupt(self, key: bytes, offset: int) -> None:
        """Flip one byte of ``key``'s body (tests: rot in the store)."""
        with self._lock:
            head, body = self._values[key]
            b = bytearray(body)
            b[offset] ^= 0xFF
            self._values[key] = (head, bytes(b))

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._values)

    def close(self) -> None:
        """Nothing to release."""
