"""The page store's operations on why pages are missing: the reason a lookup counts, the
departures the store's own moves record, and ``explain`` (page by page, where each page
of a chain is and why the others are not). What a reason means:
:mod:`hicache.controller.store.miss_reasons`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.controller.config import DiskWritePolicy, RemoteWritePolicy
from hicache.controller.store.miss_reasons import MissReason, RecentLookup, tier_label
from hicache.controller.store.page_entry import TAGS as _TAG
from hicache.controller.store.page_index import DiskState, PageEntry
from hicache.controller.store.store_state import StoreState
from hicache.controller_api import P_ABSENT, PageKey
from hicache.keys import chain_page_hashes
from hicache.types import ComponentType, Tier

__all__ = ["ExplainHead", "MissOps", "explain_runs"]

_WHERE = {0: "absent", 1: "host", 2: "disk", 3: "remote"}  # by Presence value
_SOME_OR_NONE = (RemoteWritePolicy.SELECTIVE, RemoteWritePolicy.OFF)
_WRITE_THROUGH = DiskWritePolicy.WRITE_THROUGH
_KEPT_REASONS = (MissReason.WRITE_FAILED, MissReason.CHECKSUM, MissReason.LAYOUT)
# Bound once (a class attribute lookup of an enum member costs several globals'): these
# run for every page evicted from host.
_EVICTED, _HOST, _DISK_NONE = MissReason.EVICTED, Tier.HOST, DiskState.NONE


@dataclass(frozen=True)
class ExplainHead:
    """What ``explain`` knows of a prompt given by its tokens: its chain's seed and the
    token bytes of its first page (to look for it under other seeds)."""

    root: bytes
    first_page: bytes
    page_size: int

    def first_hash(self, root: bytes) -> bytes:
        return chain_page_hashes(root, self.first_page, self.page_size)[0]


@dataclass
class _Why:
    reason: MissReason
    tier: Tier | None
    age_s: float | None = field(default=None)


class MissOps(StoreState):
    """The miss-reason operations of a page store (the store's state is its own)."""

    # -- lookups -------------------------------------------------------------------------

    def first_misses(
        self, page_hashes: Sequence[bytes], rows: dict[ComponentType, list[int]]
    ) -> dict[ComponentType, tuple[MissReason, Tier | None]]:
        """Per component whose row misses a page: why its first absent page is absent,
        counted once. A row that misses nothing costs one scan."""
        out = {}
        for comp, row in rows.items():
            if P_ABSENT in row:
                i = row.index(P_ABSENT)
                why = self._why_absent(page_hashes[i] + _TAG[comp])
                self._misses.count(why.reason, why.tier, comp)
                out[comp] = (why.reason, why.tier)
        return out

    def remember_lookup(self, engine_id: str, lookup: RecentLookup) -> None:
        self._misses.remember(engine_id, lookup)

    def count_miss(
        self,
        reason: MissReason,
        tier: Tier | None,
        component: ComponentType,
        n: int = 1,
        engine_id: str | None = None,
    ) -> None:
        """Count ``n`` misses of ``component`` for ``reason`` at ``tier`` (a failed load,
        a rule that declines a hit such as ``slower_than_recompute``); with ``engine_id``,
        noted on that engine's last lookup too."""
        self._misses.count(reason, tier, component, n)
        if engine_id is not None:
            self._misses.load_failed(engine_id, reason, tier)

    def _count_absent_locked(self, key: PageKey, engine_id: str | None) -> None:
        """A load (or the pin before it) found ``key`` gone: count why."""
        why = self._why_absent(key.storage_key())
        self.count_miss(why.reason, why.tier, key.component, engine_id=engine_id)

    def load_fell_short(
        self, entries: Sequence[PageEntry], engine_id: str, timed_out: bool = False
    ) -> None:
        """A load of ``entries`` failed after its reads began: count why, once per
        component (``timed_out``: the reads outlasted its deadline); a page still held
        below host (a read error, retried next time) counts nothing."""
        if timed_out:
            below = any(e.disk_state is not DiskState.NONE for e in entries)
            tier = Tier.DISK if below else Tier.REMOTE
            for comp in {e.component for e in entries}:
                self.count_miss(MissReason.DEADLINE, tier, comp, engine_id=engine_id)
            return
        with self._lock:
            for e in entries:
                if not (e.attached and e.held):
                    why = self._why_absent(e.skey)
                    self.count_miss(why.reason, why.tier, e.component, engine_id=engine_id)
                    return

    def _why_absent(self, skey: bytes) -> _Why:
        d = self._misses.departure(skey)
        if d is not None:
            return _Why(d.reason, d.tier, time.monotonic() - d.at)
        for tier in self._tiers:
            if tier.refusing():
                return _Why(MissReason.BREAKER_OPEN, tier.tier)
        return _Why(MissReason.NEVER_STORED, None)

    # -- departures (lock held) ----------------------------------------------------------

    def _departed_locked(self, e: PageEntry, reason: MissReason, tier: Tier) -> None:
        self._misses.departed(e.skey, reason, tier)

    def _host_departure_locked(self, e: PageEntry, reason: MissReason) -> None:
        """``e`` leaves the host tier for ``reason`` (evicted, cleared). Where no tier
        below keeps it because of its write policy, that is the reason it is gone; a
        write that failed, or a value dropped below, stays the reason."""
        if e.disk_state is not _DISK_NONE:
            self._misses.departed(e.skey, reason, _HOST)
            return
        before = self._misses.departure(e.skey)
        if before is not None and before.reason in _KEPT_REASONS:
            return
        if reason is _EVICTED:
            declined = self._declined_by()
            if declined is not None:
                self._misses.departed(e.skey, MissReason.WRITE_POLICY, declined)
                return
        self._misses.departed(e.skey, reason, _HOST)

    def _declined_by(self) -> Tier | None:
        """The lower tier whose write policy left a page held only on host unstored: the
        disk tier (it stores every page from a device, write-through or at eviction, so
        such a page came from the remote tier without ``remote_fill_to_disk``), else a
        remote tier that writes selectively or not at all."""
        cfg = self._config
        if self._disk is not None:
            return Tier.DISK if cfg.disk_write_policy is _WRITE_THROUGH else None
        remote = [t for t in self._tiers if t.tier is Tier.REMOTE]
        if remote and cfg.remote_write_policy in _SOME_OR_NONE:
            return Tier.REMOTE
        return None

    # -- explain -------------------------------------------------------------------------

    def explain(
        self,
        page_hashes: Sequence[bytes],
        components: Sequence[ComponentType],
        head: ExplainHead | None = None,
        rows: dict[ComponentType, list[int]] | None = None,
    ) -> list[dict[str, Any]]:
        """Page by page, where each page of the chain is per component and why an absent
        one is absent, as runs of pages alike (:func:`explain_runs`). ``rows``: the
        presence as a lookup answered it (an engine's past lookup; ``page_hashes`` may then
        be empty when no page is absent), else asked now. With
        ``head`` (the prompt's tokens are known), pages never stored are told apart from
        a prompt stored under another namespace or layout. Counts nothing."""
        if rows is None:
            rows = self.presence(page_hashes, components)
        elsewhere = self._stored_elsewhere(head) if head is not None else None
        whys: dict[ComponentType, list[_Why | None]] = {}
        for comp, row in rows.items():
            out: list[_Why | None] = []
            for i, p in enumerate(row):
                if p != P_ABSENT:
                    out.append(None)
                    continue
                why = self._why_absent(page_hashes[i] + _TAG[comp])
                if elsewhere is not None and why.reason is MissReason.NEVER_STORED:
                    why = elsewhere
                out.append(why)
            whys[comp] = out
        return explain_runs(rows, whys)

    def _stored_elsewhere(self, head: ExplainHead) -> _Why | None:
        """Whether the prompt's first page is held under another chain seed: another
        namespace (the index holds it) or another layout (a lower tier holds it as
        another layout's value)."""
        with self._lock:
            for root in self._index.roots:
                if root == head.root:
                    continue
                e = self._index.get(head.first_hash(root) + _TAG[ComponentType.FULL])
                if e is not None and e.held:
                    tier = Tier.HOST if e.present(Tier.HOST) else Tier.DISK
                    return _Why(MissReason.NAMESPACE, tier)
            for tier in self._tiers:
                if tier.holds_foreign(head.first_hash):
                    return _Why(MissReason.LAYOUT, tier.tier)
        return None

    def recent_lookups(self, engine_id: str, n: int) -> list[RecentLookup]:
        return self._misses.recent(engine_id, n)


def explain_runs(
    rows: dict[ComponentType, list[int]], whys: dict[ComponentType, list[Any]]
) -> list[dict[str, Any]]:
    """Consecutive pages with the same place and reason per component, as
    ``{"first", "last", "where": {component: place}, "why": {component: {"reason",
    "tier", "age_s"}}}`` (``why`` only for absent components; ``age_s`` of the run's
    first page, None when the store does not remember when)."""
    comps = list(rows)
    n = len(rows[comps[0]]) if comps else 0
    runs: list[dict[str, Any]] = []
    last_sig = None
    for i in range(n):
        sig = tuple(
            (rows[c][i], None if whys[c][i] is None else (whys[c][i].reason, whys[c][i].tier))
            for c in comps
        )
        if sig == last_sig:
            runs[-1]["last"] = i
            continue
        last_sig = sig
        why = {}
        for c in comps:
            w = whys[c][i]
            if w is not None:
                age = None if w.age_s is None else round(w.age_s, 3)
                why[c.name.lower()] = {
                    "reason": w.reason.value,
                    "tier": tier_label(w.tier),
                    "age_s": age,
                }
        runs.append(
            {
                "first": i,
                "last": i,
                "where": {c.name.lower(): _WHERE[rows[c][i]] for c in comps},
                "why": why,
            }
        )
    return runs
