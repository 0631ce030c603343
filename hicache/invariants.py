"""The invariants of ARCHITECTURE §3, recomputed from scratch and compared with what the
tree and the cache keep incrementally. Tests call them after every mutation; they are O(n)
in the tree and the pools, so nothing calls them on a serving path."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hicache.pools import DevicePools
    from hicache.quarantine import Quarantine
    from hicache.records import Request
    from hicache.tree import RadixTree

_EMPTY = np.zeros(0, dtype=np.int64)


def check_tree(tree: RadixTree) -> None:
    """Recompute every derived structure of the tree and compare; raises AssertionError."""
    evictable = {c.ctype: 0 for c in tree.components}
    protected = {c.ctype: 0 for c in tree.components}
    leaves: set[int] = set()
    lru_members = {idx: set() for idx in tree.aux_lru}
    ps = tree.page_size
    for ns, root in tree.roots.items():
        assert root.parent is None and root.key == b"" and root.namespace == ns
        assert root.children, f"empty namespace root {ns!r} kept"
    for node in tree.iter_nodes():
        parent = node.parent
        assert node.num_tokens > 0 and node.num_tokens % ps == 0, f"{node}: partial page"
        assert parent.children.get(node.key[: tree.page_bytes]) is node, f"{node}: bad link"
        assert node.start == (parent.end if parent.parent else 0), f"{node}: bad start"
        full = node.base
        if full.value is not None:
            assert parent.on_device, f"{node}: on device below a node that is not"
            # what RadixTree.device_slots joins byte for byte
            assert full.value.dtype == np.int64 and full.value.flags.c_contiguous, (
                f"{node}: FULL slots not C-contiguous int64"
            )
        assert full.lock_ref >= max((c.base.lock_ref for c in node.children.values()), default=0), (
            f"{node}: FULL lock smaller than a child's"
        )
        on_dev_children = sum(1 for c in node.children.values() if c.base.value is not None)
        assert node.device_children == on_dev_children, f"{node}: device_children"
        for comp in tree.components:
            cd = node.data[comp.idx]
            assert cd.node is node
            assert cd.lock_ref >= 0, f"{node}: negative lock on {comp}"
            if cd.value is None:
                assert cd.lock_ref == 0, f"{node}: tombstoned {comp} holds a lock"
                assert not cd.in_lru
                continue
            if not comp.leaf_only:
                assert full.value is not None, f"{node}: {comp} on device without FULL"
            if cd.backed and not comp.leaf_only:
                assert full.backed, f"{node}: {comp} backed without FULL"
            amount = comp.size(cd.value)
            (protected if cd.lock_ref else evictable)[comp.ctype] += amount
            if not comp.leaf_only and cd.lock_ref == 0:
                lru_members[comp.idx].add(node.id)
        if full.value is not None and full.lock_ref == 0 and node.device_children == 0:
            leaves.add(node.id)
        assert node.in_policy == (node.id in leaves), f"{node}: leaf policy membership"
    assert evictable == tree.evictable, f"evictable {tree.evictable} != {evictable}"
    assert protected == tree.protected, f"protected {tree.protected} != {protected}"
    assert tree.leaf_policy.members() == leaves, "leaf policy members differ"
    host_only = sum(
        n.num_tokens for n in tree.iter_nodes() if n.base.value is None and n.base.backed
    )
    assert host_only == tree.host_only_tokens, f"host-only {tree.host_only_tokens} != {host_only}"
    assert all(n.base.backed for n in tree.iter_nodes() if n.base.value is None), (
        "a node holds FULL on no tier"
    )
    for idx, lru in tree.aux_lru.items():
        listed = [cd.node.id for cd in lru]
        assert len(listed) == len(lru) == len(set(listed)), "LRU list size or duplicates"
        assert set(listed) == lru_members[idx], "LRU list members differ"


def check_cache(
    tree: RadixTree, pools: DevicePools, requests: Iterable[Request], quarantine: Quarantine
) -> None:
    """Check every invariant of ARCHITECTURE §3 over the tree, the pools, the requests and
    the quarantine; raises AssertionError naming the first broken one. Slot ownership:
    every allocated page of every pool is owned by exactly one of the tree, a request, the
    quarantine (slots a failed transfer's copy may still touch), and the free list."""
    check_tree(tree)
    assert not tree.loading, f"nodes {sorted(tree.loading)} still marked as loading"
    owners: dict[str, list[np.ndarray]] = {p.name: [] for p in pools.all()}
    base = tree.base
    for node in tree.iter_nodes():
        for comp in tree.components:
            value = node.data[comp.idx].value
            if value is not None:
                owners[comp.pool().name].append(comp.owned_pages(node, value))
        if node.base.value is not None:
            for comp in tree.components:
                comp.check_node(node)
    for req in requests:
        own = req.kv_slots[req.prefix_len :]
        own_pages = base.pool().slots_to_pages(own) if own.size else _EMPTY
        for comp in tree.components:
            owners[comp.pool().name].append(comp.request_owned(req, own_pages))
        if req.prefix_len:
            assert req.lock_receipt is not None and not req.lock_receipt.released
            tree_slots = tree.device_slots(tree.path_to_root(req.last_node))
            assert np.array_equal(tree_slots, req.kv_slots[: req.prefix_len]), (
                f"{req!r}: prefix slots differ from the tree's"
            )
        assert req.computed_len <= req.kv_slots.size
        for comp in tree.components:
            comp.check_request(req)
    for allocator, pages in quarantine.owned():
        owners[allocator.name].append(pages)
    for pool in pools.all():
        owned = np.concatenate(owners[pool.name]) if owners[pool.name] else _EMPTY
        assert np.unique(owned).size == owned.size, f"{pool.name}: a page has two owners"
        allocated = pool.allocated_pages()
        assert np.array_equal(np.sort(owned), allocated), (
            f"{pool.name}: {allocated.size} pages allocated, {owned.size} owned "
            f"(leaked: {np.setdiff1d(allocated, owned)[:8].tolist()}, "
            f"owned but free: {np.setdiff1d(owned, allocated)[:8].tolist()})"
        )
