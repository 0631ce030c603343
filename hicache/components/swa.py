"""SWA: sliding-window KV. Only the last ``sliding_window`` tokens before a match end matter.

Value: the SWA page of each FULL page of the node (``pools.full_to_swa`` holds the same
mapping, which is how engines address SWA KV). A node without it is an SWA tombstone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.components.base import LoadPlan, LoadPrep, MatchCheck, PagedComponent, PendingView
from hicache.controller_api import PageRef
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.node import TreeNode
    from hicache.records import Request


class SWAComponent(PagedComponent):
    ctype = ComponentType.SWA
    priority = 1

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.window = int(self.config.sliding_window)

    def _full_pages(self, node: TreeNode) -> np.ndarray:
        full = node.base.value
        return full[:: self.page_size] // self.page_size

    def free(self, node: TreeNode, value: np.ndarray) -> int:
        full_pages = self._full_pages(node)
        assert np.array_equal(self.pools.full_to_swa[full_pages], value), "SWA mapping drifted"
        return self.pools.free_swa_of(full_pages, distinct=True)  # a node's own pages

    def owned_pages(self, node: TreeNode, value: np.ndarray) -> np.ndarray:
        return value

    def detach(self, node: TreeNode, value: np.ndarray) -> list[tuple[Any, np.ndarray]]:
        self.pools.full_to_swa[self._full_pages(node)] = -1
        return [(self.pools.swa, value)]

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

    def pending_view(self, plan: LoadPlan, prep: LoadPrep, view: PendingView) -> None:
        for node, pages in self._by_node(plan, prep.allocated):
            full = view.node_full_pages.get(node.id)
            if full is None:
                full = self._full_pages(node)
            view.swa_pages.update(zip(full.tolist(), pages.tolist()))

    def install(self, node: TreeNode, pages: np.ndarray) -> None:
        self.pools.full_to_swa[self._full_pages(node)] = pages
        self.tree.set_value(node, self, pages)

    # -- what requests hold ------------------------------------------------------------

    def release_outside_window(self, req: Request) -> int:
        """Free the SWA pages of ``req``'s own pages that lie wholly before its window."""
        ps = self.page_size
        limit = max(0, req.computed_len - self.window)
        limit -= limit % ps
        start = max(req.prefix_len, req.swa_released_upto)
        if limit <= start:
            return 0
        freed = self.pools.free_swa_of(req.kv_slots[start:limit:ps] // ps)
        req.swa_released_upto = limit
        return freed

    def request_cached(self, req: Request, end: int) -> None:
        req.swa_released_upto = max(req.swa_released_upto, end)

    def insert_valid_from(self, own_pages: np.ndarray, prev_prefix_len: int, n: int) -> int:
        """The request's own pages may have lost their SWA pages from the front (they fell
        out of its window): the position after them (``n`` when none has one). A gap
        anywhere else is an error of the caller."""
        has = self.pools.full_to_swa[own_pages] >= 0
        first = int(np.argmax(has)) if has.any() else has.size
        if not has[first:].all():
            raise ValueError("insert: SWA pages are missing after the window start")
        return prev_prefix_len + first * self.page_size

    def fill_from_request(self, node: TreeNode, full_pages: np.ndarray, valid_from: int) -> None:
        if node.start >= valid_from:
            self.tree.set_value(node, self, self.pools.full_to_swa[full_pages].copy())

    def adopt_from_request(self, node: TreeNode, own_pages: np.ndarray) -> None:
        if node.data[self.idx].value is not None:
            return
        swa_pages = self.pools.full_to_swa[own_pages]
        if (swa_pages < 0).any():
            return
        self.pools.full_to_swa[own_pages] = -1
        self.pools.full_to_swa[self._full_pages(node)] = swa_pages
        self.tree.set_value(node, self, swa_pages.copy())

    # -- invariants ---------------------------------------------------------------------

    def request_owned(self, req: Request, own_pages: np.ndarray) -> np.ndarray:
        swa_pages = self.pools.full_to_swa[own_pages]
        return swa_pages[swa_pages >= 0]

    def check_node(self, node: TreeNode) -> None:
        mapped = self.pools.full_to_swa[self._full_pages(node)]
        value = node.data[self.idx].value
        expect = np.full(mapped.size, -1) if value is None else value
        assert np.array_equal(mapped, expect), f"{node}: SWA mapping differs"

    def check_request(self, req: Request) -> None:
        """The engine's next token of ``req`` attends over the SWA window ending at its
        computed length: every page of it has an SWA page (a request gives back only pages
        wholly before it), and the part that is the tree's prefix is locked."""
        end = req.computed_len
        if not end:
            return
        ps = self.page_size
        start = self.window_start(end)
        pages = req.kv_slots[start:end:ps] // ps
        holes = np.flatnonzero(self.pools.full_to_swa[pages] < 0)
        assert not holes.size, (
            f"{req!r}: SWA window [{start}, {end}) has no SWA page at token {start + holes[0] * ps}"
        )
        node = req.last_node
        while node is not None and node.parent is not None and node.end > start:
            assert node.data[self.idx].lock_ref > 0, (
                f"{req!r}: {node} of its SWA window is unlocked"
            )
            node = node.parent
