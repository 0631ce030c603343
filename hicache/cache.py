"""UnifiedRadixCache: the engine-facing cache over the tree, the device pools and a controller.

"The tree decides, the cache executes": :class:`~hicache.tree.RadixTree` keeps structure,
locks and values, :class:`~hicache.tree_eviction.TreeEviction` the eviction order; this
class turns engine calls (match, insert, requests) into tree operations, owns the
requests' slots, and holds the tiering objects that talk to the controller:
:class:`~hicache.backups.Backups` (write policy, backups in flight),
:class:`~hicache.beyond_device.BeyondDevice` (hits beyond the device),
:class:`~hicache.load_back.LoadBack` and the :class:`~hicache.quarantine.Quarantine`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hicache.backups import Backups
from hicache.beyond_device import BeyondDevice, Walk
from hicache.components import COMPONENT_CLASSES
from hicache.components.base import TreeComponent
from hicache.config import CacheConfig, WritePolicy
from hicache.controller_api import CacheController, LayerGroups
from hicache.eviction import LeafEvictionPolicy
from hicache.invariants import check_cache
from hicache.keys import TOKEN_BYTES, TokenInput, token_array, walk_key
from hicache.layout import ModelLayout
from hicache.leaf_policies import make_leaf_policy
from hicache.load_back import LayeredLoadBack, LoadBack
from hicache.node import TreeNode
from hicache.pools import DevicePools
from hicache.quarantine import Quarantine
from hicache.records import CacheStats, EvictResult, LockReceipt, MatchResult, Request
from hicache.tree import RadixTree
from hicache.tree_eviction import TreeEviction
from hicache.tree_insert import TreeInsert
from hicache.types import ComponentType, PoolExhaustedError

log = logging.getLogger("hicache.cache")

_EMPTY = np.zeros(0, dtype=np.int64)


class UnifiedRadixCache:
    """One radix tree caching FULL KV, SWA KV and Mamba state of prefixes (ARCHITECTURE §4).

    ``components`` (default: one per component type of the layout, FULL first) are the
    TreeComponent classes the tree carries.
    """

    def __init__(
        self,
        layout: ModelLayout,
        config: CacheConfig,
        pools: DevicePools,
        controller: CacheController | None = None,
        leaf_policy: LeafEvictionPolicy | None = None,
        components: Sequence[type[TreeComponent]] | None = None,
    ) -> None:
        config.validate(layout)
        self.layout = layout
        self.config = config
        self.pools = pools
        self.controller = controller
        self.page_size = config.page_size
        self.page_bytes = self.page_size * TOKEN_BYTES
        self.requests: dict[int, Request] = {}
        self.counters: Counter[str] = Counter()
        self.tree = RadixTree(
            components or [COMPONENT_CLASSES[c] for c in layout.components],
            config,
            pools,
            layout.fingerprint(config.page_size),
            leaf_policy or make_leaf_policy(config),
        )
        # The component that insert's ``mamba_slot`` (ARCHITECTURE §4) hands a value to.
        self.mamba = self.tree.by_type.get(ComponentType.MAMBA)
        self.quarantine = Quarantine(self.counters)
        self.backups: Backups | None = None
        self.beyond: BeyondDevice | None = None
        self.loader: LoadBack | None = None
        on_device_free = None
        if controller is not None:
            self.backups = Backups(
                self.tree,
                controller,
                config,
                self.quarantine,
                self.counters,
                pools.full.buffer.is_cuda,
            )
            self.beyond = BeyondDevice(self.tree, controller, config, self.counters)
            self.loader = LoadBack(
                self.tree, controller, config, self.quarantine, self.counters, self.make_room
            )
            if config.write_policy is WritePolicy.WRITE_BACK:
                on_device_free = self.backups.write_back
        self.eviction = TreeEviction(self.tree, on_device_free)
        self.inserter = TreeInsert(self.tree, pools)
        self._null_root = TreeNode(None, b"", 0, 0)
        if controller is not None:
            controller.register(layout, self.page_size, pools)

    @property
    def evicted(self) -> EvictResult:
        """Running totals of what eviction freed."""
        return self.eviction.evicted

    def lock(self, node: TreeNode) -> LockReceipt:
        """Protect the prefix ending at ``node`` from eviction; see RadixTree.lock."""
        return self.tree.lock(node)

    def unlock(self, receipt: LockReceipt, touch: bool = True) -> None:
        """Release exactly what ``lock`` took; see RadixTree.unlock."""
        self.tree.unlock(receipt, touch)

    # -- match ---------------------------------------------------------------------------

    def match_prefix(
        self, tokens: TokenInput, extra_key: str | None = None, req: Request | None = None
    ) -> MatchResult:
        """Find the longest cached prefix of ``tokens`` (whole pages) in ``extra_key``'s
        namespace that every component can serve from the device, and what lies beyond it
        on the host and disk tiers.

        With ``req`` (which must hold nothing yet), the device prefix is locked for it,
        ``req.kv_slots``/``prefix_len``/``last_node`` are set, and for Mamba layouts
        ``req.mamba_slot`` is the request's own copy of the state at the match end (zeroed
        when the prefix is empty). Splits a node when the match ends inside it.
        """
        self.poll_transfers()
        tree = self.tree
        arr = token_array(tokens)
        n = arr.size - arr.size % self.page_size
        # With a controller, a namespace this tree has not seen may still hit beyond it.
        root = tree.roots.get(extra_key)
        if root is None and self.controller is not None and n > 0:
            root = tree.namespace_root(extra_key, create=True)
        counters = self.counters
        counters["match_calls"] += 1
        if root is None or n == 0:
            result = MatchResult(_EMPTY, 0, root or self._null_root)
        else:
            key = walk_key(arr if n == arr.size else arr[:n])
            path, partial, k = tree.walk(root, key)
            last_node, prefix_nodes = self._device_match(root, path, partial, k)
            if prefix_nodes:
                slots = tree.device_slots(prefix_nodes)
                if len(prefix_nodes) == 1:
                    slots = slots.copy()  # never hand out a node's own array
                tree.touch(prefix_nodes, hit=True)
                if self.backups is not None:
                    self.backups.on_prefix_hit(prefix_nodes)
            else:
                slots = _EMPTY
            end = last_node.end
            result = MatchResult(slots, end, last_node)
            if self.beyond is not None and end < n:
                rest = tree.walk(last_node, key, end * TOKEN_BYTES)
                hit = self.beyond.find(Walk(last_node, bytes(key), *rest))
                result.host_hit_len = hit.host_hit_len
                result.disk_hit_len = hit.disk_hit_len
                result.remote_hit_len = hit.remote_hit_len
                result.load_node = hit.load_node
            if not root.children:
                tree.roots.pop(extra_key, None)
        counters["device_hit_tokens"] += result.prefix_len
        if result.host_hit_len or result.disk_hit_len or result.remote_hit_len:
            counters["host_hit_tokens"] += result.host_hit_len
            counters["disk_hit_tokens"] += result.disk_hit_len
            counters["remote_hit_tokens"] += result.remote_hit_len
        if req is not None:
            self._attach(req, result, arr)
        return result

    def _device_match(
        self, root: TreeNode, path: list[TreeNode], partial: TreeNode | None, k: int
    ) -> tuple[TreeNode, list[TreeNode]]:
        """The deepest end on the device every component accepts: (last node, its path)."""
        dev = len(path)
        # A node on the device has its parent there too: one look at the path's end
        # says whether the whole path is on the device.
        if path and path[-1].base.value is None:
            for i, node in enumerate(path):
                if node.base.value is None:
                    dev = i
                    break
        cand = path[:dev] if dev < len(path) else path
        partial_end = None
        if partial is not None and dev == len(path) and partial.base.value is not None:
            cand = [*cand, partial]
            partial_end = partial.start + k
        if len(self.tree.components) == 1:  # FULL alone accepts every position on the device
            if partial_end is not None:
                cand[-1] = self.tree.split(partial, k)
            return (cand[-1], cand) if cand else (root, cand)
        checks = [f for f in (c.match_check(cand) for c in self.tree.components) if f is not None]
        for i in range(len(cand) - 1, -1, -1):
            end = partial_end if (partial_end is not None and i == len(cand) - 1) else cand[i].end
            if all(check(i, end) for check in checks):
                if end < cand[i].end:
                    cand[i] = self.tree.split(cand[i], end - cand[i].start)
                return cand[i], cand[: i + 1]
        return root, []

    def _attach(self, req: Request, result: MatchResult, tokens: np.ndarray) -> None:
        """Give ``req`` the matched device prefix: lock, slots, and what each component
        gives a request of its own (Mamba: a working state)."""
        if req.kv_slots.size or req.lock_receipt is not None:
            raise ValueError(f"{req!r} already holds slots; match_prefix needs a fresh request")
        receipt = self.lock(result.last_node)
        try:
            for comp in self.tree.components:
                comp.attach_request(req, result, self.make_room)
        except PoolExhaustedError:
            for comp in self.tree.components:
                comp.release_request(req)
            self.unlock(receipt, touch=False)
            raise
        req.kv_slots = result.device_slots.copy()
        req.token_ids = tokens[: result.prefix_len].copy()
        req.prefix_len = result.prefix_len
        req.last_node = result.last_node
        req.lock_receipt = receipt
        self.requests[id(req)] = req

    # -- insert --------------------------------------------------------------------------

    def insert(
        self,
        tokens: TokenInput,
        kv_indices: np.ndarray | torch.Tensor,
        mamba_slot: int | None = None,
        extra_key: str | None = None,
        prev_prefix_len: int = 0,
    ) -> int:
        """Cache ``tokens`` (a whole number of pages) whose FULL slots are ``kv_indices``.

        The cache takes ownership of ``kv_indices[prev_prefix_len:]`` (the first
        ``prev_prefix_len`` already belong to the tree): slots of tokens the tree already
        holds are freed, the rest become tree nodes. SWA pages come along through the
        pools' FULL→SWA mapping (pages without one become SWA tombstones). ``mamba_slot``,
        the state after the last token, is taken by the end node, or freed when that node
        already has one. Returns how many leading tokens were already cached on the device.
        """
        end_values: dict[int, Any] = {}
        if mamba_slot is not None:
            if self.mamba is None:
                raise ValueError("insert: a mamba_slot for a layout without Mamba layers")
            end_values[self.mamba.idx] = mamba_slot
        return self._insert(tokens, kv_indices, end_values, extra_key, prev_prefix_len, True)

    def _insert(
        self,
        tokens: TokenInput,
        kv_indices: np.ndarray | torch.Tensor,
        end_values: dict[int, Any],
        extra_key: str | None,
        prev_prefix_len: int,
        check_pages: bool,
    ) -> int:
        """``insert``, with the values handed to the end node by component index;
        ``check_pages`` as in TreeInsert.insert (False for a request's own slots)."""
        self.poll_transfers()
        slots = np.asarray(
            kv_indices.numpy() if isinstance(kv_indices, torch.Tensor) else kv_indices,
            dtype=np.int64,
        )
        cached, touched = self.inserter.insert(
            token_array(tokens), slots, end_values, extra_key, prev_prefix_len, check_pages
        )
        if touched and self.backups is not None:
            self.backups.after_insert(touched)
        return cached

    # -- requests ------------------------------------------------------------------------

    def alloc_tokens(self, req: Request, num_tokens: int) -> np.ndarray:
        """FULL slots for ``num_tokens`` more tokens of ``req`` (appended to
        ``req.kv_slots``), filling its last part-used page first; evicts cached prefixes
        when the pools are short. Raises PoolExhaustedError, changing nothing, when even
        eviction cannot make room."""
        have = req.kv_slots.size
        room = (-have) % self.page_size
        take = min(room, num_tokens)
        head = req.kv_slots[-1] + 1 + np.arange(take, dtype=np.int64) if take else _EMPTY
        pages_needed = -(-(num_tokens - take) // self.page_size)
        pages = self._alloc_kv_pages(pages_needed)
        new = np.concatenate([head, self.pools.full.pages_to_slots(pages)])[:num_tokens]
        req.kv_slots = np.concatenate([req.kv_slots, new])
        self.requests[id(req)] = req
        return new

    def _alloc_kv_pages(self, n: int) -> np.ndarray:
        self.make_room({c.ctype: c.request_page_need(n) for c in self.tree.components})
        return self.pools.alloc_kv_pages(n)

    def make_room(self, need: Mapping[ComponentType, int]) -> None:
        """Evict until every component's pool has the free amount ``need`` asks of it (in
        the component's units: tokens, or states for MAMBA), if the tree can give it."""
        short = {}
        for comp in self.tree.components:
            missing = need.get(comp.ctype, 0) - comp.available()
            if missing > 0:
                short[comp.ctype] = missing
        if short:
            self.evict(amounts=short)

    def checkpoint_mamba(self, req: Request) -> None:
        """Copy ``req``'s working state aside, valid at its computed length (which must be
        page aligned), so that caching can later use the state at that page boundary."""
        for comp in self.tree.components:
            comp.checkpoint_request(req, self.make_room)

    def release_swa_outside_window(self, req: Request) -> int:
        """Free the SWA pages of ``req``'s own pages that lie wholly before its window;
        returns the SWA slots freed."""
        return sum(comp.release_outside_window(req) for comp in self.tree.components)

    def _insert_request(self, req: Request, finishing: bool) -> int:
        """Cache what ``req`` computed; returns the new cached length (its new prefix).

        Every aligned token, unless a component stops it earlier (Mamba: only up to a page
        boundary where a state exists)."""
        end = req.computed_len - req.computed_len % self.page_size
        end_values: dict[int, Any] = {}
        for comp in self.tree.components:
            end, value = comp.request_insert_end(req, end, finishing, self.make_room)
            if value is not None:
                end_values[comp.idx] = value
        if end <= req.prefix_len:
            return req.prefix_len
        # The request's slots are the cache's own allocation (alloc_tokens, match_prefix):
        # whole pages by construction.
        self._insert(
            req.token_ids[:end],
            req.kv_slots[:end],
            end_values,
            req.extra_key,
            req.prefix_len,
            check_pages=False,
        )
        return end

    def cache_unfinished_req(self, req: Request) -> None:
        """Cache what ``req`` has computed so far (whole pages) and move its lock there;
        ``req.kv_slots`` then points at the tree's slots for that prefix."""
        end = self._insert_request(req, finishing=False)
        if end == req.prefix_len:
            return
        root = self.tree.namespace_root(req.extra_key)
        path, partial, _ = self.tree.walk(root, req.token_ids[:end].tobytes())
        assert partial is None and path and path[-1].end == end, "inserted prefix not found"
        old = req.lock_receipt
        req.kv_slots = np.concatenate([self.tree.device_slots(path), req.kv_slots[end:]])
        req.lock_receipt = self.lock(path[-1])
        req.last_node = path[-1]
        req.prefix_len = end
        for comp in self.tree.components:
            comp.request_cached(req, end)
        if old is not None:
            self.unlock(old, touch=False)

    def _return_values(self, req: Request) -> None:
        """A request that computed nothing past its prefix gives what it holds of its own
        (Mamba: that prefix's state, which a load-back gave to it) to the prefix's end
        node, where the node has none."""
        returned = [comp.return_request_value(req) for comp in self.tree.components]
        if any(returned) and self.backups is not None:
            self.backups.after_insert([req.last_node])

    def cache_finished_req(self, req: Request, insert: bool = True) -> None:
        """Cache what ``req`` computed (when ``insert``), free everything else it holds
        (unaligned tail, working and checkpoint states) and release its lock."""
        if req.finished:
            raise ValueError(f"{req!r} finished twice")
        end = self._insert_request(req, finishing=True) if insert else req.prefix_len
        if insert and end == req.computed_len == req.prefix_len:
            self._return_values(req)
        tail = req.kv_slots[end:]
        if tail.size:
            self.pools.free_kv_pages(self.pools.full.slots_to_pages(tail))
        for comp in self.tree.components:
            comp.release_request(req)
        if req.lock_receipt is not None:
            # After an insert the path was just touched, deepest last; touching the old
            # lock end again would make it look more recent than what was inserted.
            self.unlock(req.lock_receipt, touch=end == req.prefix_len)
        req.lock_receipt = None
        req.kv_slots = _EMPTY
        req.finished = True
        self.requests.pop(id(req), None)

    # -- stats, reset, invariants ----------------------------------------------------------

    def stats(self) -> CacheStats:
        """Evictable and protected device amounts per component, cached tokens, counters."""
        total = nodes = 0
        for node in self.tree.iter_nodes():
            nodes += 1
            if node.base.value is not None:
                total += node.num_tokens
        return CacheStats(
            dict(self.tree.evictable),
            dict(self.tree.protected),
            total,
            self.tree.host_only_tokens,
            nodes,
            dict(self.counters),
            self.quarantine.pages,
        )

    def reset(self) -> None:
        """Drop everything cached on the device (no request may be in flight)."""
        self.flush_backups()
        if self.requests:
            raise RuntimeError(f"reset with {len(self.requests)} requests still holding slots")
        pending = self.backups.pending if self.backups is not None else []
        if pending:
            raise RuntimeError(
                f"reset with {len(pending)} backups whose copies may still read the "
                "device pages (an unanswered sidecar); retry once they have settled"
            )
        for node in reversed(list(self.tree.iter_nodes())):
            for comp in self.tree.free_order:
                cd = node.data[comp.idx]
                if cd.value is not None:
                    assert cd.lock_ref == 0, f"reset: {node} is locked"
                    comp.free(node, self.tree.take_value(node, comp))
        self.tree.clear()

    def check_invariants(self) -> None:
        """Check every invariant of ARCHITECTURE §3; raises AssertionError naming the first
        broken one. Slot ownership: every allocated page of every pool is owned by exactly
        one of the tree, a request, the quarantine and the free list."""
        check_cache(self.tree, self.pools, self.requests.values(), self.quarantine)
        if self.backups is not None:
            self.backups.check_invariants()

    # -- tiers ---------------------------------------------------------------------------

    def evict(
        self,
        full_tokens: int = 0,
        swa_tokens: int = 0,
        mamba_states: int = 0,
        amounts: Mapping[ComponentType, int] | None = None,
    ) -> EvictResult:
        """Finish acknowledged backups (their locks go), then free at least the asked
        device amounts where possible (``amounts`` per component, plus the three named
        ones); returns what was freed (see TreeEviction.evict)."""
        self.poll_transfers()
        want = dict(amounts or {})
        for ctype, amount in EvictResult.named(full_tokens, swa_tokens, mamba_states).items():
            want[ctype] = want.get(ctype, 0) + amount
        return self.eviction.evict(want)

    def poll_transfers(self) -> None:
        """Finish the backups that are done (their locks go) and free the quarantined slots
        whose copies have settled. A backup whose handle is not done keeps its nodes
        locked, even past its deadline: its copy may still read them."""
        if self.backups is not None:
            self.backups.poll()
        self.quarantine.release_settled()

    def flush_backups(self, timeout_s: float | None = None) -> None:
        """Wait for every pending backup: for its outcome (up to ``timeout_s`` each, or its
        own deadline), then until it is done (all within ``timeout_s``, or
        ``load_timeout_s``, from the call). One still not done stays pending, its nodes
        locked: its copy may still read them."""
        if self.backups is not None:
            self.backups.flush(timeout_s)
        self.poll_transfers()

    def load_back(
        self, node: TreeNode, req: Request | None = None, mem_quota: int | None = None
    ) -> bool:
        """Bring the prefix ending at ``node`` from the host/disk tiers to the device.

        With ``req`` (right after its ``match_prefix``), the loaded tokens extend its prefix
        (slots, length, lock, Mamba state). ``mem_quota`` caps the FULL tokens it may take.
        On any failure: False, the pools and the request exactly as they were (recompute).
        """
        self.poll_transfers()
        if self.loader is None:
            return False
        return self.loader.load(node, req, mem_quota)

    def start_load_back(
        self, node: TreeNode, req: Request | None = None, groups: LayerGroups | None = None
    ) -> LayeredLoadBack | None:
        """:meth:`load_back` waited on layer by layer (LayeredLoadBack; ``groups``: one per
        layout layer). None, with nothing changed, when it fails before a copy starts."""
        self.poll_transfers()
        groups = groups or LayerGroups.of_layout(self.layout)
        return None if self.loader is None else self.loader.start_layered(node, req, None, groups)
