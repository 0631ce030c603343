"""Backups to the controller by write policy, and the backups in flight.

``write_through`` backs up an inserted path (with any unbacked ancestors) at once;
``write_through_selective`` once a node has been hit enough; ``write_back`` when a node
leaves the device (:meth:`Backups.write_back`, the tree eviction's listener). A node stays
locked while its backup is in flight, that is until the handle is ``done()``: a copy that
has not ended may still read its pages.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from hicache.config import CacheConfig, WritePolicy
from hicache.controller_api import CacheController
from hicache.keys import tenant_of
from hicache.node import TreeNode
from hicache.quarantine import HeldSlots, Quarantine
from hicache.records import LockReceipt
from hicache.tree import RadixTree

log = logging.getLogger("hicache.backups")

# How often a flush polls handles that gave their outcome but are not done yet.
SETTLE_POLL_S = 0.01


@dataclass
class PendingBackup:
    handle: Any
    receipts: list[LockReceipt]
    pairs: list[tuple[TreeNode, int]]  # (node, component index) whose pages are in flight


class Backups:
    """Copies device values of ``tree`` to ``controller`` as ``config.write_policy`` says."""

    def __init__(
        self,
        tree: RadixTree,
        controller: CacheController,
        config: CacheConfig,
        quarantine: Quarantine,
        counters: Counter[str],
        device_is_cuda: bool,
    ) -> None:
        self.tree = tree
        self.controller = controller
        self.config = config
        self.quarantine = quarantine
        self.counters = counters
        self.device_is_cuda = device_is_cuda
        self.pending: list[PendingBackup] = []
        self._inflight: Counter[tuple[int, int]] = Counter()

    def _ready_event(self) -> Any:
        """An event after the engine's queued work, so a backup reads finished KV."""
        if self.device_is_cuda:
            event = torch.cuda.Event()
            event.record()
            return event
        return None

    def backup_nodes(self, nodes: list[TreeNode]) -> None:
        """Copy the device values of ``nodes`` (root to leaf order) that the controller does
        not hold yet; each node stays locked until its copy is acknowledged."""
        tree = self.tree
        refs, pairs, locked = [], [], []
        for node in nodes:
            mine = []
            for comp in tree.components:
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
        receipts = [tree.lock(node) for node in locked]
        try:
            tenant = tenant_of(tree.namespace_of(locked[0]))
            handle = self.controller.backup(refs, self._ready_event(), tenant=tenant)
        except Exception as exc:  # a failed backup only costs the copy, never the device data
            log.warning("backup of %d pages failed: %s", len(refs), exc)
            self.counters["backup_failed"] += 1
            for r in receipts:
                tree.unlock(r, touch=False)
            return
        for pair in pairs:
            self._inflight[(pair[0].id, pair[1])] += 1
        self.pending.append(PendingBackup(handle, receipts, pairs))
        self.counters["backup_pages"] += len(refs)

    def poll(self) -> None:
        """Finish the backups that are done (their locks go). One whose handle is not done
        keeps its nodes locked, even past its deadline: its copy may still read them."""
        if not self.pending:
            return
        still = []
        for pending in self.pending:
            if pending.handle.done():
                self._finish(pending)
            else:
                still.append(pending)
        self.pending = still

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for every pending backup: for its outcome (up to ``timeout_s`` each, or its
        own deadline), then until it is done (all within ``timeout_s``, or
        ``load_timeout_s``, from the call). One still not done stays pending."""
        settle_end = time.monotonic() + (
            self.config.load_timeout_s if timeout_s is None else timeout_s
        )
        for pending in list(self.pending):
            handle = pending.handle
            if handle.done():
                continue
            handle.wait(timeout_s)
            # One settling budget for the whole flush: handles of a sidecar that stopped
            # answering settle together (at the next session), not one after the other.
            while not handle.done() and time.monotonic() < settle_end:
                time.sleep(SETTLE_POLL_S)

    def _finish(self, pending: PendingBackup) -> None:
        tree = self.tree
        ok = bool(pending.handle.wait(0))
        base = tree.base.idx
        for node, idx in pending.pairs:
            key = (node.id, idx)
            self._inflight[key] -= 1
            if not self._inflight[key]:
                del self._inflight[key]
            # An aux component counts as held only with its backbone pages (which another,
            # unfinished or failed, backup may carry).
            if ok and (idx == base or node.base.backed):
                node.data[idx].backed = True
        for r in pending.receipts:
            tree.unlock(r, touch=False)
        self.counters["backup_done" if ok else "backup_failed"] += 1

    def after_insert(self, touched: list[TreeNode]) -> None:
        """Write-through: back up the inserted path (with any unbacked ancestors)."""
        if touched and self.config.write_policy is WritePolicy.WRITE_THROUGH:
            self.backup_nodes(self.tree.path_to_root(touched[-1]))

    def on_prefix_hit(self, nodes: list[TreeNode]) -> None:
        """Selective write-through: back up a prefix once it is hit enough."""
        if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            hot = [n for n in nodes if n.hit_count >= self.config.write_through_threshold_hits]
            if hot:
                self.backup_nodes(self.tree.path_to_root(hot[-1]))

    def write_back(self, node: TreeNode) -> HeldSlots | None:
        """Write-back: copy ``node`` to the controller before its device pages go (the
        eviction's listener). Returns the slots to hold back from the pools when the copy
        is not done in time (it may still read them), registered in the quarantine."""
        refs, comps = [], []
        for comp in self.tree.components:
            cd = node.data[comp.idx]
            if cd.value is not None and not cd.backed:
                refs += comp.backup_refs(node)
                comps.append(comp)
        if not refs:
            return None
        held = None
        try:
            tenant = tenant_of(self.tree.namespace_of(node))
            handle = self.controller.backup(refs, self._ready_event(), tenant=tenant)
            ok = handle.wait(self.config.load_timeout_s)
            if not handle.done():
                held = HeldSlots(handle, components=frozenset(c.ctype for c in comps))
                self.quarantine.hold(held)
                self.counters["write_back_quarantined"] += 1
        except Exception as exc:
            log.warning("write-back of %d pages failed: %s", len(refs), exc)
            ok = False
        self.counters["backup_pages"] += len(refs)
        self.counters["backup_done" if ok else "backup_failed"] += 1
        if ok:
            for comp in comps:
                node.data[comp.idx].backed = True
        return held

    def check_invariants(self) -> None:
        """Every in-flight backup still holds its locks."""
        for pending in self.pending:
            for r in pending.receipts:
                assert not r.released and r.node.base.lock_ref > 0, "in-flight backup unlocked"
        counted: Counter[tuple[int, int]] = Counter()
        for pending in self.pending:
            for node, idx in pending.pairs:
                counted[(node.id, idx)] += 1
        assert counted == self._inflight, "in-flight pages differ from pending backups"
