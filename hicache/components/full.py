"""FULL: full-attention KV, the backbone. A node exists while it has FULL on some tier."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.components.base import LoadPlan, LoadPrep, TreeComponent
from hicache.controller_api import PageKey, PageRef
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.request import Request
    from hicache.tree import ComponentData, TreeNode


class FullComponent(TreeComponent):
    """Value: the FULL token slots of the node's span (whole pages, in order)."""

    ctype = ComponentType.FULL
    priority = 2
    leaf_only = True

    def size(self, value: np.ndarray) -> int:
        return int(value.size)

    def pages(self, value: np.ndarray) -> np.ndarray:
        return value[:: self.page_size] // self.page_size

    def free(self, node: TreeNode, value: np.ndarray) -> int:
        self.pools.free_kv_pages(self.pages(value))
        return int(value.size)

    def owned_pages(self, node: TreeNode, value: np.ndarray) -> np.ndarray:
        return self.pages(value)

    def split(self, parent: ComponentData, child: ComponentData, k_tokens: int) -> None:
        if child.value is not None:
            parent.value, child.value = child.value[:k_tokens], child.value[k_tokens:]
        parent.lock_ref = child.lock_ref
        parent.backed = child.backed

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

    def plan_load(self, plan: LoadPlan) -> list[PageKey]:
        need = [n for n in plan.nodes if n.data[self.idx].value is None]
        plan.parts[self.idx] = need
        return [PageKey(self.ctype, h) for n in need for h in self.tree.node_hashes(n)]

    def prepare_load_back(self, plan: LoadPlan, req: Request | None) -> LoadPrep:
        need = plan.parts[self.idx]
        pages = self.pools.full.alloc_pages(sum(n.num_tokens for n in need) // self.page_size)
        refs: list[PageRef] = []
        off = 0
        for n in need:
            k = n.num_tokens // self.page_size
            refs += self.page_refs(n, pages[off : off + k].tolist())
            off += k
        return LoadPrep(refs, pages)

    def finalize_load_back(
        self, plan: LoadPlan, req: Request | None, prep: LoadPrep, ok: bool
    ) -> None:
        if not ok:
            self.pools.full.free_pages(prep.allocated)
            return
        off = 0
        for n in plan.parts[self.idx]:
            k = n.num_tokens // self.page_size
            slots = self.pools.full.pages_to_slots(prep.allocated[off : off + k])
            self.tree.set_value(n, self, slots)
            n.data[self.idx].backed = True
            off += k
