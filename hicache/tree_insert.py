"""Insert into the radix tree: a request's computed tokens and slots become tree nodes.

The walk splits nodes where the new key diverges and where a component's request pages
begin (SWA pages that fell out of a request's window at the front); tokens the tree holds
already free the request's duplicate slots (a tombstoned component adopts the request's
own pages first); the rest become new nodes, every component taking its value from what
the request holds with its backbone pages.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hicache import pools as pools_module
from hicache.components.base import TreeComponent
from hicache.keys import TOKEN_BYTES, walk_key
from hicache.node import TreeNode
from hicache.pools import DevicePools
from hicache.tree import RadixTree


class TreeInsert:
    """Inserts request-owned slots into ``tree``, freeing duplicates to ``pools``."""

    def __init__(self, tree: RadixTree, pools: DevicePools) -> None:
        self.tree = tree
        self.pools = pools

    def insert(
        self,
        arr: np.ndarray,
        slots: np.ndarray,
        end_values: dict[int, Any],
        extra_key: str | None,
        prev_prefix_len: int,
        check_pages: bool = True,
    ) -> tuple[int, list[TreeNode]]:
        """Cache tokens ``arr`` (whole pages) whose backbone slots are ``slots``; the tree
        takes ``slots[prev_prefix_len:]`` (freeing those of tokens it holds already) and
        ``end_values`` (by component index) for the end node. Returns how many leading
        tokens were already cached on the device, and the nodes the insert went through
        (touched, root to leaf).

        ``check_pages`` checks that the slots taken are whole pages (raising ValueError):
        callers passing slots the cache allocated itself pass False, and the check then
        runs only with the pools' debug checks on."""
        tree = self.tree
        ps = tree.page_size
        n = arr.size
        if n % ps or slots.size != n:
            raise ValueError(
                f"insert needs whole pages and one slot per token: {n} tokens, {slots.size} "
                f"slots, page_size {ps}"
            )
        if (
            n
            and (check_pages or pools_module.DEBUG_CHECKS)
            and not tree.base.pool().check_whole_pages(slots[prev_prefix_len:])
        ):
            raise ValueError("insert: kv_indices beyond prev_prefix_len are not whole pages")
        root = tree.namespace_root(extra_key, create=n > 0)
        if n == 0:
            for idx, value in end_values.items():
                tree.components[idx].discard_value(value)
            return 0, []
        key = walk_key(arr)  # a long query is read through a view, not copied first
        aux = tree.components[1:]
        valid_from: dict[int, Any] = {}
        if aux:
            # Where the request's pages of a component begin (SWA's may have fallen out of
            # its window at the front): nodes are cut there, so the part after it can be
            # filled (host-only) or can adopt them (a tombstone on the device).
            own_pages = slots[prev_prefix_len:n:ps] // ps
            for c in aux:
                valid_from[c.idx] = c.insert_valid_from(own_pages, prev_prefix_len, n)
        cuts = sorted({v for v in valid_from.values() if v is not None}) if aux else ()
        node, pos, cached, touched = root, 0, 0, []
        while pos < n:
            off = pos * TOKEN_BYTES
            child = node.children.get(bytes(key[off : off + tree.page_bytes]))
            if child is None:
                break
            m = tree.matched_tokens(child, key, pos * TOKEN_BYTES)
            if m < child.num_tokens:
                child = tree.split(child, m)
            for comp in aux:
                cut = valid_from[comp.idx]
                if cut is not None and child.start < cut < child.end and self._lacks(child, comp):
                    child = tree.split(child, cut - child.start)
                    m = child.num_tokens
            if child.base.value is not None:
                dup = slots[max(pos, prev_prefix_len) : pos + m]
                if dup.size:
                    dup_pages = dup[::ps] // ps
                    if pos >= prev_prefix_len:
                        for comp in aux:
                            comp.adopt_from_request(child, dup_pages)
                    self.pools.free_kv_pages(dup_pages)
                cached = pos + m
            else:
                self._fill_node(child, slots[pos : pos + m], valid_from)
            touched.append(child)
            node, pos = child, pos + m
        while pos < n:
            end = next((c for c in cuts if pos < c < n), n) if cuts else n
            end = tree.leaf_policy.insert_end(key, pos, end)
            child = tree.add_child(node, bytes(key[pos * TOKEN_BYTES : end * TOKEN_BYTES]))
            self._fill_node(child, slots[pos:end], valid_from)
            touched.append(child)
            node, pos = child, end
        for idx, value in end_values.items():
            tree.components[idx].take_end_value(node, value)
        tree.touch(touched)
        return cached, touched

    @staticmethod
    def _lacks(node: TreeNode, comp: TreeComponent) -> bool:
        return node.base.value is None or node.data[comp.idx].value is None

    def _fill_node(self, node: TreeNode, slots: np.ndarray, valid_from: dict[int, Any]) -> None:
        """Install request-owned ``slots`` as ``node``'s backbone value, and every other
        component's value from what the request holds with them."""
        tree = self.tree
        tree.set_value(node, tree.base, slots.copy())
        if valid_from:
            pages = slots[:: tree.page_size] // tree.page_size
            for comp in tree.components[1:]:
                comp.fill_from_request(node, pages, valid_from[comp.idx])
