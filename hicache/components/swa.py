"""SWA: sliding-window KV. Only the last ``sliding_window`` tokens before a match end matter.

Value: the SWA page of each FULL page of the node (``pools.full_to_swa`` holds the same
mapping, which is how engines address SWA KV). A node without it is an SWA tombstone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.components.base import LoadPlan, MatchCheck, PagedComponent
from hicache.controller_api import PageRef
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.node import ComponentData, TreeNode


class SWAComponent(PagedComponent):
    ctype = ComponentType.SWA
    priority = 1

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.window = int(self.config.sliding_window)

    def size(self, value: np.ndarray) -> int:
        return int(value.size) * self.page_size

    def _full_pages(self, node: TreeNode) -> np.ndarray:
        full = node.base.value
        return full[:: self.page_size] // self.page_size

    def free(self, node: TreeNode, value: np.ndarray) -> int:
        full_pages = self._full_pages(node)
        assert np.array_equal(self.pools.full_to_swa[full_pages], value), "SWA mapping drifted"
        return self.pools.free_swa_of(full_pages)

    def owned_pages(self, node: TreeNode, value: np.ndarray) -> np.ndarray:
        return value

    def detach(self, node: TreeNode, value: np.ndarray) -> list[tuple[Any, np.ndarray]]:
        self.pools.full_to_swa[self._full_pages(node)] = -1
        return [(self.pools.swa, value)]

    def split(self, parent: ComponentData, child: ComponentData, k_tokens: int) -> None:
        if child.value is not None:
            k = k_tokens // self.page_size
            parent.value, child.value = child.value[:k], child.value[k:]
        parent.lock_ref = child.lock_ref
        parent.backed = child.backed

    def match_check(self, path: Sequence[TreeNode]) -> MatchCheck:
        """A match ending at ``end`` in ``path[i]`` needs SWA on every token of
        ``[end - window, end)``: no tombstone may end after ``end - window``."""
        gap_before = []
        gap_end = 0
        for node in path:
            gap_before.append(gap_end)
            if node.data[self.idx].value is None:
                gap_end = node.end
        window = self.window
        idx = self.idx

        def check(i: int, end: int) -> bool:
            return path[i].data[idx].value is not None and max(0, end - window) >= gap_before[i]

        return check

    def lock(self, node: TreeNode) -> int:
        """Lock the nodes covering the window that ends at ``node``; returns the boundary:
        the locked nodes are exactly those between it and ``node``."""
        covered = 0
        while node.parent is not None:
            if node.data[self.idx].value is None:
                return node.end
            self.tree.inc_lock(node, self)
            covered += node.num_tokens
            if covered >= self.window:
                return node.start
            node = node.parent
        return 0

    def unlock(self, node: TreeNode, boundary: int) -> None:
        while node.parent is not None and node.start >= boundary:
            self.tree.dec_lock(node, self)
            node = node.parent

    def hold_for_load(self, node: TreeNode) -> list[TreeNode]:
        """Lock every node of the window ending at ``node`` that holds SWA pages, across
        tombstones (where ``lock`` stops); returns them for ``release_hold``.

        A load-back filling the window's tombstones needs the pages already there to
        outlive the eviction that makes room for the missing ones. The caller must not
        split these nodes before releasing them (a split would copy a lock to a node
        that the returned list does not name)."""
        start = self.window_start(node.end)
        held = []
        while node.parent is not None and node.end > start:
            if node.data[self.idx].value is not None:
                self.tree.inc_lock(node, self)
                held.append(node)
            node = node.parent
        return held

    def release_hold(self, held: list[TreeNode]) -> None:
        """Undo ``hold_for_load``."""
        for node in held:
            self.tree.dec_lock(node, self)

    def backup_refs(self, node: TreeNode) -> list[PageRef]:
        value = node.data[self.idx].value
        return [] if value is None else self.page_refs(node, value.tolist())

    def window_start(self, end: int) -> int:
        """First token position (page aligned) of the window ending at ``end``."""
        start = max(0, end - self.window)
        return start - start % self.page_size

    def load_cut(self, end: int) -> int | None:
        return self.window_start(end)

    def tiers_for_match_end(self, tiers: np.ndarray) -> np.ndarray:
        """A match ending after page j needs the pages of the window before it."""
        w = -(-self.window // self.page_size)
        padded = np.concatenate([np.zeros(w - 1, dtype=np.int64), tiers])
        return np.lib.stride_tricks.sliding_window_view(padded, w).max(axis=1)

    def pool(self) -> Any:
        return self.pools.swa

    def load_from(self, plan: LoadPlan) -> int:
        return self.window_start(plan.end)

    def install(self, node: TreeNode, pages: np.ndarray) -> None:
        self.pools.full_to_swa[self._full_pages(node)] = pages
        self.tree.set_value(node, self, pages)
