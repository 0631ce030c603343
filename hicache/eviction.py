"""Eviction orders for the device tier.

* FULL is evicted from leaves only (chains are cut from the tail). Which evictable leaf goes
  first is a pluggable :class:`LeafEvictionPolicy`; LRU is the default.
* SWA and MAMBA can be dropped from any unlocked node; they keep an intrusive LRU list
  (:class:`LRUList`) of the nodes that hold them and are unlocked.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.node import ComponentData, TreeNode


class LeafEvictionPolicy(ABC):
    """Orders the evictable device leaves (unlocked nodes with FULL on the device and no
    child with FULL on the device). The tree tells it when a node joins or leaves that set
    and when a member is accessed; ``pop`` names the next victim."""

    @abstractmethod
    def add(self, node: TreeNode) -> None:
        """``node`` became an evictable leaf."""

    @abstractmethod
    def remove(self, node: TreeNode) -> None:
        """``node`` is no longer an evictable leaf (locked, got a child, or evicted)."""

    @abstractmethod
    def touch(self, node: TreeNode) -> None:
        """``node`` (a member) was accessed; its ``last_access`` is already updated."""

    @abstractmethod
    def pop(self) -> TreeNode | None:
        """Remove and return the next victim, or None when there is no evictable leaf."""

    @abstractmethod
    def members(self) -> set[int]:
        """Ids of the member nodes (for invariant checks)."""

    def attach(self, page_size: int) -> None:  # noqa: B027 - optional hook
        """The tree that uses this policy cuts nodes at multiples of ``page_size`` tokens."""

    def on_insert(self, node: TreeNode) -> None:  # noqa: B027 - optional hook
        """A node was created with ``node.key`` (policies that learn from history use it)."""

    def on_hit(self, node: TreeNode) -> None:  # noqa: B027 - optional hook
        """A match used ``node`` (policies that learn from history use it)."""

    def on_split(self, node: TreeNode) -> None:  # noqa: B027 - optional hook
        """The tree cut a node; ``node`` is the new parent holding its prefix."""

    def tail_tokens(self, node: TreeNode, want_tokens: int) -> int:
        """Of victim ``node``, how many tail tokens to evict while ``want_tokens`` more are
        asked for (the tree rounds up to whole pages and keeps the head cached). By
        default what is asked: no more is evicted than needed."""
        return want_tokens

    def on_evict(self, node: TreeNode) -> None:  # noqa: B027 - optional hook
        """``node``, as ``pop`` named it or its tail that ``tail_tokens`` chose, is leaving
        the device now."""

    def insert_end(self, key: bytes | memoryview, start: int, end: int) -> int:
        """Where a node the tree is about to create for ``key``'s tokens ``[start, end)``
        should end (a page boundary within it; the rest becomes the next node); ``key`` is
        token bytes, or a byte view of them for a long insert. A policy that keeps state
        per node may cut where that state differs; LRU does not cut."""
        return end


class LRULeafPolicy(LeafEvictionPolicy):
    """Least recently used leaf first; a heap with lazy deletion, O(log n) per operation."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._live: dict[int, int] = {}  # node id -> sequence number of its live entry
        self._seq = itertools.count()

    def add(self, node: TreeNode) -> None:
        seq = next(self._seq)
        self._live[node.id] = seq
        heapq.heappush(self._heap, (node.last_access, seq, node))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def remove(self, node: TreeNode) -> None:
        self._live.pop(node.id, None)

    def touch(self, node: TreeNode) -> None:
        if node.id in self._live:
            self.add(node)

    def pop(self) -> TreeNode | None:
        node = self.peek()
        if node is not None:
            heapq.heappop(self._heap)
            del self._live[node.id]
        return node

    def peek(self) -> TreeNode | None:
        """The least recently used member, left a member (stale heap entries dropped)."""
        heap = self._heap
        while heap:
            _, seq, node = heap[0]
            if self._live.get(node.id) == seq:
                return node
            heapq.heappop(heap)
        return None

    def members(self) -> set[int]:
        return set(self._live)

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._live.get(e[2].id) == e[1]]
        heapq.heapify(self._heap)


class LRUList:
    """An intrusive doubly linked list of ComponentData, least recently used first.

    Removal from the middle and move-to-back are O(1); the links live in the
    ComponentData itself (``lru_prev`` / ``lru_next``), with ``in_lru`` as membership.
    """

    def __init__(self) -> None:
        self._head: ComponentData | None = None
        self._tail: ComponentData | None = None
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push_back(self, cd: ComponentData) -> None:
        """Append as most recently used (``cd`` must not be a member)."""
        cd.lru_prev = self._tail
        cd.lru_next = None
        if self._tail is None:
            self._head = cd
        else:
            self._tail.lru_next = cd
        self._tail = cd
        cd.in_lru = True
        self._size += 1

    def insert_by_access(self, cd: ComponentData) -> None:
        """Insert ``cd`` where its node's ``(last_access, start)`` places it: walks back
        from the most recent end, so it is O(1) for recently used nodes."""
        key = (cd.node.last_access, cd.node.start)
        anchor = self._tail
        while anchor is not None and (anchor.node.last_access, anchor.node.start) > key:
            anchor = anchor.lru_prev
        if anchor is None:
            if self._head is None:
                self.push_back(cd)
            else:
                self.insert_before(cd, self._head)
        elif anchor.lru_next is None:
            self.push_back(cd)
        else:
            self.insert_before(cd, anchor.lru_next)

    def insert_before(self, cd: ComponentData, anchor: ComponentData) -> None:
        """Insert ``cd`` just before member ``anchor`` (slightly less recently used)."""
        prev = anchor.lru_prev
        cd.lru_prev = prev
        cd.lru_next = anchor
        anchor.lru_prev = cd
        if prev is None:
            self._head = cd
        else:
            prev.lru_next = cd
        cd.in_lru = True
        self._size += 1

    def remove(self, cd: ComponentData) -> None:
        if not cd.in_lru:
            return
        if cd.lru_prev is None:
            self._head = cd.lru_next
        else:
            cd.lru_prev.lru_next = cd.lru_next
        if cd.lru_next is None:
            self._tail = cd.lru_prev
        else:
            cd.lru_next.lru_prev = cd.lru_prev
        cd.lru_prev = cd.lru_next = None
        cd.in_lru = False
        self._size -= 1

    def touch(self, cd: ComponentData) -> None:
        """Move a member to the most recently used end."""
        if cd.in_lru and cd is not self._tail:
            self.remove(cd)
            self.push_back(cd)

    def pop_front(self) -> ComponentData | None:
        cd = self._head
        if cd is not None:
            self.remove(cd)
        return cd

    def __iter__(self) -> Iterator[ComponentData]:
        cd = self._head
        seen = 0
        while cd is not None:
            yield cd
            seen += 1
            if seen > self._size:
                raise AssertionError("LRU list is longer than its size: a cycle")
            cd = cd.lru_next

