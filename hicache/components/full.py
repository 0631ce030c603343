"""FULL: full-attention KV, the backbone. A node exists while it has FULL on some tier."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.components.base import LoadPlan, LoadPrep, PagedComponent, PendingView
from hicache.controller_api import PageRef
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.node import TreeNode
    from hicache.records import Request


class FullComponent(PagedComponent):
    """Value: the FULL token slots of the node's span (whole pages, in order)."""

    ctype = ComponentType.FULL
    priority = 2
    leaf_only = True
    entry_per_page = False

    def pages(self, value: np.ndarray) -> np.ndarray:
        return value[:: self.page_size] // self.page_size

    def free(self, node: TreeNode, value: np.ndarray) -> int:
        self.pools.free_kv_pages(self.pages(value), distinct=True)  # a node's own pages
        return int(value.size)

    def owned_pages(self, node: TreeNode, value: np.ndarray) -> np.ndarray:
        return self.pages(value)

    def lock(self, node: TreeNode) -> Any:
        while node.parent is not None:
            self.tree.inc_lock(node, self)
            node = node.parent
        return None

    def unlock(self, node: TreeNode, part: Any) -> None:
        while node.parent is not None:
            self.tree.dec_lock(node, self)
            node = node.parent

    def backup_refs(self, node: TreeNode) -> list[PageRef]:
        value = node.data[self.idx].value
        return [] if value is None else self.page_refs(node, self.pages(value).tolist())

    def pool(self) -> Any:
        return self.pools.full

    def request_owned(self, req: Request, own_pages: np.ndarray) -> np.ndarray:
        return own_pages

    def install(self, node: TreeNode, pages: np.ndarray) -> None:
        self.tree.set_value(node, self, self.pools.full.pages_to_slots(pages))

    def pending_view(self, plan: LoadPlan, prep: LoadPrep, view: PendingView) -> None:
        loaded = {n.id: pages for n, pages in self._by_node(plan, prep.allocated)}
        for n in plan.nodes:
            pages = loaded.get(n.id)
            if pages is None:  # on the device already
                view.full_slots.append(n.data[self.idx].value)
                pages = self.pages(n.data[self.idx].value)
            else:
                view.full_slots.append(self.pools.full.pages_to_slots(pages))
            view.node_full_pages[n.id] = pages
