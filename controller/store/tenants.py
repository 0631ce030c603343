"""Tenants of the page store: whose pages are where, each tenant's quota of host and disk
bytes, its own eviction order, and the per-tenant numbers the sidecar reports.

A page belongs to the tenant that stored it: the ``tenant`` named by the backup (or the
engine's own store) that first made it present. A page stored without one, or read from
the remote tier, belongs to no tenant (:data:`NO_TENANT`): it counts to no quota and is
evicted by the tier's LRU order only. One found on disk at start belongs to none until a
lookup of a tenant finds it (:meth:`TenantLedger.adopt`; tenant_ops.py). A tenant is an engine's
label, not a credential: the sidecar trusts the engines it admits (docs/isolation.md).

Bytes are payload bytes: a page counts its component's host page size on each tier that
holds it (host: from the moment a host page is reserved for it; disk: from the moment its
write is queued), so a quota is a number of pages of known size, exact at every moment.

A tenant with a quota on a tier has its own LRU heaps there (one per component on host,
one on disk), fed with the same ``(order key, seq)`` items as the index's heaps: an item
is valid in both while it is the entry's newest (``PageEntry.heap_key``), so popping it
from either makes the other stale. A tenant without a quota costs one counter update per
presence change; a page of no tenant costs a test of ``entry.tenant``.

Every method runs with the store's lock held.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hicache.controller.config import QUOTA_TIERS, parse_tenant_quotas
from hicache.controller.store.page_entry import PageEntry
from hicache.types import ComponentType, Tier

NO_TENANT = 0
_TIERS = (Tier.HOST, Tier.DISK)
_FORGET_MIN = 1024
# Counted per tenant: (what, tier name); lookups by result, the others by tier.
COUNTS = (
    *(("lookup", r) for r in ("host", "disk", "remote", "miss")),
    *((w, t) for w in ("stored", "evicted", "quota_evicted", "quota_refused") for t in QUOTA_TIERS),
)


@dataclass
class TenantRecord:
    """One tenant: its quota and bytes per tier, its eviction heaps, its counts."""

    name: str
    tid: int
    quota: dict[Tier, int | None]
    nbytes: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(_TIERS, 0))
    pages: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(_TIERS, 0))
    # Host: one heap per component; disk: one (keyed None). Only on tiers with a quota.
    heaps: dict[tuple[Tier, ComponentType | None], list] = field(default_factory=dict)
    counts: dict[tuple[str, str], int] = field(default_factory=dict)


class TenantLedger:
    """Tenants by name and id, their bytes, quotas and eviction heaps (module docstring)."""

    def __init__(
        self,
        default_quota: dict[Tier, int | None] | None = None,
        overrides: dict[str, dict[Tier, int | None]] | None = None,
        top_k: int = 10,
    ) -> None:
        self.default_quota = {t: (default_quota or {}).get(t) for t in _TIERS}
        self.overrides = overrides or {}
        self.top_k = top_k
        self.page_bytes: dict[ComponentType, int] = {}  # set when the host pool is built
        self._by_name: dict[str, TenantRecord] = {}
        self._by_id: dict[int, TenantRecord] = {}
        self._next_id = NO_TENANT + 1
        self._forget_at = _FORGET_MIN  # records past which the idle ones are dropped
        self.restored = False  # pages were found on disk at start: they are no tenant's
        self.totals: dict[tuple[str, str], int] = dict.fromkeys(COUNTS, 0)

    @classmethod
    def from_config(cls, config: Any) -> TenantLedger:
        """The ledger of a ControllerConfig's ``tenant_*`` settings."""
        default = {
            Tier.HOST: config.tenant_host_quota_bytes,
            Tier.DISK: config.tenant_disk_quota_bytes,
        }
        return cls(default, parse_tenant_quotas(config.tenant_quotas), config.tenant_metrics_top_k)

    # -- names and ids -------------------------------------------------------------------

    def intern(self, name: str | None) -> int:
        """The id of tenant ``name`` (made now if new); :data:`NO_TENANT` for None."""
        if name is None:
            return NO_TENANT
        rec = self._by_name.get(name)
        if rec is None:
            if len(self._by_id) >= self._forget_at:  # lookups of many tenants with no page
                self.forget_idle()
                self._forget_at = max(_FORGET_MIN, 2 * len(self._by_id))
            quota = {**self.default_quota, **self.overrides.get(name, {})}
            rec = TenantRecord(name, self._next_id, quota)
            self._next_id += 1
            for tier in _TIERS:
                if quota[tier] is not None:
                    keys = (
                        [(tier, c) for c in ComponentType] if tier is Tier.HOST else [(tier, None)]
                    )
                    rec.heaps.update((k, []) for k in keys)
            self._by_name[name] = rec
            self._by_id[rec.tid] = rec
        return rec.tid

    def forget_idle(self) -> None:
        """Drop the records of tenants that hold no page (their counts stay in the totals,
        so in the ``other`` bucket): the ledger never grows with tenants long gone."""
        for rec in [r for r in self._by_id.values() if not any(r.pages.values())]:
            del self._by_id[rec.tid], self._by_name[rec.name]

    # -- bytes, counts and quotas --------------------------------------------------------

    def charge(self, entry: PageEntry, tier: Tier, delta: int) -> None:
        """``entry`` (of a tenant) became present in ``tier`` (+1) or absent (-1)."""
        rec = self._by_id[entry.tenant]
        rec.pages[tier] += delta
        rec.nbytes[tier] += delta * self.page_bytes[entry.component]

    def adopt(self, entry: PageEntry, tid: int) -> None:
        """``entry`` (held, of no tenant) is tenant ``tid``'s from now on: its bytes count
        to it, and its current eviction items are queued in its heaps too."""
        entry.tenant = tid
        for tier in _TIERS:
            if entry.present(tier):
                self.charge(entry, tier, +1)
                key = entry.heap_key[tier]
                if key is not None:
                    self.push(entry, tier, (key[0], key[1], entry))

    def count(self, tid: int, what: str, label: str, n: int = 1) -> None:
        """Add ``n`` to tenant ``tid``'s count ``(what, label)`` and to the total."""
        if tid == NO_TENANT or not n:
            return
        rec = self._by_id[tid]
        key = (what, label)
        rec.counts[key] = rec.counts.get(key, 0) + n
        self.totals[key] += n

    def over_quota(self, tid: int, tier: Tier, component: ComponentType) -> bool:
        """Whether one more page of ``component`` would take tenant ``tid`` over its
        quota on ``tier`` (False without a quota there)."""
        rec = self._by_id.get(tid)
        if rec is None or rec.quota[tier] is None:
            return False
        return rec.nbytes[tier] + self.page_bytes[component] > rec.quota[tier]

    def excess(self, tid: int, tier: Tier) -> int:
        """Bytes tenant ``tid`` holds on ``tier`` beyond its quota there (0: within it)."""
        rec = self._by_id.get(tid)
        if rec is None or rec.quota[tier] is None:
            return 0
        return max(0, rec.nbytes[tier] - rec.quota[tier])

    def fits_quota(self, tid: int, tier: Tier, component: ComponentType) -> bool:
        """Whether a page of ``component`` fits tenant ``tid``'s quota on ``tier`` at all."""
        rec = self._by_id.get(tid)
        return (
            rec is None or rec.quota[tier] is None or self.page_bytes[component] <= rec.quota[tier]
        )

    # -- the tenants' own eviction order -------------------------------------------------

    def push(self, entry: PageEntry, tier: Tier, item: tuple) -> None:
        """Queue ``item`` (the index's newest for ``entry`` in ``tier``) in its tenant's
        heap of that tier, when the tenant has a quota there."""
        rec = self._by_id[entry.tenant]
        heap = rec.heaps.get((tier, entry.component if tier is Tier.HOST else None))
        if heap is None:
            return
        heapq.heappush(heap, item)
        if len(heap) > 2 * rec.pages[tier] + 64:  # mostly stale items: rebuild it
            heap[:] = [it for it in heap if _valid(it, tier)]
            heapq.heapify(heap)

    def pop_victim(
        self,
        tid: int,
        tier: Tier,
        component: ComponentType | None,
        evictable: Callable[[PageEntry, Tier], bool],
    ) -> PageEntry | None:
        """Tenant ``tid``'s least recently used evictable page of ``tier``: on host one of
        ``component`` if it has one, else of another component; it leaves the heaps."""
        rec = self._by_id[tid]
        if tier is Tier.HOST:
            order = [component, *(c for c in ComponentType if c is not component)]
            keys = [(tier, c) for c in order]
        else:
            keys = [(tier, None)]
        for key in keys:
            heap = rec.heaps.get(key, [])
            while heap:
                item = heapq.heappop(heap)
                entry = item[2]
                if not _valid(item, tier):
                    continue
                entry.heap_key[tier] = None
                if evictable(entry, tier):
                    return entry
        return None

    # -- reports and checks --------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The top ``top_k`` tenants by bytes held (host and disk), each with its bytes,
        quotas and counts, and ``other`` (every other tenant: the totals less the top's),
        plus how many tenants hold pages."""
        self.forget_idle()
        recs = sorted(self._by_id.values(), key=lambda r: (-sum(r.nbytes.values()), r.name))
        top = recs[: self.top_k]
        out: dict[str, Any] = {"tenants": len(recs), "top": {}, "other": {}}
        for rec in top:
            out["top"][rec.name] = _describe(rec.nbytes, rec.quota, rec.counts)
        rest_bytes = {t: sum(r.nbytes[t] for r in recs[self.top_k :]) for t in _TIERS}
        rest_counts = {k: v - sum(r.counts.get(k, 0) for r in top) for k, v in self.totals.items()}
        out["other"] = _describe(rest_bytes, dict.fromkeys(_TIERS), rest_counts)
        return out

    def check_invariants(
        self,
        entries: Iterable[PageEntry],
        evictable: Callable[[PageEntry, Tier], bool],
    ) -> None:
        """Each tenant's bytes and pages per tier are the sums over its present pages, and
        each evictable page of a tenant with a quota is queued in its tenant's heap."""
        want = {tid: (dict.fromkeys(_TIERS, 0), dict.fromkeys(_TIERS, 0)) for tid in self._by_id}
        seqs = {
            (tid, key): {it[1] for it in heap}
            for tid, rec in self._by_id.items()
            for key, heap in rec.heaps.items()
        }
        for e in entries:
            if e.tenant == NO_TENANT:
                continue
            assert e.tenant in want, f"{e} belongs to tenant {e.tenant}, which is unknown"
            nbytes, pages = want[e.tenant]
            for tier in _TIERS:
                if e.present(tier):
                    nbytes[tier] += self.page_bytes[e.component]
                    pages[tier] += 1
                    heap = (e.tenant, (tier, e.component if tier is Tier.HOST else None))
                    if heap in seqs and evictable(e, tier):
                        key = e.heap_key[tier]
                        assert key is not None and key[1] in seqs[heap], (
                            f"{e} is evictable from {tier.name} but not in its tenant's heap"
                        )
        for tid, (nbytes, pages) in want.items():
            rec = self._by_id[tid]
            assert rec.nbytes == nbytes, f"tenant {rec.name!r}: bytes {rec.nbytes} != {nbytes}"
            assert rec.pages == pages, f"tenant {rec.name!r}: pages {rec.pages} != {pages}"
        for key, total in self.totals.items():
            assert total >= sum(r.counts.get(key, 0) for r in self._by_id.values()), key


def _valid(item: tuple, tier: Tier) -> bool:
    """Whether a heap item is its entry's newest (else a newer one, or none, stands)."""
    entry = item[2]
    key = entry.heap_key[tier]
    return entry.attached and key is not None and key[1] == item[1]


def _describe(
    nbytes: dict[Tier, int], quota: dict[Tier, int | None], counts: dict[tuple[str, str], int]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, tier in QUOTA_TIERS.items():
        out[f"{name}_bytes"] = nbytes[tier]
        out[f"{name}_quota_bytes"] = quota[tier]
    for what, label in COUNTS:
        out.setdefault(what, {})[label] = counts.get((what, label), 0)
    return out
