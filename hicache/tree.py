"""The radix tree: structure, split, device values, locks and the host-only record.

Keys are token bytes (see :mod:`hicache.keys`), always whole pages. Every node (see
:mod:`hicache.node`) carries one ComponentData per component of the layout. The tree keeps,
per component, the evictable and protected device amounts and an eviction index (the leaf
policy for the backbone, an LRU list for the others), updated at the four places where
they can change: a value is set or taken, and a lock count crosses zero. Which values go
when memory is short is :mod:`hicache.tree_eviction`'s.

This module imports neither ZeroMQ nor LMDB; it moves no bytes between tiers.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from hicache.components.base import TreeComponent
from hicache.config import CacheConfig
from hicache.eviction import LeafEvictionPolicy, LRUList
from hicache.keys import TOKEN_BYTES, chain_page_hashes, namespace_hash
from hicache.node import TreeNode
from hicache.records import LockReceipt

_EMPTY = np.zeros(0, dtype=np.int64)
_SLOT_DTYPE = np.dtype(np.int64)


class RadixTree:
    """The unified radix tree over the device pools (no request or controller logic)."""

    def __init__(
        self,
        components: Sequence[type[TreeComponent]],
        config: CacheConfig,
        pools: Any,
        fingerprint: bytes,
        leaf_policy: LeafEvictionPolicy,
    ) -> None:
        self.config = config
        self.page_size = config.page_size
        self.page_bytes = config.page_size * TOKEN_BYTES
        self.pools = pools
        self.fingerprint = fingerprint
        self.components: list[TreeComponent] = [
            cls(i, self, pools, config) for i, cls in enumerate(components)
        ]
        # The backbone (FULL): index 0, the only component that leaves alone may lose; a
        # node exists while the backbone is on some tier.
        self.base = self.components[0]
        assert self.base.leaf_only and not any(c.leaf_only for c in self.components[1:])
        self.by_type = {c.ctype: c for c in self.components}
        # Freeing order on a node: lowest priority first (aux data is addressed through FULL).
        self.free_order = sorted(self.components, key=lambda c: c.priority)
        self.leaf_policy = leaf_policy
        leaf_policy.attach(self.page_size)
        # the policy's hit hook, or None where it keeps the base class's no-op (a match
        # then skips calling it once per node)
        self._policy_on_hit = (
            leaf_policy.on_hit
            if type(leaf_policy).on_hit is not LeafEvictionPolicy.on_hit
            else None
        )
        # Eviction may cut a leaf and keep its head, unless a component's state lives only
        # at a node's end (Mamba), without which the head could not end a match.
        self.cut_tails = all(c.head_survives_cut for c in self.components)
        self.aux_lru = {c.idx: LRUList() for c in self.components if not c.leaf_only}
        # (component index, its LRU list) of every component kept in one: what a touch
        # moves besides the leaf policy's entry
        self._aux_lru_items = list(self.aux_lru.items())
        self.evictable = {c.ctype: 0 for c in self.components}
        self.protected = {c.ctype: 0 for c in self.components}
        self.roots: dict[str | None, TreeNode] = {}
        self.clock = 0
        self.host_only_tokens = 0  # tokens of nodes held only by the controller
        # ids of nodes a load-back in progress is bringing to the device: never forgotten
        # as host-only leaves meanwhile (the eviction that makes room for the load prunes)
        self.loading: set[int] = set()

    # -- namespaces and structure --------------------------------------------------------

    def namespace_root(self, extra_key: str | None, create: bool = False) -> TreeNode | None:
        root = self.roots.get(extra_key)
        if root is None and create:
            root = TreeNode(None, b"", 0, 0)
            root.hashes = [namespace_hash(self.fingerprint, extra_key)]
            root.namespace = extra_key
            self.roots[extra_key] = root
        return root

    def walk(
        self, node: TreeNode, key: bytes | memoryview, pos: int = 0
    ) -> tuple[list[TreeNode], TreeNode | None, int]:
        """Follow ``key[pos:]`` (``pos`` in bytes) down from ``node``; ``key`` is token
        bytes, or a byte view of them (:func:`~hicache.keys.token_view`), which a long
        query passes so as not to copy itself into a key first.

        Returns the nodes whose whole key matched, then the next node that matched only
        partly (or None) and how many whole-page tokens of it matched.
        """
        if type(key) is memoryview:
            return self._walk_view(node, key, pos)
        path: list[TreeNode] = []
        step = self.page_bytes
        n = len(key)
        while pos < n:
            child = node.children.get(key[pos : pos + step])
            if child is None:
                break
            ck = child.key
            if key.startswith(ck, pos):  # memcmp in place, no slice copied
                path.append(child)
                pos += len(ck)
                node = child
                continue
            return path, child, self._common_tokens(ck, key, pos)
        return path, None, 0

    def _walk_view(
        self, node: TreeNode, view: memoryview, pos: int
    ) -> tuple[list[TreeNode], TreeNode | None, int]:
        """``walk`` over a byte view: the same steps, each node's key compared with the
        view's slice (a slice of a view copies nothing)."""
        path: list[TreeNode] = []
        step = self.page_bytes
        n = len(view)
        while pos < n:
            child = node.children.get(view[pos : pos + step].tobytes())
            if child is None:
                break
            ck = child.key
            end = pos + len(ck)
            if end <= n and ck.startswith(view[pos:end]):
                path.append(child)
                pos = end
                node = child
                continue
            return path, child, self._common_tokens(ck, view, pos)
        return path, None, 0

    def matched_tokens(self, node: TreeNode, key: bytes | memoryview, pos: int) -> int:
        """Whole-page tokens of ``node``'s key that ``key[pos:]`` (``pos`` in bytes; token
        bytes or a byte view of them) repeats from its start; the caller found the first
        page equal."""
        ck = node.key
        if type(key) is memoryview:
            end = pos + len(ck)
            if end <= len(key) and ck.startswith(key[pos:end]):  # one memcmp, no copy
                return len(ck) // TOKEN_BYTES
        elif key.startswith(ck, pos):  # the common case, one memcmp
            return len(ck) // TOKEN_BYTES
        return self._common_tokens(ck, key, pos)

    def _common_tokens(self, node_key: bytes, key: bytes | memoryview, pos: int) -> int:
        """Whole-page tokens shared by ``node_key`` and ``key[pos:]`` (at least one page)."""
        count = min(len(node_key), len(key) - pos) // TOKEN_BYTES
        a = np.frombuffer(node_key, dtype=np.int64, count=count)
        b = np.frombuffer(key, dtype=np.int64, count=count, offset=pos)
        differs = a != b
        first = int(differs.argmax())  # argmax stops at the first True
        same = first if differs[first] else count
        return same - same % self.page_size

    def add_child(self, parent: TreeNode, key: bytes) -> TreeNode:
        """A new node under ``parent`` holding no data yet."""
        node = TreeNode(parent, key, parent.end, len(self.components))
        node.last_access = self.clock
        parent.children[key[: self.page_bytes]] = node
        self.leaf_policy.on_insert(node)
        return node

    def split(self, node: TreeNode, k_tokens: int) -> TreeNode:
        """Cut ``node`` after ``k_tokens``; returns the new parent holding the prefix.

        ``node`` keeps its identity (lock receipts name it) and the suffix.
        """
        assert 0 < k_tokens < node.num_tokens and k_tokens % self.page_size == 0
        parent = node.parent
        cut = k_tokens * TOKEN_BYTES
        new = TreeNode(parent, node.key[:cut], node.start, len(self.components))
        new.last_access = node.last_access
        new.hit_count = node.hit_count
        parent.children[node.key[: self.page_bytes]] = new
        node.key = node.key[cut:]
        node.start += k_tokens
        node.parent = new
        new.children[node.key[: self.page_bytes]] = node
        if node.hashes is not None:
            pages = k_tokens // self.page_size
            new.hashes, node.hashes = node.hashes[:pages], node.hashes[pages:]
        for comp in self.components:
            cd, pcd = node.data[comp.idx], new.data[comp.idx]
            before = comp.size(cd.value) if cd.value is not None else 0
            comp.split(pcd, cd, k_tokens)
            # The amounts move between nodes; only the totals are re-derived here.
            after = sum(comp.size(x.value) for x in (cd, pcd) if x.value is not None)
            assert after == before, f"{comp} split changed the device amount"
            if pcd.value is not None and not comp.leaf_only:
                lru = self.aux_lru[comp.idx]
                if pcd.lock_ref == 0:
                    if cd.in_lru:
                        lru.insert_before(pcd, cd)
                    else:
                        lru.push_back(pcd)
        if node.on_device:
            new.device_children = 1
        self._sync_amounts_after_split(new, node)
        self.leaf_policy.on_split(new)
        return new

    def _sync_amounts_after_split(self, new: TreeNode, node: TreeNode) -> None:
        # Locks of the prefix part equal the suffix's for FULL/SWA and are zero for MAMBA
        # on the new parent; the evictable/protected split must follow.
        for comp in self.components:
            pcd, cd = new.data[comp.idx], node.data[comp.idx]
            if pcd.value is None:
                continue
            if (pcd.lock_ref > 0) == (cd.lock_ref > 0):
                continue
            # The prefix part was counted with the suffix's lock state: move it across.
            amount = comp.size(pcd.value)
            if pcd.lock_ref == 0:
                self.protected[comp.ctype] -= amount
                self.evictable[comp.ctype] += amount
            else:
                self.evictable[comp.ctype] -= amount
                self.protected[comp.ctype] += amount

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    def namespace_of(self, node: TreeNode) -> str | None:
        """The namespace (``extra_key``) of the root ``node`` hangs under."""
        while node.parent is not None:
            node = node.parent
        return node.namespace

    def path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from the namespace root's child down to ``node``."""
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def node_hashes(self, node: TreeNode) -> list[bytes]:
        """The page hashes of ``node`` (computed once, from its parent's last hash)."""
        if node.hashes is None:
            parent = node.parent
            prev = self.node_hashes(parent)[-1] if parent.parent else parent.hashes[0]
            node.hashes = chain_page_hashes(prev, node.key, self.page_size)
        return node.hashes

    def attached(self, node: TreeNode) -> bool:
        """``node`` is still reachable from its namespace's root."""
        while node.parent is not None:
            node = node.parent
        return self.roots.get(node.namespace) is node

    def device_slots(self, nodes: Sequence[TreeNode]) -> np.ndarray:
        """The backbone's device slots of ``nodes``, in order (a node's own array when
        there is one node: the caller copies before handing it out)."""
        if not nodes:
            return _EMPTY
        if len(nodes) == 1:
            return nodes[0].base.value
        # One copy into a bytearray, viewed as int64: the same array np.concatenate would
        # build, without its per-call dtype and shape resolution (~1.3 µs of the ~4 µs it
        # takes for 8k slots in 5 nodes here). Backbone values are C-contiguous int64
        # (check_invariants says so); a strided one would raise, not join wrongly.
        return np.frombuffer(bytearray().join([n.base.value for n in nodes]), _SLOT_DTYPE)

    def end_hash(self, node: TreeNode) -> bytes:
        """The chain hash at ``node``'s end (``h_0`` for a namespace root)."""
        return self.node_hashes(node)[-1] if node.parent is not None else node.hashes[0]

    def parent_hash(self, node: TreeNode) -> bytes:
        """The chain hash before ``node``'s first page."""
        return self.end_hash(node.parent)

    # -- values and bookkeeping ----------------------------------------------------------

    def set_value(self, node: TreeNode, comp: TreeComponent, value: Any) -> None:
        """Give ``node`` a device value for ``comp`` (it must have none)."""
        cd = node.data[comp.idx]
        assert cd.value is None, f"{node} already holds {comp}"
        if comp.leaf_only and cd.backed:
            self.host_only_tokens -= node.num_tokens
        cd.value = value
        amount = comp.size(value)
        if cd.lock_ref == 0:
            self.evictable[comp.ctype] += amount
        else:
            self.protected[comp.ctype] += amount
        if comp.leaf_only:
            parent = node.parent
            if parent.parent is not None:
                parent.device_children += 1
                self._refresh_leaf(parent)
            self._refresh_leaf(node)
        elif cd.lock_ref == 0:
            self.aux_lru[comp.idx].insert_by_access(cd)

    def take_value(self, node: TreeNode, comp: TreeComponent) -> Any:
        """Remove and return ``node``'s device value for ``comp`` (the caller frees it)."""
        cd = node.data[comp.idx]
        value = cd.value
        assert value is not None, f"{node} holds no {comp}"
        assert cd.lock_ref == 0, f"taking locked {comp} from {node}"
        cd.value = None
        self.evictable[comp.ctype] -= comp.size(value)
        if comp.leaf_only:
            self._refresh_leaf(node)
            parent = node.parent
            if parent.parent is not None:
                parent.device_children -= 1
                self._refresh_leaf(parent)
        else:
            self.aux_lru[comp.idx].remove(cd)
        return value

    def _refresh_leaf(self, node: TreeNode) -> None:
        """Keep ``node``'s membership in the leaf policy equal to "evictable leaf"."""
        cd = node.base
        want = cd.value is not None and cd.lock_ref == 0 and node.device_children == 0
        if want and not node.in_policy:
            node.in_policy = True
            self.leaf_policy.add(node)
        elif not want and node.in_policy:
            node.in_policy = False
            self.leaf_policy.remove(node)

    def inc_lock(self, node: TreeNode, comp: TreeComponent) -> None:
        cd = node.data[comp.idx]
        assert cd.value is not None, f"locking {comp} on {node}, which holds none"
        cd.lock_ref += 1
        if cd.lock_ref == 1:
            amount = comp.size(cd.value)
            self.evictable[comp.ctype] -= amount
            self.protected[comp.ctype] += amount
            if comp.leaf_only:
                self._refresh_leaf(node)
            else:
                self.aux_lru[comp.idx].remove(cd)

    def dec_lock(self, node: TreeNode, comp: TreeComponent) -> None:
        cd = node.data[comp.idx]
        assert cd.lock_ref > 0, f"unlocking {comp} on {node} below zero"
        cd.lock_ref -= 1
        if cd.lock_ref == 0:
            amount = comp.size(cd.value)
            self.protected[comp.ctype] -= amount
            self.evictable[comp.ctype] += amount
            if comp.leaf_only:
                self._refresh_leaf(node)
            else:
                self.aux_lru[comp.idx].insert_by_access(cd)

    def touch(self, nodes: Sequence[TreeNode], hit: bool = False) -> None:
        """Mark ``nodes`` (root to leaf order) as just used; with ``hit`` a match used
        them: their hit counts grow and the leaf policy's ``on_hit`` hears of each."""
        self.clock += 1
        now = self.clock
        aux = self._aux_lru_items
        policy_touch = self.leaf_policy.touch
        for node in nodes:
            node.last_access = now
            if hit:
                node.hit_count += 1
            if node.in_policy:
                policy_touch(node)
        for idx, lru in aux:
            for node in nodes:
                cd = node.data[idx]
                if cd.in_lru:
                    lru.touch(cd)
        if hit and self._policy_on_hit is not None:
            on_hit = self._policy_on_hit
            for node in nodes:
                on_hit(node)

    # -- locks ---------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> LockReceipt:
        """Protect what a user of the prefix ending at ``node`` needs from eviction.

        FULL from ``node`` to the root, SWA over the window ending at ``node``, MAMBA on
        ``node`` itself. Returns the receipt that ``unlock`` replays.
        """
        if node.parent is None:
            return LockReceipt(node)
        return LockReceipt(node, {comp.idx: comp.lock(node) for comp in self.components})

    def unlock(self, receipt: LockReceipt, touch: bool = True) -> None:
        """Release exactly what ``lock`` took; a second unlock of a receipt raises.

        With ``touch`` the path counts as used until now (a request held it); transfers
        that held it only to copy it pass ``touch=False``.
        """
        if receipt.released:
            raise RuntimeError(f"lock receipt {receipt.receipt_id} released twice")
        receipt.released = True
        for comp in self.components:
            if comp.idx in receipt.parts:
                comp.unlock(receipt.node, receipt.parts[comp.idx])
        if touch and receipt.parts:
            self.touch(self.path_to_root(receipt.node))

    # -- removal and the host-only record ----------------------------------------------

    def remove_subtree(self, node: TreeNode) -> None:
        """Detach ``node`` (which, with its subtree, holds nothing on the device)."""
        for sub in self._subtree(node):
            for comp in self.components:
                cd = sub.data[comp.idx]
                assert cd.value is None and cd.lock_ref == 0, f"removing {sub} with device data"
            if sub.base.backed:
                self.host_only_tokens -= sub.num_tokens
        parent = node.parent
        del parent.children[node.key[: self.page_bytes]]
        node.parent = None
        if parent.parent is None and not parent.children:
            self.roots.pop(parent.namespace, None)

    def mark_host_only(self, node: TreeNode) -> None:
        """``node`` (holding nothing on the device) is held by the controller."""
        if not node.base.backed:
            node.base.backed = True
            self.host_only_tokens += node.num_tokens

    def prune_host_only(self, keep: TreeNode | None = None) -> int:
        """Forget least recently used host-only leaves while their tokens exceed
        ``max_host_only_tokens`` (down to 90% of it), never ``keep`` (a node a caller is
        about to hand out) nor a node a load-back is bringing; returns the tokens
        forgotten."""
        cap = self.config.max_host_only_tokens
        if self.host_only_tokens <= cap:
            return 0
        target = cap * 9 // 10
        heap = [
            (n.last_access, n.id, n)
            for n in self.iter_nodes()
            if n.base.value is None
            and not n.children
            and n.id not in self.loading
            and n is not keep
        ]
        heapq.heapify(heap)
        before = self.host_only_tokens
        while heap and self.host_only_tokens > target:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self.remove_subtree(node)
            if (
                parent.parent is not None
                and parent.base.value is None
                and not parent.children
                and parent.id not in self.loading
            ):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return before - self.host_only_tokens

    def _subtree(self, node: TreeNode) -> Iterator[TreeNode]:
        stack = [node]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def clear(self) -> None:
        """Forget every node (values must have been freed by the caller)."""
        self.roots.clear()
        for lru in self.aux_lru.values():
            while lru.pop_front() is not None:
                pass
        while self.leaf_policy.pop() is not None:
            pass
        for comp in self.components:
            self.evictable[comp.ctype] = 0
            self.protected[comp.ctype] = 0
        self.host_only_tokens = 0
