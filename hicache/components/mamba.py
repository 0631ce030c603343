"""MAMBA: recurrent state. One fixed-size state, valid exactly at the node's end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.components.base import (
    LoadPlan,
    LoadPrep,
    MakeRoom,
    MatchCheck,
    PendingView,
    TreeComponent,
)
from hicache.controller_api import PageKey, PageRef
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.node import ComponentData, TreeNode
    from hicache.records import MatchResult, Request


class MambaComponent(TreeComponent):
    """Value: a Mamba pool state slot holding the state after the node's last token."""

    ctype = ComponentType.MAMBA
    priority = 0
    head_survives_cut = False

    def size(self, value: int) -> int:
        return 1

    def free(self, node: TreeNode, value: int) -> int:
        self.pools.mamba.free_state(value)
        return 1

    def owned_pages(self, node: TreeNode, value: int) -> np.ndarray:
        return np.array([value], dtype=np.int64)

    def split(self, parent: ComponentData, child: ComponentData, k_tokens: int) -> None:
        # The state belongs to the end of the span, which stays with the child.
        parent.value = None
        parent.lock_ref = 0
        parent.backed = False

    def match_check(self, path: Sequence[TreeNode]) -> MatchCheck:
        idx = self.idx

        def check(i: int, end: int) -> bool:
            node = path[i]
            return end == node.end and node.data[idx].value is not None

        return check

    def lock(self, node: TreeNode) -> bool:
        if node.parent is None or node.data[self.idx].value is None:
            return False
        self.tree.inc_lock(node, self)
        return True

    def unlock(self, node: TreeNode, part: bool) -> None:
        if part:
            self.tree.dec_lock(node, self)

    def state_ref(self, node: TreeNode, slot: int) -> PageRef:
        """The state at ``node``'s end is stored under the hash of its last page."""
        hashes = self.tree.node_hashes(node)
        parent = hashes[-2] if len(hashes) > 1 else self.tree.parent_hash(node)
        return PageRef(self.ctype, hashes[-1], parent, slot)

    def backup_refs(self, node: TreeNode) -> list[PageRef]:
        value = node.data[self.idx].value
        return [] if value is None else [self.state_ref(node, value)]

    def plan_load(self, plan: LoadPlan) -> list[PageKey]:
        node = plan.end_node
        on_device = node.data[self.idx].value is not None
        plan.parts[self.idx] = on_device
        if on_device:
            return []
        return [PageKey(self.ctype, self.tree.node_hashes(node)[-1])]

    def prepare_load_back(self, plan: LoadPlan, req: Request | None) -> LoadPrep:
        node = plan.end_node
        slot = self.pools.mamba.alloc_state()
        try:
            if plan.parts[self.idx]:
                # The state is on the device already: the request gets its own copy.
                self.pools.mamba.copy_state(node.data[self.idx].value, slot)
                return LoadPrep([], slot)
            return LoadPrep([self.state_ref(node, slot)], slot)
        except BaseException:
            self.pools.mamba.free_state(slot)  # no finalize follows a prepare that raised
            raise

    def pending_view(self, plan: LoadPlan, prep: LoadPrep, view: PendingView) -> None:
        view.state_slot = int(prep.allocated)

    def finalize_load_back(
        self, plan: LoadPlan, req: Request | None, prep: LoadPrep, ok: bool
    ) -> None:
        slot: int = prep.allocated
        if not ok:
            self.pools.mamba.free_state(slot)
            return
        node = plan.end_node
        node_takes = node.data[self.idx].value is None and node.base.value is not None
        if req is None:
            if node_takes:
                self._set_node_state(node, slot)
            else:
                self.pools.mamba.free_state(slot)
            return
        if node_takes and self.pools.mamba.available_pages() > 0:
            # The node keeps the loaded state as well, so that the next request with this
            # prefix (a sibling, a retry) finds it on the device instead of loading it
            # again; the request works on its own copy. Only from a free slot: a load-back
            # never evicts for this.
            own = self.pools.mamba.alloc_state()
            self.pools.mamba.copy_state(slot, own)
            self._set_node_state(node, slot)
            slot = own
        if req.mamba_slot is not None:
            self.pools.mamba.free_state(req.mamba_slot)
        req.mamba_slot = slot

    def _set_node_state(self, node: TreeNode, slot: int) -> None:
        self.tree.set_value(node, self, slot)
        node.data[self.idx].backed = node.base.backed  # held only with its FULL pages

    def pool(self) -> Any:
        return self.pools.mamba

    def load_need(self, plan: LoadPlan) -> int:
        return 1  # the request's (or the end node's) own state slot

    def mark_on_device(self, mask: np.ndarray, off: int, take: int, whole: bool) -> None:
        if whole:  # the state is at the node's end only
            mask[off + take - 1] = True

    def tiers_for_match_end(self, tiers: np.ndarray) -> np.ndarray:
        return tiers  # a match needs the state at its end, nothing before

    def backed_by_lookup(self, present: np.ndarray) -> bool:
        return bool(present[-1])

    def state_of(self, node: TreeNode) -> Any:
        return node.data[self.idx].value

    # -- what requests hold: a working state and a checkpoint at a page boundary -------

    def _alloc(self, make_room: MakeRoom) -> int:
        """A free state slot, evicting a cached state if none is free."""
        make_room({self.ctype: 1})
        return self.pools.mamba.alloc_state()

    def attach_request(self, req: Request, result: MatchResult, make_room: MakeRoom) -> None:
        """The request's own working state: a copy of the cached one at the match end
        (copy-on-write), zeroed for an empty prefix."""
        slot = self._alloc(make_room)
        src = self.state_of(result.last_node) if result.prefix_len else None
        if src is None:
            self.pools.mamba.conv[:, slot].zero_()
            self.pools.mamba.ssm[:, slot].zero_()
        else:
            self.pools.mamba.copy_state(src, slot)
        req.mamba_slot = slot
        result.mamba_slot = slot

    def checkpoint_request(self, req: Request, make_room: MakeRoom) -> None:
        """Copy the working state aside, valid at the computed length (page aligned), so
        that caching can later use the state at that page boundary."""
        if req.computed_len % self.page_size:
            raise ValueError(f"checkpoint_mamba at {req.computed_len}: not a page boundary")
        if req.mamba_ckpt_slot is None:
            req.mamba_ckpt_slot = self._alloc(make_room)
        self.pools.mamba.copy_state(req.mamba_slot, req.mamba_ckpt_slot)
        req.mamba_ckpt_len = req.computed_len

    def request_insert_end(
        self, req: Request, end: int, finishing: bool, make_room: MakeRoom
    ) -> tuple[int, Any]:
        """Only up to a page boundary where a state exists: the working state (when
        computed exactly there), else the checkpoint; else nothing beyond the prefix."""
        if req.computed_len == end and end > req.prefix_len:
            if finishing:
                slot, req.mamba_slot = req.mamba_slot, None
            else:
                slot = self._alloc(make_room)
                self.pools.mamba.copy_state(req.mamba_slot, slot)
            return end, slot
        if req.mamba_ckpt_slot is not None and req.prefix_len < req.mamba_ckpt_len <= end:
            slot, req.mamba_ckpt_slot = req.mamba_ckpt_slot, None
            return req.mamba_ckpt_len, slot
        return req.prefix_len, None

    def take_end_value(self, node: TreeNode, value: int) -> None:
        if self.state_of(node) is None:
            self.tree.set_value(node, self, value)
        else:
            self.pools.mamba.free_state(value)

    def discard_value(self, value: int) -> None:
        self.pools.mamba.free_state(value)

    def return_request_value(self, req: Request) -> bool:
        """A request that computed nothing past its prefix holds that prefix's state (after
        a load-back the state went to the request, not the node)."""
        node = req.last_node
        if req.mamba_slot is None or node is None or node.parent is None:
            return False
        if self.state_of(node) is not None:
            return False
        self.tree.set_value(node, self, req.mamba_slot)
        req.mamba_slot = None
        return True

    def release_request(self, req: Request) -> None:
        for slot in (req.mamba_slot, req.mamba_ckpt_slot):
            if slot is not None:
                self.pools.mamba.free_state(slot)
        req.mamba_slot = req.mamba_ckpt_slot = None

    def request_owned(self, req: Request, own_pages: np.ndarray) -> np.ndarray:
        slots = [s for s in (req.mamba_slot, req.mamba_ckpt_slot) if s is not None]
        return np.array(slots, dtype=np.int64)
