"""The cache's side of the host and disk tiers: backups by write policy, hits beyond the
device, and load-back through the component hooks (ARCHITECTURE §4).

A mixin of :class:`~hicache.cache.UnifiedRadixCache`; it talks to the controller only
through the :class:`~hicache.controller_api.CacheController` protocol.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hicache.components.base import LoadPlan, LoadPrep
from hicache.config import PrefetchPolicy, WritePolicy
from hicache.controller_api import (
    P_ABSENT,
    P_DISK,
    P_HOST,
    P_REMOTE,
    CacheController,
    LookupResult,
    PageKey,
    unsettled_load,
)
from hicache.keys import chain_page_hashes
from hicache.request import EvictResult, LockReceipt, MatchResult, Request
from hicache.tree import TreeNode
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.cache import UnifiedRadixCache

log = logging.getLogger("hicache.tiering")

_ABSENT_TIER = P_REMOTE + 1  # worse than any tier in the per-page tier arrays below


@dataclass
class _PendingBackup:
    handle: Any
    receipts: list[LockReceipt]
    pairs: list[tuple[TreeNode, int]]  # (node, component index) whose pages are in flight


_SETTLE_POLL_S = 0.01


@dataclass
class _Quarantined:
    """Slots of a failed load-back that its copy may still write into, until ``pending``
    is done: owned by the cache meanwhile, neither free nor any request's."""

    pending: Any
    slots: list[tuple[Any, np.ndarray]]  # (allocator, pages)
    # For a write-back's pages: the amounts an eviction counted as freed, per component.
    freed: list[tuple[ComponentType, int]] = field(default_factory=list)


class TieringMixin:
    """Backups, beyond-device matches and load-backs of UnifiedRadixCache."""

    def __init__(self: UnifiedRadixCache, controller: CacheController | None) -> None:
        self.controller = controller
        self._pending: list[_PendingBackup] = []
        self._inflight: Counter[tuple[int, int]] = Counter()
        self._quarantine: list[_Quarantined] = []
        self._freeing_unsettled: _Quarantined | None = None
        self._quarantined_during_evict: list[_Quarantined] = []
        if controller is not None:
            controller.register(self.layout, self.page_size, self.pools)

    # -- backups -------------------------------------------------------------------------

    def _ready_event(self: UnifiedRadixCache) -> Any:
        """An event after the engine's queued work, so a backup reads finished KV."""
        if self.pools.full.buffer.is_cuda:
            event = torch.cuda.Event()
            event.record()
            return event
        return None

    def backup_nodes(self: UnifiedRadixCache, nodes: list[TreeNode]) -> None:
        """Copy the device values of ``nodes`` (root to leaf order) that the controller does
        not hold yet; each node stays locked until its copy is acknowledged."""
        refs, pairs, locked = [], [], []
        for node in nodes:
            mine = []
            for comp in self.components:
                cd = node.data[comp.idx]
                if (
                    cd.value is not None
                    and not cd.backed
                    and not self._inflight[(node.id, comp.idx)]
                ):
                    refs += comp.backup_refs(node)
                    mine.append((node, comp.idx))
            if mine:
                pairs += mine
                locked.append(node)
        if not refs:
            return
        receipts = [self.lock(node) for node in locked]
        try:
            handle = self.controller.backup(refs, self._ready_event())
        except Exception as exc:  # a failed backup only costs the copy, never the device data
            log.warning("backup of %d pages failed: %s", len(refs), exc)
            self.counters["backup_failed"] += 1
            for r in receipts:
                self.unlock(r, touch=False)
            return
        for pair in pairs:
            self._inflight[(pair[0].id, pair[1])] += 1
        self._pending.append(_PendingBackup(handle, receipts, pairs))
        self.counters["backup_pages"] += len(refs)

    def evict(
        self: UnifiedRadixCache, full_tokens: int = 0, swa_tokens: int = 0, mamba_states: int = 0
    ) -> EvictResult:
        """Finish acknowledged backups (their locks go), then evict (see RadixTree.evict)."""
        self.poll_transfers()
        return super().evict(full_tokens, swa_tokens, mamba_states)

    def poll_transfers(self: UnifiedRadixCache) -> None:
        """Finish the backups that are done (their locks go) and free the slots of failed
        load-backs whose copies have settled. A backup whose handle is not done keeps its
        nodes locked, even past its deadline: its copy may still read them."""
        if self._pending:
            still = []
            for pending in self._pending:
                if pending.handle.done():
                    self._finish_backup(pending)
                else:
                    still.append(pending)
            self._pending = still
        if self._quarantine:
            self._release_quarantine()

    def flush_backups(self: UnifiedRadixCache, timeout_s: float | None = None) -> None:
        """Wait for every pending backup: for its outcome (up to ``timeout_s`` each, or its
        own deadline), then until it is done (all within ``timeout_s``, or
        ``load_timeout_s``, from the call). One still not done stays pending, its nodes
        locked: its copy may still read them."""
        settle_end = time.monotonic() + (
            self.config.load_timeout_s if timeout_s is None else timeout_s
        )
        for pending in list(self._pending):
            handle = pending.handle
            if handle.done():
                continue
            handle.wait(timeout_s)
            # One settling budget for the whole flush: handles of a sidecar that stopped
            # answering settle together (at the next session), not one after the other.
            while not handle.done() and time.monotonic() < settle_end:
                time.sleep(_SETTLE_POLL_S)
        self.poll_transfers()

    def _release_quarantine(self: UnifiedRadixCache) -> None:
        still = []
        for q in self._quarantine:
            if q.pending.done():
                for allocator, pages in q.slots:
                    allocator.free_pages(pages)
                self.counters["quarantine_released"] += 1
            else:
                still.append(q)
        self._quarantine = still

    def _finish_backup(self: UnifiedRadixCache, pending: _PendingBackup) -> None:
        ok = bool(pending.handle.wait(0))
        for node, idx in pending.pairs:
            key = (node.id, idx)
            self._inflight[key] -= 1
            if not self._inflight[key]:
                del self._inflight[key]
            # An aux component counts as held only with its FULL pages (which another,
            # unfinished or failed, backup may carry).
            if ok and (idx == 0 or node.data[0].backed):
                node.data[idx].backed = True
        for r in pending.receipts:
            self.unlock(r, touch=False)
        self.counters["backup_done" if ok else "backup_failed"] += 1

    def after_insert(self: UnifiedRadixCache, touched: list[TreeNode]) -> None:
        """Write-through: back up the inserted path (with any unbacked ancestors)."""
        if self.controller is None or not touched:
            return
        if self.config.write_policy is WritePolicy.WRITE_THROUGH:
            self.backup_nodes(self.path_to_root(touched[-1]))

    def on_prefix_hit(self: UnifiedRadixCache, nodes: list[TreeNode]) -> None:
        """Count hits; selective write-through backs up a prefix once it is hit enough."""
        for node in nodes:
            node.hit_count += 1
            self.leaf_policy.on_hit(node)
        if self.controller is None:
            return
        if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            hot = [n for n in nodes if n.hit_count >= self.config.write_through_threshold_hits]
            if hot:
                self.backup_nodes(self.path_to_root(hot[-1]))

    def before_device_free(self: UnifiedRadixCache, node: TreeNode) -> None:
        """Write-back: copy ``node`` to the controller before its device pages go."""
        if self.controller is None or self.config.write_policy is not WritePolicy.WRITE_BACK:
            return
        refs, idxs = [], []
        for comp in self.components:
            cd = node.data[comp.idx]
            if cd.value is not None and not cd.backed:
                refs += comp.backup_refs(node)
                idxs.append(comp.idx)
        if not refs:
            return
        try:
            handle = self.controller.backup(refs, self._ready_event())
            ok = handle.wait(self.config.load_timeout_s)
            if not handle.done():
                # The copy may still read the pages about to be freed: they go to the
                # quarantine instead, in after_device_free, until it settles.
                comps = [self.components[i] for i in idxs]
                self._freeing_unsettled = _Quarantined(
                    handle,
                    [s for c in comps for s in c.device_pages(node)],
                    [(c.ctype, c.size(node.data[c.idx].value)) for c in comps],
                )
        except Exception as exc:
            log.warning("write-back of %d pages failed: %s", len(refs), exc)
            ok = False
        self.counters["backup_pages"] += len(refs)
        self.counters["backup_done" if ok else "backup_failed"] += 1
        if ok:
            for idx in idxs:
                node.data[idx].backed = True

    def after_device_free(self: UnifiedRadixCache, node: TreeNode) -> None:
        q, self._freeing_unsettled = self._freeing_unsettled, None
        if q is not None:
            for allocator, pages in q.slots:
                allocator.take_pages(pages)
            self._quarantine.append(q)
            self._quarantined_during_evict.append(q)
            self.counters["write_back_quarantined"] += 1
        super().after_device_free(node)

    def evict_device_leaf(self: UnifiedRadixCache, node: TreeNode, result: EvictResult) -> None:
        """As RadixTree's, but pages a write-back put in the quarantine are not freed: the
        result (and so the eviction that asked) does not count them."""
        super().evict_device_leaf(node, result)
        for q in self._quarantined_during_evict:
            for ctype, amount in q.freed:
                result.add(ctype, -amount)
        self._quarantined_during_evict.clear()

    def check_transfer_invariants(self: UnifiedRadixCache) -> None:
        """Every in-flight backup still holds its locks."""
        for pending in self._pending:
            for r in pending.receipts:
                assert not r.released and r.node.data[0].lock_ref > 0, "in-flight backup unlocked"
        counted: Counter[tuple[int, int]] = Counter()
        for pending in self._pending:
            for node, idx in pending.pairs:
                counted[(node.id, idx)] += 1
        assert counted == self._inflight, "in-flight pages differ from pending backups"

    # -- hits beyond the device ----------------------------------------------------------

    def match_beyond_device(
        self: UnifiedRadixCache,
        root: TreeNode,
        key: bytes,
        result: MatchResult,
        path: list[TreeNode],
        partial: TreeNode | None,
        k: int,
    ) -> None:
        """Fill ``result.host_hit_len`` / ``disk_hit_len`` / ``load_node`` from a controller
        lookup of the pages after the device prefix (tree nodes and beyond the tree)."""
        ps = self.page_size
        last = result.last_node
        start = last.end
        sub_path, sub_partial, sub_k = self.walk(last, key, start * 8)
        hashes, device = self._hashes_after(last, key, sub_path, sub_partial, sub_k)
        comps = [c.ctype for c in self.components]
        try:
            lookup = self.controller.lookup(hashes, comps)
        except Exception as exc:
            log.warning("lookup failed: %s", exc)
            self.counters["lookup_failed"] += 1
            return
        self._forget_lost(sub_path, sub_partial, sub_k, lookup)
        tiers = self._end_tiers(lookup, device, start)
        host_pages = _last_at_most(tiers, P_HOST)
        disk_pages = _last_at_most(tiers, P_DISK)
        remote_pages = _last_at_most(tiers, P_REMOTE)
        result.host_hit_len = host_pages * ps
        result.disk_hit_len = (disk_pages - host_pages) * ps
        result.remote_hit_len = (remote_pages - disk_pages) * ps
        load_pages = host_pages
        if remote_pages > host_pages:
            # Disk and remote pages are read into host by a prefetch or the load's pin.
            policy = self.config.prefetch_policy
            if policy is PrefetchPolicy.WAIT_COMPLETE:
                load_pages = remote_pages
            else:
                handle = self.controller.prefetch(self._disk_keys(lookup, remote_pages, hashes))
                if policy is PrefetchPolicy.TIMEOUT and handle.wait(self.config.prefetch_timeout_s):
                    # Every page asked for is on host now (a second lookup would count the
                    # match's pages twice); one evicted before the load's pin is a miss.
                    load_pages = remote_pages
        if load_pages:
            result.load_node = self._materialize(
                last, key, sub_path, sub_partial, sub_k, start + load_pages * ps, lookup
            )

    def _hashes_after(
        self: UnifiedRadixCache,
        last: TreeNode,
        key: bytes,
        sub_path: list[TreeNode],
        sub_partial: TreeNode | None,
        sub_k: int,
    ) -> tuple[list[bytes], dict[int, np.ndarray]]:
        """Page hashes from ``last``'s end to the end of ``key``, and per component a bool
        per page (MAMBA: per page end) saying the device already holds it."""
        ps = self.page_size
        hashes: list[bytes] = []
        nodes = list(sub_path)
        if sub_partial is not None and sub_k:
            nodes.append(sub_partial)
        total = len(key) // 8 // ps - last.end // ps
        device = {c.idx: np.zeros(total, dtype=bool) for c in self.components}
        for node in nodes:
            take = node.num_tokens // ps if node is not sub_partial else sub_k // ps
            off = len(hashes)
            hashes += self.node_hashes(node)[:take]
            for comp in self.components:
                if node.data[comp.idx].value is None:
                    continue
                if comp.ctype is ComponentType.MAMBA:
                    if take == node.num_tokens // ps:
                        device[comp.idx][off + take - 1] = True
                else:
                    device[comp.idx][off : off + take] = True
        prev = hashes[-1] if hashes else self.parent_hash_at(last)
        covered = last.end + len(hashes) * ps
        hashes += chain_page_hashes(prev, key[covered * 8 :], ps)
        return hashes, device

    def _forget_lost(
        self: UnifiedRadixCache,
        sub_path: list[TreeNode],
        sub_partial: TreeNode | None,
        sub_k: int,
        lookup: LookupResult,
    ) -> None:
        """Remove the first host-only node on the path whose first page the controller no
        longer holds (with its subtree, all host-only): it can never hit again."""
        full = lookup.presence[ComponentType.FULL]
        off = 0
        for node in [*sub_path, *([sub_partial] if sub_partial is not None and sub_k else [])]:
            if node.data[0].value is None and full[off] == P_ABSENT:
                if node.parent is not None:
                    self.remove_subtree(node)
                return
            off += node.num_tokens // self.page_size
            if off >= full.size:
                return

    def parent_hash_at(self: UnifiedRadixCache, node: TreeNode) -> bytes:
        """The chain hash at ``node``'s end (``h_0`` for a namespace root)."""
        return self.node_hashes(node)[-1] if node.parent is not None else node.hashes[0]

    def _end_tiers(
        self: UnifiedRadixCache, lookup: LookupResult, device: dict[int, np.ndarray], start: int
    ) -> np.ndarray:
        """For each page j after ``start``: the slowest tier a match ending after page j
        needs (0 device, 1 host, 2 disk, 3 impossible)."""
        ps = self.page_size
        worst = None
        for comp in self.components:
            t = lookup.presence[comp.ctype].astype(np.int64)
            t = np.where(t == P_ABSENT, _ABSENT_TIER, t)
            t[device[comp.idx][: t.size]] = 0
            if comp.ctype is ComponentType.FULL:
                t = np.maximum.accumulate(t) if t.size else t
            elif comp.ctype is ComponentType.SWA:
                w = -(-self.config.sliding_window // ps)
                padded = np.concatenate([np.zeros(w - 1, dtype=np.int64), t])
                t = np.lib.stride_tricks.sliding_window_view(padded, w).max(axis=1)
            worst = t if worst is None else np.maximum(worst, t)
        return worst

    def _disk_keys(
        self: UnifiedRadixCache, lookup: LookupResult, pages: int, hashes: list[bytes]
    ) -> list[PageKey]:
        keys = []
        for comp in self.components:
            p = lookup.presence[comp.ctype][:pages]
            on_disk = np.flatnonzero((p == P_DISK) | (p == P_REMOTE))
            keys += [PageKey(comp.ctype, hashes[j]) for j in on_disk.tolist()]
        return keys

    def _materialize(
        self: UnifiedRadixCache,
        last: TreeNode,
        key: bytes,
        sub_path: list[TreeNode],
        sub_partial: TreeNode | None,
        sub_k: int,
        end: int,
        lookup: LookupResult,
    ) -> TreeNode:
        """The tree node ending exactly at ``end`` on the query path, splitting a node or
        adding a host-only node (marked backed by the lookup) as needed."""
        node = last
        for n in sub_path:
            if n.end > end:
                return self.split(n, end - n.start)
            node = n
            if n.end == end:
                return n
        if sub_partial is not None and sub_k:
            if end < sub_partial.start + sub_k:
                return self.split(sub_partial, end - sub_partial.start)
            node = self.split(sub_partial, sub_k)
            if node.end == end:
                return node
        new = self.add_child(node, key[node.end * 8 : end * 8])
        self.mark_host_only(new)
        first = (node.end - last.end) // self.page_size
        pages = slice(first, (end - last.end) // self.page_size)
        for comp in self.components[1:]:
            p = lookup.presence[comp.ctype]
            if comp.ctype is ComponentType.MAMBA:
                new.data[comp.idx].backed = bool(p[pages.stop - 1] != P_ABSENT)
            else:
                new.data[comp.idx].backed = bool(np.all(p[pages] != P_ABSENT))
        self.prune_host_only(keep=new)
        return new

    # -- load-back -----------------------------------------------------------------------

    def load_back(
        self: UnifiedRadixCache,
        node: TreeNode,
        req: Request | None = None,
        mem_quota: int | None = None,
    ) -> bool:
        """Bring the prefix ending at ``node`` from the host/disk tiers to the device.

        With ``req`` (right after its ``match_prefix``), the loaded tokens extend its
        prefix: ``kv_slots``, ``prefix_len``, lock and Mamba state. ``mem_quota`` caps the
        FULL tokens it may allocate. On any failure it returns False with the pools and
        the request exactly as they were: the request recomputes instead.
        """
        self.poll_transfers()
        if self.controller is None:
            return False
        if not self._attached(node):
            # Forgotten since the match (another match pruned the host-only record, or
            # the controller lost the pages): a miss, the request recomputes.
            return self._load_failed("evicted")
        base = self._load_base(node, req)
        nodes = self._nodes_between(base, node)
        for comp in self.components:
            cut = comp.load_cut(node.end)
            for i, n in enumerate(nodes):
                if cut is not None and n.start < cut < n.end:
                    nodes.insert(i, self.split(n, cut - n.start))
                    break
        plan = LoadPlan(base, nodes, node)
        keys = [k for comp in self.components for k in comp.plan_load(plan)]
        need_full = sum(n.num_tokens for n in plan.parts[self.full.idx])
        if mem_quota is not None and need_full > mem_quota:
            return self._load_failed("quota")
        pin = None
        if keys:
            try:
                pin = self.controller.pin(keys, self.config.load_timeout_s * 2)
            except Exception as exc:
                log.warning("pin for load-back failed: %s", exc)
            if pin is None:
                return self._load_failed("pin")
        deepest_device = base
        for n in nodes:
            if n.data[0].value is not None:
                deepest_device = n
        receipt = self.lock(deepest_device)
        # That lock's SWA part stops at the first tombstone; the SWA pages above it that
        # the loaded window needs must survive the eviction that makes room for the load.
        swa = self.by_type.get(ComponentType.SWA)
        window_held = swa.hold_window(node) if swa is not None else []
        preps: dict[int, LoadPrep] = {}
        ok, reason = False, "copy"
        unsettled = None  # the handle of a failed copy that may still write
        loading = {n.id for n in nodes} - self.loading
        self.loading |= loading
        try:
            self._make_room_for(plan, need_full)
            if not self._attached(node):  # a controller callback dropped the path meanwhile
                raise _PrefixDropped("the prefix left the tree while room was made for it")
            for comp in self.components:
                preps[comp.idx] = comp.prepare_load_back(plan, req)
            refs = [r for p in preps.values() for r in p.refs]
            if refs:
                result = self.controller.load(refs, pin, self.config.load_timeout_s)
                ok = bool(result)
                unsettled = None if ok else unsettled_load(result)
            else:
                ok = True
        except Exception as exc:
            reason = "evicted" if isinstance(exc, _PrefixDropped) else type(exc).__name__
            log.warning("load-back of %d tokens failed: %s", node.end - base.end, exc)
        finally:
            self.loading -= loading
            aside: list[tuple[Any, np.ndarray]] = []
            for comp in self.components:
                if comp.idx not in preps:
                    continue
                if unsettled is not None and preps[comp.idx].refs:
                    # The copy may still write into these slots: keep them from every
                    # request until it has settled (nothing else to undo: a failed load
                    # leaves the request as it was).
                    aside += comp.load_targets(preps[comp.idx])
                else:
                    comp.finalize_load_back(plan, req, preps[comp.idx], ok)
            if aside:
                self._quarantine.append(_Quarantined(unsettled, aside))
                self.counters["load_back_quarantined"] += 1
            self.unlock(receipt, touch=False)
            if swa is not None:
                swa.release_window(window_held)
            if pin is not None:
                try:
                    self.controller.unpin(pin)
                except Exception as exc:
                    log.warning("unpin failed: %s", exc)
        if not ok:
            return self._load_failed(reason)
        self.counters["loaded_tokens"] += need_full
        self.touch(nodes)
        if req is not None:
            self._extend_request(req, nodes, node)
        return True

    def _load_base(self: UnifiedRadixCache, node: TreeNode, req: Request | None) -> TreeNode:
        if req is None:
            # The deepest device node at or above the first position any component loads
            # from (the SWA window's start): tombstones inside the window are loaded too,
            # so that the loaded prefix can be matched.
            cuts = (comp.load_cut(node.end) for comp in self.components)
            start = min((c for c in cuts if c is not None), default=node.end)
            base = node
            while base.parent is not None and (base.data[0].value is None or base.end > start):
                base = base.parent
            return base
        if req.kv_slots.size != req.prefix_len or req.last_node is None:
            raise ValueError(f"{req!r}: load_back must come right after match_prefix")
        return req.last_node

    def _attached(self: UnifiedRadixCache, node: TreeNode) -> bool:
        """``node`` is still reachable from its namespace's root."""
        while node.parent is not None:
            node = node.parent
        return self.roots.get(node.namespace) is node

    @staticmethod
    def _nodes_between(base: TreeNode, node: TreeNode) -> list[TreeNode]:
        nodes = []
        while node is not base:
            if node.parent is None:
                raise ValueError("load_back: the node is not below the request's prefix")
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    def _make_room_for(self: UnifiedRadixCache, plan: LoadPlan, need_full: int) -> None:
        swa = self.by_type.get(ComponentType.SWA)
        need_swa = sum(n.num_tokens for n in plan.parts[swa.idx]) if swa is not None else 0
        ps = self.page_size
        self.make_room(need_full // ps, need_swa // ps, 1 if self.mamba is not None else 0)

    def _load_failed(self: UnifiedRadixCache, reason: str) -> bool:
        self.counters["load_back_failed"] += 1
        self.counters[f"load_back_failed_{reason}"] += 1
        return False

    def _extend_request(
        self: UnifiedRadixCache, req: Request, nodes: list[TreeNode], node: TreeNode
    ) -> None:
        req.kv_slots = np.concatenate([req.kv_slots, self._concat_slots(nodes)])
        req.token_ids = np.concatenate(
            [req.token_ids, *(np.frombuffer(n.key, dtype=np.int64) for n in nodes)]
        )
        old = req.lock_receipt
        req.lock_receipt = self.lock(node)
        req.last_node = node
        req.prefix_len = node.end
        if old is not None:
            self.unlock(old)


class _PrefixDropped(LookupError):
    """The prefix a load-back was bringing left the tree before its pages were allocated."""


def _last_at_most(tiers: np.ndarray, tier: int) -> int:
    """Pages up to the last page whose tier is at most ``tier`` (0 when none)."""
    ok = np.flatnonzero(tiers <= tier)
    return int(ok[-1]) + 1 if ok.size else 0
