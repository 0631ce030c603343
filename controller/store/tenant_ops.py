"""The page store's per-tenant quotas: room made from a tenant's own pages, or a refusal.

A tenant over its quota on a tier (controller/store/tenants.py) makes room there by
evicting its own least recently used pages of that tier — chains cut from the tail, as
every eviction — never another tenant's:

* **host**: before a new page gets a host page (a backup, an engine's own store, a read
  from disk). When none of the tenant's host pages can go (pinned, in flight), the new
  page is not stored: a backup or a store reports it as not held, a read fails (a miss).
* **disk**: when its writes commit. Queued writes count to the quota but cannot be
  evicted, so a tenant may stand over its disk quota by what it has queued until those
  writes commit; then its oldest committed pages go until it is within it again.

Pages found on disk at start belong to no tenant until a lookup of a tenant finds them:
only that tenant's requests name their hashes (its namespace seeds them), so they are its
own from then on and count to its quotas (over one, its oldest pages go at its next store).

A page larger than its tenant's quota is never stored on that tier. Each refusal is
counted (``failures.tenant_quota`` and the tenant's ``quota_refused``). Nothing is ever
served wrong: a page is stored whole or not at all.
:class:`~hicache.controller.store.page_store.PageStore` implements these with this class;
the operations that store pages call them with the lock held.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.controller.store.counters import Failure
from hicache.controller.store.page_entry import PageEntry
from hicache.controller.store.store_state import StoreState
from hicache.controller_api import P_ABSENT, P_DISK, P_HOST, P_REMOTE
from hicache.types import ComponentType, Tier

_UNQUEUED = [None, None, None]


class TenantOps(StoreState):
    """Quota upkeep of a page store (the store's state is its own)."""

    def _own_locked(self, entry: PageEntry, tenant: int) -> None:
        """``entry`` (in no tier yet) is ``tenant``'s page from now on."""
        if entry.tenant != tenant:
            assert not entry.held, f"{entry} changes tenant while held"
            entry.tenant = tenant
            if entry.heap_key != _UNQUEUED:
                entry.heap_key = [None, None, None]  # queued again, in its tenant's heaps too

    def _refuse_locked(self, tenant: int, tier: Tier) -> bool:
        self._index.tenants.count(tenant, "quota_refused", tier.name.lower())
        self._counters.fail(Failure.TENANT_QUOTA)
        return False

    def _tenant_room_locked(self, tenant: int, component: ComponentType) -> bool:
        """Make room for one more host page of ``component`` within ``tenant``'s host
        quota by evicting the tenant's own least recently used host pages; False
        (counted) when it cannot."""
        ledger = self._index.tenants
        if not ledger.over_quota(tenant, Tier.HOST, component):
            return True
        if not ledger.fits_quota(tenant, Tier.HOST, component):
            return self._refuse_locked(tenant, Tier.HOST)
        self._expire_pins_locked()
        while ledger.over_quota(tenant, Tier.HOST, component):
            victim = self._index.pop_tenant_victim(tenant, Tier.HOST, component)
            if victim is None:
                return self._refuse_locked(tenant, Tier.HOST)
            ledger.count(tenant, "quota_evicted", "host", self._evict_host_locked(victim))
        return True

    def _fits_disk_quota_locked(self, page: PageEntry) -> bool:
        """Whether ``page`` may be queued to disk: False (counted) when it is larger than
        its tenant's whole disk quota."""
        if self._index.tenants.fits_quota(page.tenant, Tier.DISK, page.component):
            return True
        return self._refuse_locked(page.tenant, Tier.DISK)

    def _settle_disk_quota_locked(self, tenant: int) -> None:
        """Writes of ``tenant`` committed: evict its least recently used committed disk
        pages while it stands over its disk quota (its queued writes cannot go yet)."""
        ledger = self._index.tenants
        while ledger.excess(tenant, Tier.DISK) > 0:
            victim = self._index.pop_tenant_victim(tenant, Tier.DISK)
            if victim is None:
                return
            n = self._evict_disk_locked(victim, delete=True)
            ledger.count(tenant, "quota_evicted", "disk", n)

    def _tenant_lookup_locked(
        self, tenant: str, page_hashes: Sequence[bytes], rows: dict[ComponentType, list[int]]
    ) -> None:
        """Count a lookup of ``tenant`` (its FULL pages, by result) and, after a restart,
        make the pages it found that belong to no tenant its own."""
        ledger = self._index.tenants
        tid = ledger.intern(tenant)
        full = rows.get(ComponentType.FULL)
        if full is not None:
            for label, p in (("host", P_HOST), ("disk", P_DISK), ("remote", P_REMOTE)):
                ledger.count(tid, "lookup", label, full.count(p))
            ledger.count(tid, "lookup", "miss", full.count(P_ABSENT))
        if not ledger.restored:
            return
        for comp, row in rows.items():
            tag = bytes((int(comp),))
            for h, p in zip(page_hashes, row, strict=True):
                if p in (P_HOST, P_DISK):
                    e = self._index.get(h + tag)
                    if e is not None and not e.tenant and e.held:
                        self._index.requeue(e)
                        ledger.adopt(e, tid)
