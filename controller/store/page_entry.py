"""One page of one component as the controller's index knows it: its states per tier,
its chain, its pins and holds, and its place in the eviction heaps."""

from __future__ import annotations

import enum
from typing import Protocol

from hicache.controller_api import PageKey
from hicache.types import ComponentType, Tier

_TIERS = (Tier.HOST, Tier.DISK)
_HOST = Tier.HOST
# A component's tag byte in storage keys (PageKey.storage_key), made once.
TAGS = {c: bytes((int(c),)) for c in ComponentType}


class HostState(enum.IntEnum):
    NONE = 0
    FILLING = 1  # a host page is reserved; a copy into it is in flight
    READY = 2


class DiskState(enum.IntEnum):
    NONE = 0
    PENDING = 1  # queued to the LMDB writer, not committed yet
    READY = 2  # committed


_HOST_NONE = HostState.NONE
_DISK_NONE = DiskState.NONE


class PageEntry:
    """One page of one component and everything the controller knows about it."""

    __slots__ = (
        "attached",
        "busy",
        "children",
        "component",
        "copies",
        "disk_nbytes",
        "disk_state",
        "engine_key",
        "fill",
        "heap_key",
        "host_page",
        "host_state",
        "last_access",
        "page_hash",
        "parent_hash",
        "pending_payload",
        "pins",
        "retain",
        "skey",
        "tenant",
    )

    def __init__(self, component: ComponentType, page_hash: bytes, parent_hash: bytes) -> None:
        self.component = component
        self.page_hash = page_hash
        self.parent_hash = parent_hash
        self.skey = page_hash + TAGS[component]
        self.host_page = -1
        self.host_state = _HOST_NONE
        self.disk_state = _DISK_NONE
        self.disk_nbytes = 0
        self.pins = 0
        self.busy = 0
        self.copies = 0  # device copies in flight: the part of ``busy`` they hold
        self.last_access = 0
        # Per tier (indexed by Tier value): FULL children present there, and the
        # (order key, seq) of this entry's newest heap item per tier, None when it has none;
        # the order key is the last access, plus ``retain`` in the host tier.
        self.children = [0, 0, 0]
        self.heap_key: list[tuple[int, int] | None] = [None, None, None]
        self.retain = 0  # clock ticks added to its host eviction key (it served a load)
        self.attached = False
        self.tenant = 0  # whose page it is (controller/store/tenants.py); 0: no tenant's
        # A future that resolves when an in-flight host fill ends (True: filled).
        self.fill = None
        # Write-back: the bytes of a host-evicted page until the writer commits them.
        self.pending_payload: bytes | None = None
        # The engine's own name for the page (hicache/engine_keys.py), for KV events.
        self.engine_key: bytes | None = None

    @property
    def key(self) -> PageKey:
        return PageKey(self.component, self.page_hash)

    def present(self, tier: Tier) -> bool:
        if tier is _HOST:
            return self.host_state is not _HOST_NONE
        return self.disk_state is not _DISK_NONE

    @property
    def held(self) -> bool:
        """Whether the controller can serve this page (from host, or through a disk read)."""
        return self.host_state is not _HOST_NONE or self.disk_state is not _DISK_NONE

    def __repr__(self) -> str:
        return (
            f"PageEntry({self.component.name} {self.page_hash.hex()[:8]} "
            f"host={self.host_state.name}:{self.host_page} disk={self.disk_state.name} "
            f"pins={self.pins} busy={self.busy})"
        )


class DiskRecordLike(Protocol):
    """What the page index reads of a page found on disk when it is rebuilt."""

    skey: bytes
    component: ComponentType
    page_hash: bytes
    parent_hash: bytes
    nbytes: int
