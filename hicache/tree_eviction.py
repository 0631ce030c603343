"""Device-tier eviction over the radix tree: which values go when a pool is short.

The backbone (FULL) comes off the tails of the least valuable leaves (the tree's leaf
policy), so a chain is always cut from its tail; every other component comes off the least
recently used unlocked nodes holding it, cascading to lower priorities there. A node whose
device data goes is offered to a listener first (the write-back policy copies it there,
and may answer that some of its pages must wait for that copy instead of going back to
their pools).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hicache.components.base import TreeComponent
from hicache.node import TreeNode
from hicache.quarantine import HeldSlots
from hicache.records import EvictResult
from hicache.tree import RadixTree
from hicache.types import ComponentType

# Called with a node whose device values are about to be freed; returns the slots to hold
# back from the pools (their amounts are then not counted as freed), or None.
DeviceFreeListener = Callable[[TreeNode], HeldSlots | None]


class TreeEviction:
    """Frees device amounts from ``tree`` on demand; ``evicted`` keeps running totals."""

    def __init__(self, tree: RadixTree, on_device_free: DeviceFreeListener | None = None) -> None:
        self.tree = tree
        self.on_device_free = on_device_free
        self.evicted = EvictResult()  # running totals of what eviction freed
        # Components by eviction priority, highest first: what an eviction frees first.
        self._order = sorted(tree.components, key=lambda c: -c.priority)

    def evict(self, want: Mapping[ComponentType, int]) -> EvictResult:
        """Free at least the asked device amounts (per component: tokens, or states for
        MAMBA) where possible; returns what was freed.

        Backbone amounts come off the tails of the least valuable leaves (no more than
        asked, in whole pages, unless a leaf must go whole); other components off the
        least recently used unlocked nodes holding them, cascading to lower priorities.
        """
        tree = self.tree
        result = EvictResult()
        for comp in self._order:
            goal = want.get(comp.ctype, 0)
            while result.get(comp.ctype) < goal:
                victim = self._next_victim(comp)
                if victim is None:
                    break
                # An aux victim is unlocked in its own component, but a lock taken before
                # it got that component (a load-back or a request's state arriving later)
                # may still hold its backbone pages: then only the aux data goes.
                if comp.leaf_only:
                    self._evict_leaf_tail(victim, goal - result.get(comp.ctype), result)
                elif self.is_device_leaf(victim) and victim.base.lock_ref == 0:
                    self.evict_device_leaf(victim, result)
                else:
                    self._tombstone(victim, comp, result)
        if result.get(tree.base.ctype):
            tree.prune_host_only()
        self.evicted.merge(result)
        return result

    def _evict_leaf_tail(self, node: TreeNode, want_tokens: int, result: EvictResult) -> None:
        """Evict the tail of leaf ``node`` that the policy names for ``want_tokens`` more
        (whole pages; all of it when it is no longer): the head stays cached, a leaf
        again. Not where a component keeps state only at a node's end (Mamba): a head
        without it could not end a match, so the whole node goes."""
        tree = self.tree
        take = -(-tree.leaf_policy.tail_tokens(node, want_tokens) // tree.page_size)
        keep = node.num_tokens - max(take, 1) * tree.page_size
        if keep > 0 and tree.cut_tails:
            tree.split(node, keep)
        tree.leaf_policy.on_evict(node)
        self.evict_device_leaf(node, result)

    def _next_victim(self, comp: TreeComponent) -> TreeNode | None:
        tree = self.tree
        if comp.leaf_only:
            node = tree.leaf_policy.pop()
            if node is not None:
                node.in_policy = False
            return node
        cd = tree.aux_lru[comp.idx].pop_front()
        return None if cd is None else cd.node

    @staticmethod
    def is_device_leaf(node: TreeNode) -> bool:
        return node.base.value is not None and node.device_children == 0

    def _tombstone(self, node: TreeNode, comp: TreeComponent, result: EvictResult) -> None:
        """Drop ``comp`` and every unlocked lower-priority component from ``node`` (an
        internal node, or a leaf whose backbone pages a lock holds)."""
        tree = self.tree
        for other in tree.free_order:
            if other.priority > comp.priority or other.leaf_only:
                continue
            cd = node.data[other.idx]
            if cd.value is not None and cd.lock_ref == 0:  # a held lower one stays
                value = tree.take_value(node, other)
                result.add(other.ctype, other.free(node, value))

    def has_tombstone(self, node: TreeNode) -> bool:
        """Some aux component is missing on the device at ``node``."""
        return any(node.data[c.idx].value is None for c in self.tree.components if not c.leaf_only)

    def evict_device_leaf(self, node: TreeNode, result: EvictResult) -> None:
        """Free every device value of leaf ``node``, then of ancestors that are left as
        unlocked leaves with an aux component missing (they can no longer end a match).
        Values the listener holds back go to its slots instead, uncounted."""
        tree = self.tree
        while True:
            held = self.on_device_free(node) if self.on_device_free is not None else None
            for comp in tree.free_order:
                if node.data[comp.idx].value is None:
                    continue
                value = tree.take_value(node, comp)
                if held is not None and comp.ctype in held.components:
                    held.slots += comp.detach(node, value)
                else:
                    result.add(comp.ctype, comp.free(node, value))
            parent = node.parent
            self._after_device_free(node)
            if (
                parent.parent is None
                or not self.is_device_leaf(parent)
                or parent.base.lock_ref > 0
                or not self.has_tombstone(parent)
            ):
                return
            node = parent

    def _after_device_free(self, node: TreeNode) -> None:
        """``node`` holds nothing on the device any more: keep it as a host-only node when
        the controller holds its backbone pages, else remove it and its host-only subtree."""
        tree = self.tree
        if node.base.backed:
            tree.host_only_tokens += node.num_tokens
        else:
            tree.remove_subtree(node)
