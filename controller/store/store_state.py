"""What a page store is made of, declared once for the classes that implement its
operations: :class:`~hicache.controller.store.page_store.PageStore` (which builds it) and
the groups of operations it inherits (``copy_ops``, ``tier_host``, ``admin_ops``).

One lock (``_lock``, never handed out) covers all of it: the page index, the pins, the
queued backups, the host pages handed to engines for their own stores, the host pool and
the lower tiers (the indexed one, LMDB, is also ``_disk``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.controller.config import ControllerConfig
    from hicache.controller.store.counters import Counters
    from hicache.controller.store.engine_stores import EngineStores
    from hicache.controller.store.faults import FaultPlan
    from hicache.controller.store.fills import FillTracker
    from hicache.controller.store.host_pool import HostPool
    from hicache.controller.store.miss_reasons import MissLog, MissReason
    from hicache.controller.store.page_index import PageEntry, PageIndex
    from hicache.controller.store.pins import PinTable
    from hicache.controller.tiers.lower_tier import LowerTier
    from hicache.controller_api import PageKey
    from hicache.types import ComponentType, Tier


class StoreState:
    """The page store's state and the helpers its operation groups share (all private)."""

    _config: ControllerConfig
    _counters: Counters
    _faults: FaultPlan | None
    _lock: threading.RLock
    _opening: threading.Lock
    _index: PageIndex
    _pins: PinTable
    _fills: FillTracker
    _engine_stores: EngineStores
    _host: HostPool | None
    _disk: LowerTier | None
    _tiers: tuple[LowerTier, ...]
    _misses: MissLog

    if TYPE_CHECKING:  # defined by PageStore and its groups of operations

        def fault(self, what: str) -> bool: ...
        def host_page_bytes(self) -> dict[ComponentType, int]: ...
        def evict_stored(self, nbytes: int) -> list[bytes]: ...
        def _expire_pins_locked(self) -> None: ...
        def _alloc_host_locked(self, component: ComponentType) -> int | None: ...
        def _evict_host_locked(self, entry: PageEntry, reason: MissReason = ...) -> int: ...
        def _departed_locked(self, e: PageEntry, reason: MissReason, tier: Tier) -> None: ...
        def _host_departure_locked(self, e: PageEntry, reason: MissReason) -> None: ...
        def _count_absent_locked(self, key: PageKey, engine_id: str | None) -> None: ...
        def count_miss(
            self,
            reason: MissReason,
            tier: Tier | None,
            component: ComponentType,
            n: int = 1,
            engine_id: str | None = None,
        ) -> None: ...
        def _evict_disk_locked(self, entry: PageEntry, delete: bool) -> int: ...
        def _tenant_room_locked(self, tenant: int, component: ComponentType) -> bool: ...
        def _fits_disk_quota_locked(self, page: PageEntry) -> bool: ...
        def _settle_disk_quota_locked(self, tenant: int) -> None: ...
        def _own_locked(self, entry: PageEntry, tenant: int) -> None: ...
        def _drop_locked(self, key: PageKey, host_only: bool) -> None: ...
