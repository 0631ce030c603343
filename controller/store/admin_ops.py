"""The page store's admin operations: clear, evict, prefix keys, residency and fsck.

They run under the store's lock with the same rules as its own evictions: a pinned or
busy page is never dropped, and chains are cut from the tail (a page whose child is still
present in a tier stays there), so what an admin clears never leaves a cached chain
without its head. Deletes from the LMDB tier are queued in the section that drops the
pages from the index (a backup of the same page queued after it is then committed after
the delete, never deleted by it), and waited for, so that what an admin command reports
gone is gone from LMDB. The admin verbs (:mod:`hicache.controller.admin.ops`) call these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from hicache.controller.store.counters import component_label
from hicache.controller.store.miss_reasons import MissReason
from hicache.controller.store.page_index import DiskState, HostState, PageEntry
from hicache.controller.store.store_state import StoreState
from hicache.controller.tiers.lmdb_fsck import fsck_unopened
from hicache.controller.tiers.lower_tier import FsckResult, flush_deletes
from hicache.controller_api import ControllerError, PageKey
from hicache.types import ComponentType, Tier

__all__ = ["AdminOps", "ClearResult", "FsckResult"]

_AUX = (ComponentType.SWA, ComponentType.MAMBA)


@dataclass
class ClearResult:
    host_pages: int = 0
    disk_pages: int = 0
    kept_pages: int = 0  # in scope but pinned, busy, or the head of a kept page

    def to_dict(self) -> dict[str, int]:
        return {
            "host_pages": self.host_pages,
            "disk_pages": self.disk_pages,
            "kept_pages": self.kept_pages,
        }


class AdminOps(StoreState):
    """The admin operations of a page store (the store's state is its own)."""

    def clear(self, tiers: Iterable[Tier], namespace_root: bytes | None = None) -> ClearResult:
        """Drop every unpinned page of ``tiers`` (only the chains under
        ``namespace_root`` when given). Pinned and in-flight pages are kept, and so are
        the chain heads above them."""
        tiers = set(tiers)
        out = ClearResult()
        if self._host is None:
            return out
        deletes: list[bytes] = []
        with self._lock:
            self._expire_pins_locked()
            for e in self._entries_deepest_first(namespace_root):
                if Tier.HOST in tiers and e.attached and e.host_state is HostState.READY:
                    if self._index.evictable(e, Tier.HOST):
                        before = self._host[e.component].used_pages
                        self._evict_host_locked(e, MissReason.CLEARED)
                        out.host_pages += before - self._host[e.component].used_pages
                    else:
                        out.kept_pages += 1
                if Tier.DISK in tiers and self._disk is not None and e.attached:
                    if e.disk_state is DiskState.READY and self._index.evictable(e, Tier.DISK):
                        keys = self._drop_disk_locked(e)
                        deletes += keys
                        out.disk_pages += len(keys)
                    elif e.disk_state is not DiskState.NONE:
                        out.kept_pages += 1
            if deletes:
                self._disk.delete_locked(deletes)
            events = self._index.events
            if namespace_root is None and not out.kept_pages and events is not None:
                events.cleared(frozenset(tiers))
        if deletes:
            flush_deletes(self._disk, len(deletes))
        return out

    def evict(
        self, tier: Tier, nbytes: int, component: ComponentType | None = None
    ) -> dict[str, int]:
        """Evict least-recently-used pages of ``tier`` until ``nbytes`` are freed (or
        nothing evictable is left): ``{"pages": …, "bytes": …}``. Host eviction is per
        component (every component in turn when none is given)."""
        if self._host is None:
            return {"pages": 0, "bytes": 0}
        if tier is Tier.DISK:
            if self._disk is None:
                raise ControllerError("this sidecar has no disk tier")
            with self._lock:
                before = self._index.disk_live_bytes
                keys = self.evict_stored(nbytes)
                self._disk.delete_locked(keys)
                freed = before - self._index.disk_live_bytes
            if keys:
                flush_deletes(self._disk, len(keys))
            return {"pages": len(keys), "bytes": freed}
        comps = [component] if component is not None else list(self._host.components)
        freed_pages = freed_bytes = 0
        with self._lock:
            self._expire_pins_locked()
            for comp in comps:
                while freed_bytes < nbytes:
                    victim = self._index.pop_victim(Tier.HOST, comp)
                    if victim is None:
                        break
                    before = {c: self._host[c].used_pages for c in self._host.components}
                    self._evict_host_locked(victim)
                    for c, used in before.items():
                        n = used - self._host[c].used_pages
                        freed_pages += n
                        freed_bytes += n * self._host[c].page_bytes
        return {"pages": freed_pages, "bytes": freed_bytes}

    def prefix_keys(self, page_hashes: Sequence[bytes]) -> list[PageKey]:
        """Keys of the leading pages of a chain that the store holds, every component."""
        keys: list[PageKey] = []
        with self._lock:
            for h in page_hashes:
                full = self._index.get(h + bytes((int(ComponentType.FULL),)))
                if full is None or not full.held:
                    break
                keys.append(full.key)
                for c in _AUX:
                    aux = self._index.get(h + bytes((int(c),)))
                    if aux is not None and aux.held:
                        keys.append(aux.key)
        return keys

    def residency(self) -> dict[str, dict[str, dict[str, int]]]:
        """Pages per tier and component: ``resident`` (held there) and ``pinned`` (the part
        of resident that an active pin holds)."""
        out: dict[str, dict[str, dict[str, int]]] = {"host": {}, "disk": {}}
        with self._lock:
            if self._host is None:
                return out
            self._expire_pins_locked()
            for c, pool in self._host.components.items():
                out["host"][component_label(c)] = {"resident": pool.used_pages, "pinned": 0}
            if self._disk is not None:
                for c, n in self._index.disk_pages.items():
                    if c in self._host.components:
                        out["disk"][component_label(c)] = {"resident": n, "pinned": 0}
            pinned: dict[int, PageEntry] = {}
            for rec in self._pins.records():
                for e in rec.entries:
                    pinned[id(e)] = e
            for e in pinned.values():
                label = component_label(e.component)
                if e.host_state is HostState.READY:
                    out["host"][label]["pinned"] += 1
                if e.disk_state is DiskState.READY and label in out["disk"]:
                    out["disk"][label]["pinned"] += 1
        return out

    def fsck(
        self, repair: bool = False, progress: Callable[[int, int], None] | None = None
    ) -> FsckResult:
        """Check every value of the LMDB tier (``LowerTier.fsck``; with ``repair``, the
        corrupt ones are forgotten and deleted). Before the tiers are open, the
        environment is checked on its own, the layout aside, and the tiers wait to open
        until it is done."""
        if self._disk is None:
            if not self._config.disk_enabled:
                return FsckResult()
            with self._opening:
                if self._disk is None:
                    return fsck_unopened(self._config, self._counters, repair, progress)
        return self._disk.fsck(repair, progress)

    # -- helpers (lock held) -------------------------------------------------------------

    def _entries_deepest_first(self, namespace_root: bytes | None) -> list[PageEntry]:
        """Entries (every component) ordered so that a page comes before its chain
        parent; only those under ``namespace_root`` when given."""
        entries = list(self._index)
        fulls = {e.page_hash: e for e in entries if e.component is ComponentType.FULL}
        children: dict[bytes, list[bytes]] = {}
        for e in fulls.values():
            children.setdefault(e.parent_hash, []).append(e.page_hash)
        if namespace_root is not None:
            roots = [namespace_root]
        else:
            roots = list({e.parent_hash for e in fulls.values() if e.parent_hash not in fulls})
        order: list[bytes] = []
        frontier = roots
        seen: set[bytes] = set()
        while frontier:  # breadth first: parents before children
            nxt = []
            for h in frontier:
                for c in children.get(h, ()):
                    if c not in seen:
                        seen.add(c)
                        order.append(c)
                        nxt.append(c)
            frontier = nxt
        rank = {h: i for i, h in enumerate(order)}
        if namespace_root is None:  # aux pages whose FULL page is gone still belong to "all"
            scoped = entries
        else:
            scoped = [e for e in entries if e.page_hash in rank]
        # Deepest first; at equal depth the aux pages (SWA/Mamba) before their FULL page.
        return sorted(
            scoped,
            key=lambda e: (-rank.get(e.page_hash, -1), e.component is ComponentType.FULL),
        )

    def _drop_disk_locked(self, e: PageEntry) -> list[bytes]:
        """Forget ``e``'s disk copy (with a FULL page, its SWA/Mamba pages' too), unless
        pinned or busy; the keys to delete."""
        group = [e]
        if e.component is ComponentType.FULL:
            group = [*self._index.aux_in(e, Tier.DISK), e]
        keys = []
        for x in group:
            if x.disk_state is not DiskState.READY or x.pins or x.busy:
                continue
            self._departed_locked(x, MissReason.CLEARED, Tier.DISK)
            self._index.clear_disk(x)
            keys.append(x.skey)
            self._counters.inc("evictions", "disk", component_label(x.component))
            if x.tenant:
                self._index.tenants.count(x.tenant, "evicted", "disk")
            self._index.discard_if_unused(x)
        return keys
