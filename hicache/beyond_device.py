"""Hits beyond the device: where the pages after a device match are, per the controller.

When the device prefix is short of the query, the pages after it (tree nodes and beyond
the tree) are hashed and looked up. Per page, every component says the slowest tier a
match ending there would need of it; the slowest of them gives ``host_hit_len`` and
``disk_hit_len``. Pages found beyond the tree (written by another engine, or before a
restart) become host-only nodes.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np

from hicache.config import CacheConfig, PrefetchPolicy
from hicache.controller_api import (
    P_ABSENT,
    P_DISK,
    P_HOST,
    P_REMOTE,
    CacheController,
    LookupResult,
    PageKey,
)
from hicache.keys import TOKEN_BYTES, chain_page_hashes, tenant_of
from hicache.node import TreeNode
from hicache.tree import RadixTree
from hicache.types import ABSENT_RANK, Tier

log = logging.getLogger("hicache.beyond_device")


@dataclass
class Walk:
    """A key followed down the tree from ``start``: the nodes whose whole key matched, then
    the node that matched only partly (or None) and its matched whole-page tokens."""

    start: TreeNode
    key: bytes
    path: list[TreeNode]
    partial: TreeNode | None
    partial_tokens: int

    def nodes(self) -> list[TreeNode]:
        """The matched nodes, the partly matched one last."""
        if self.partial is not None and self.partial_tokens:
            return [*self.path, self.partial]
        return self.path


@dataclass
class BeyondHit:
    """What lies after the device prefix: tokens loadable from host, then from disk, then
    from the remote tier, and the node a load-back would end at (None: nothing to load)."""

    host_hit_len: int = 0
    disk_hit_len: int = 0
    remote_hit_len: int = 0
    load_node: TreeNode | None = None


class BeyondDevice:
    """Looks up the pages after a device match in the controller's tiers."""

    def __init__(
        self,
        tree: RadixTree,
        controller: CacheController,
        config: CacheConfig,
        counters: Counter[str],
    ) -> None:
        self.tree = tree
        self.controller = controller
        self.config = config
        self.counters = counters

    def find(self, walk: Walk) -> BeyondHit:
        """The hit after ``walk.start`` (the device match's end) along ``walk``: a lookup of
        every page from there to the end of ``walk.key``, a prefetch of what is only on
        disk (by prefetch policy), and the node a load-back would bring to the device."""
        tree = self.tree
        ps = tree.page_size
        start = walk.start.end
        hashes, device = self._hashes_after(walk)
        try:
            tenant = tenant_of(tree.namespace_of(walk.start))
            comps = [c.ctype for c in tree.components]
            lookup = self.controller.lookup(hashes, comps, tenant=tenant)
        except Exception as exc:
            log.warning("lookup failed: %s", exc)
            self.counters["lookup_failed"] += 1
            return BeyondHit()
        self._forget_lost(walk, lookup)
        tiers = self._end_tiers(lookup, device)
        host_pages = _last_at_most(tiers, P_HOST)
        disk_pages = _last_at_most(tiers, P_DISK)
        remote_pages = _last_at_most(tiers, P_REMOTE)
        hit = BeyondHit(
            host_pages * ps, (disk_pages - host_pages) * ps, (remote_pages - disk_pages) * ps
        )
        load_pages = host_pages
        if remote_pages > host_pages:
            # Disk and remote pages are read into host by a prefetch or the load's pin.
            policy = self.config.prefetch_policy
            if policy is PrefetchPolicy.WAIT_COMPLETE:
                load_pages = remote_pages
            else:
                handle = self.controller.prefetch(self._slow_keys(lookup, remote_pages, hashes))
                if policy is PrefetchPolicy.TIMEOUT and handle.wait(self.config.prefetch_timeout_s):
                    # Every page asked for is on host now (a second lookup would count the
                    # match's pages twice); one evicted before the load's pin is a miss.
                    load_pages = remote_pages
        if load_pages:
            hit.load_node = self._materialize(walk, start + load_pages * ps, lookup)
        return hit

    def _hashes_after(self, walk: Walk) -> tuple[list[bytes], dict[int, np.ndarray]]:
        """Page hashes from ``walk.start``'s end to the end of the key, and per component a
        bool per page saying the device already holds what a match ending there needs."""
        tree = self.tree
        ps = tree.page_size
        last, key = walk.start, walk.key
        hashes: list[bytes] = []
        total = len(key) // TOKEN_BYTES // ps - last.end // ps
        device = {c.idx: np.zeros(total, dtype=bool) for c in tree.components}
        for node in walk.nodes():
            whole = node is not walk.partial
            take = node.num_tokens // ps if whole else walk.partial_tokens // ps
            off = len(hashes)
            hashes += tree.node_hashes(node)[:take]
            for comp in tree.components:
                if node.data[comp.idx].value is not None:
                    comp.mark_on_device(device[comp.idx], off, take, whole)
        prev = hashes[-1] if hashes else tree.end_hash(last)
        covered = last.end + len(hashes) * ps
        hashes += chain_page_hashes(prev, key[covered * TOKEN_BYTES :], ps)
        return hashes, device

    def _forget_lost(self, walk: Walk, lookup: LookupResult) -> None:
        """Remove the first host-only node on the path whose first page the controller no
        longer holds (with its subtree, all host-only): it can never hit again."""
        tree = self.tree
        base = lookup.presence[tree.base.ctype]
        off = 0
        for node in walk.nodes():
            if node.base.value is None and base[off] == P_ABSENT:
                if node.parent is not None:
                    tree.remove_subtree(node)
                return
            off += node.num_tokens // tree.page_size
            if off >= base.size:
                return

    def _end_tiers(self, lookup: LookupResult, device: dict[int, np.ndarray]) -> np.ndarray:
        """For each page j after the device match: the slowest tier a match ending after
        page j needs (device, host, disk, or ``ABSENT_RANK``: impossible)."""
        worst = None
        for comp in self.tree.components:
            t = lookup.presence[comp.ctype].astype(np.int64)
            t = np.where(t == P_ABSENT, ABSENT_RANK, t)
            t[device[comp.idx][: t.size]] = Tier.DEVICE
            t = comp.tiers_for_match_end(t)
            worst = t if worst is None else np.maximum(worst, t)
        return worst

    def _slow_keys(self, lookup: LookupResult, pages: int, hashes: list[bytes]) -> list[PageKey]:
        """The keys of the first ``pages`` pages that are beyond the host (disk, remote)."""
        keys = []
        for comp in self.tree.components:
            p = lookup.presence[comp.ctype][:pages]
            slow = np.flatnonzero((p == P_DISK) | (p == P_REMOTE))
            keys += [PageKey(comp.ctype, hashes[j]) for j in slow.tolist()]
        return keys

    def _materialize(self, walk: Walk, end: int, lookup: LookupResult) -> TreeNode:
        """The tree node ending exactly at ``end`` on the walk's path, splitting a node or
        adding a host-only node (marked backed by the lookup) as needed."""
        tree = self.tree
        last, key = walk.start, walk.key
        node = last
        for n in walk.path:
            if n.end > end:
                return tree.split(n, end - n.start)
            node = n
            if n.end == end:
                return n
        partial = walk.partial
        if partial is not None and walk.partial_tokens:
            if end < partial.start + walk.partial_tokens:
                return tree.split(partial, end - partial.start)
            node = tree.split(partial, walk.partial_tokens)
            if node.end == end:
                return node
        new = tree.add_child(node, key[node.end * TOKEN_BYTES : end * TOKEN_BYTES])
        tree.mark_host_only(new)
        first = (node.end - last.end) // tree.page_size
        pages = slice(first, (end - last.end) // tree.page_size)
        for comp in tree.components[1:]:
            present = lookup.presence[comp.ctype] != P_ABSENT
            new.data[comp.idx].backed = comp.backed_by_lookup(present[pages])
        tree.prune_host_only(keep=new)
        return new


def _last_at_most(tiers: np.ndarray, tier: int) -> int:
    """Pages up to the last page whose tier is at most ``tier`` (0 when none)."""
    ok = np.flatnonzero(tiers <= tier)
    return int(ok[-1]) + 1 if ok.size else 0
