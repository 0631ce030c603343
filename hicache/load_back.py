"""Load-back: bring a prefix from the host/disk tiers to the device (ARCHITECTURE §4).

The fixed shape: plan (each component names the pages it needs), pin the source pages,
lock the device path, make room, let every component allocate its slots, one controller
load, and every component finalizes (installs on success; frees and restores the request
on failure). A failure at any step leaves the pools and the request as they were, except
for slots a copy the controller gave up on may still write into: those wait in the
quarantine until it settles.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.components.base import LoadPlan, LoadPrep, MakeRoom, PendingView
from hicache.config import CacheConfig
from hicache.controller_api import (
    CacheController,
    LayerGroups,
    LayerLoad,
    PageRef,
    PinReceipt,
    TransferHandle,
    start_layer_load,
    unsettled_load,
)
from hicache.node import TreeNode
from hicache.quarantine import HeldSlots, Quarantine
from hicache.records import Request
from hicache.tree import RadixTree

log = logging.getLogger("hicache.load_back")

# A load-back's pin lasts this many load timeouts: past the load it serves (which gives up
# after one), never forever (a pin whose unpin is lost lapses on its own).
PIN_TTL_LOADS = 2


class PrefixDropped(LookupError):
    """The prefix a load-back was bringing left the tree before its pages were allocated."""


class LoadBack:
    """Runs load-backs into ``tree``'s device pools from ``controller``."""

    def __init__(
        self,
        tree: RadixTree,
        controller: CacheController,
        config: CacheConfig,
        quarantine: Quarantine,
        counters: Counter[str],
        make_room: MakeRoom,
    ) -> None:
        self.tree = tree
        self.controller = controller
        self.config = config
        self.quarantine = quarantine
        self.counters = counters
        self.make_room = make_room

    def load(self, node: TreeNode, req: Request | None, mem_quota: int | None) -> bool:
        """Bring the prefix ending at ``node`` to the device; see
        :meth:`~hicache.cache.UnifiedRadixCache.load_back` for what it promises."""
        txn = self._begin(node, req, mem_quota)
        if txn is None:
            return False
        ok, unsettled = False, None  # the handle of a failed copy that may still write
        try:
            if txn.refs:
                result = self.controller.load(txn.refs, txn.pin, self.config.load_timeout_s)
                ok = bool(result)
                unsettled = None if ok else unsettled_load(result)
            else:
                ok = True
        except Exception as exc:
            txn.failed(exc)
        return self._end(txn, ok, unsettled)

    def start_layered(
        self, node: TreeNode, req: Request | None, mem_quota: int | None, groups: LayerGroups
    ) -> LayeredLoadBack | None:
        """Start :meth:`load` for every layer at once (see
        :meth:`~hicache.cache.UnifiedRadixCache.start_load_back`); None when it fails
        before any copy starts (counted, nothing changed)."""
        txn = self._begin(node, req, mem_quota)
        if txn is None:
            return None
        try:
            copies = start_layer_load(
                self.controller, txn.refs, txn.pin, groups, self.config.load_timeout_s
            )
        except Exception as exc:
            txn.failed(exc)
            self._end(txn, False, None)
            return None
        view = PendingView()
        for comp in self.tree.components:
            comp.pending_view(txn.plan, txn.preps[comp.idx], view)
        return LayeredLoadBack(self, txn, copies, view)

    def _begin(
        self, node: TreeNode, req: Request | None, mem_quota: int | None
    ) -> _Transaction | None:
        """Plan, pin, lock, make room and allocate for a load of ``node``; None (counted,
        nothing changed) when that fails."""
        tree = self.tree
        if not tree.attached(node):
            # Forgotten since the match (another match pruned the host-only record, or
            # the controller lost the pages): a miss, the request recomputes.
            self._failed("evicted")
            return None
        base = self._load_base(node, req)
        nodes = _nodes_between(base, node)
        for comp in tree.components:
            cut = comp.load_cut(node.end)
            for i, n in enumerate(nodes):
                if cut is not None and n.start < cut < n.end:
                    nodes.insert(i, tree.split(n, cut - n.start))
                    break
        plan = LoadPlan(base, nodes, node)
        keys = [k for comp in tree.components for k in comp.plan_load(plan)]
        need = {c.ctype: c.load_need(plan) for c in tree.components}
        need_base = need[tree.base.ctype]
        if mem_quota is not None and need_base > mem_quota:
            self._failed("quota")
            return None
        pin = None
        if keys:
            try:
                pin = self.controller.pin(keys, self.config.load_timeout_s * PIN_TTL_LOADS)
            except Exception as exc:
                log.warning("pin for load-back failed: %s", exc)
            if pin is None:
                self._failed("pin")
                return None
        deepest_device = base
        for n in nodes:
            if n.base.value is not None:
                deepest_device = n
        receipt = tree.lock(deepest_device)
        # A lock may stop short of what the load needs kept (SWA's stops at a tombstone);
        # each component holds the rest of its part through the eviction that makes room.
        holds = [(c, c.hold_for_load(node)) for c in tree.components]
        loading = {n.id for n in nodes} - tree.loading
        tree.loading |= loading
        txn = _Transaction(plan, req, pin, receipt, holds, loading, need_base)
        try:
            self.make_room(need)
            if not tree.attached(node):  # a controller callback dropped the path meanwhile
                raise PrefixDropped("the prefix left the tree while room was made for it")
            for comp in tree.components:
                txn.preps[comp.idx] = comp.prepare_load_back(plan, req)
        except Exception as exc:
            txn.failed(exc)
            self._end(txn, False, None)
            return None
        return txn

    def _end(self, txn: _Transaction, ok: bool, unsettled: TransferHandle | None) -> bool:
        """Install (``ok``) or undo what :meth:`_begin` did, release its pin and lock, and
        extend the request; whether the load succeeded."""
        tree, plan, req = self.tree, txn.plan, txn.req
        tree.loading -= txn.loading
        aside: list[tuple[Any, np.ndarray]] = []
        for comp in tree.components:
            prep = txn.preps.get(comp.idx)
            if prep is None:
                continue
            if unsettled is not None and prep.refs:
                # The copy may still write into these slots: keep them from every
                # request until it has settled (nothing else to undo: a failed load
                # leaves the request as it was).
                aside += comp.load_targets(prep)
            else:
                comp.finalize_load_back(plan, req, prep, ok)
        if aside:
            self.quarantine.hold(HeldSlots(unsettled, aside))
            self.counters["load_back_quarantined"] += 1
        tree.unlock(txn.receipt, touch=False)
        for comp, held in txn.holds:
            comp.release_hold(held)
        if txn.pin is not None:
            try:
                self.controller.unpin(txn.pin)
            except Exception as exc:
                log.warning("unpin failed: %s", exc)
        if not ok:
            return self._failed(txn.reason or "copy")
        self.counters["loaded_tokens"] += txn.need_base
        tree.touch(plan.nodes)
        if req is not None:
            self._extend_request(req, plan.nodes, plan.end_node)
        return True

    def _load_base(self, node: TreeNode, req: Request | None) -> TreeNode:
        if req is None:
            # The deepest device node at or above the first position any component loads
            # from (the SWA window's start): tombstones inside the window are loaded too,
            # so that the loaded prefix can be matched.
            cuts = (comp.load_cut(node.end) for comp in self.tree.components)
            start = min((c for c in cuts if c is not None), default=node.end)
            base = node
            while base.parent is not None and (base.base.value is None or base.end > start):
                base = base.parent
            return base
        if req.kv_slots.size != req.prefix_len or req.last_node is None:
            raise ValueError(f"{req!r}: load_back must come right after match_prefix")
        return req.last_node

    def _failed(self, reason: str) -> bool:
        self.counters["load_back_failed"] += 1
        self.counters[f"load_back_failed_{reason}"] += 1
        return False

    def _extend_request(self, req: Request, nodes: list[TreeNode], node: TreeNode) -> None:
        tree = self.tree
        req.kv_slots = np.concatenate([req.kv_slots, tree.device_slots(nodes)])
        req.token_ids = np.concatenate(
            [req.token_ids, *(np.frombuffer(n.key, dtype=np.int64) for n in nodes)]
        )
        old = req.lock_receipt
        req.lock_receipt = tree.lock(node)
        req.last_node = node
        req.prefix_len = node.end
        if old is not None:
            tree.unlock(old)


@dataclass
class _Transaction:
    """What a load-back holds between :meth:`LoadBack._begin` and :meth:`LoadBack._end`."""

    plan: LoadPlan
    req: Request | None
    pin: PinReceipt | None
    receipt: Any
    holds: list[tuple[Any, Any]]
    loading: set[int]
    need_base: int
    preps: dict[int, LoadPrep] = field(default_factory=dict)
    reason: str | None = None  # why it failed, once it has

    @property
    def refs(self) -> list[PageRef]:
        return [r for p in self.preps.values() for r in p.refs]

    def failed(self, exc: Exception) -> None:
        self.reason = "evicted" if isinstance(exc, PrefixDropped) else type(exc).__name__
        log.warning(
            "load-back of %d tokens failed: %s", self.plan.end - self.plan.base_node.end, exc
        )


class LayeredLoadBack:
    """A load-back started for every layer at once, waited on layer by layer
    (:meth:`~hicache.cache.UnifiedRadixCache.start_load_back`).

    Until :meth:`finish`, nothing is installed: the tree, the pools' free lists and the
    request are as before the call, with the load's slots allocated and its path locked
    and pinned. ``prefix_len`` is what the request's prefix will be; ``view`` says where
    the loaded state lands (read ``wait_layer(i)``'s layers there). :meth:`finish`
    installs it and extends the request when every byte arrived, and otherwise undoes
    everything (the request recomputes); it must be called, once the engine no longer
    reads the slots, and a second call returns the first's answer.
    """

    def __init__(
        self, loader: LoadBack, txn: _Transaction, copies: LayerLoad, view: PendingView
    ) -> None:
        self._loader = loader
        self._txn = txn
        self._copies = copies
        self.view = view
        self.groups = copies.groups
        self.prefix_len = txn.plan.end
        self._ok: bool | None = None

    def wait_layer(self, layer: int) -> bool:
        """Wait until model layer ``layer``'s part of the load may be read (on a GPU: by
        work queued next on the current stream); False when the load failed there or
        before (nothing may be read then: call :meth:`finish` and recompute)."""
        if self._ok is not None:
            return self._ok
        return self._copies.wait_group(self.groups.group_of(layer))

    def finish(self) -> bool:
        """Wait for every copy, then install the load (True) or undo it (False)."""
        if self._ok is None:
            ok, unsettled = False, None
            try:
                result = self._copies.finish()
                ok = bool(result)
                unsettled = None if ok else unsettled_load(result)
            except Exception as exc:
                self._txn.failed(exc)
            self._ok = self._loader._end(self._txn, ok, unsettled)
        return self._ok


def _nodes_between(base: TreeNode, node: TreeNode) -> list[TreeNode]:
    nodes = []
    while node is not base:
        if node.parent is None:
            raise ValueError("load_back: the node is not below the request's prefix")
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    return nodes
