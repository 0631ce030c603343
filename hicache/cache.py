"""UnifiedRadixCache: the engine-facing cache over the tree, the device pools and a controller.

"The tree decides, the cache executes": :class:`~hicache.tree.RadixTree` keeps structure,
locks and eviction order; this class turns engine calls (match, insert, requests) into tree
operations, owns the requests' slots, and drives the controller (backups and load-backs,
see :mod:`hicache.tiering`).
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import torch

from hicache.components.base import TreeComponent
from hicache.components.full import FullComponent
from hicache.components.mamba import MambaComponent
from hicache.components.swa import SWAComponent
from hicache.config import CacheConfig, EvictionPolicyKind
from hicache.controller_api import CacheController
from hicache.eviction import LeafEvictionPolicy, LRULeafPolicy
from hicache.keys import TokenInput, token_array
from hicache.layout import ModelLayout
from hicache.pools import DevicePools
from hicache.request import CacheStats, EvictResult, MatchResult, Request
from hicache.tiering import TieringMixin
from hicache.tree import RadixTree, TreeNode
from hicache.types import ComponentType, PoolExhaustedError

log = logging.getLogger("hicache.cache")

COMPONENT_CLASSES: dict[ComponentType, type[TreeComponent]] = {
    ComponentType.FULL: FullComponent,
    ComponentType.SWA: SWAComponent,
    ComponentType.MAMBA: MambaComponent,
}

_EMPTY = np.zeros(0, dtype=np.int64)


def make_leaf_policy(config: CacheConfig) -> LeafEvictionPolicy:
    """The device-tier leaf eviction policy named in ``config``."""
    if config.eviction_policy is EvictionPolicyKind.LRU:
        return LRULeafPolicy()
    from hicache.learned_eviction import LearnedLeafPolicy

    return LearnedLeafPolicy(sample_size=config.eviction_sample_size, seed=config.seed)


class UnifiedRadixCache(TieringMixin, RadixTree):
    """One radix tree caching FULL KV, SWA KV and Mamba state of prefixes (ARCHITECTURE §4)."""

    def __init__(
        self,
        layout: ModelLayout,
        config: CacheConfig,
        pools: DevicePools,
        controller: CacheController | None = None,
        leaf_policy: LeafEvictionPolicy | None = None,
    ) -> None:
        config.validate(layout)
        RadixTree.__init__(
            self,
            [COMPONENT_CLASSES[c] for c in layout.components],
            config,
            pools,
            layout.fingerprint(config.page_size),
            leaf_policy or make_leaf_policy(config),
        )
        self.layout = layout
        self.mamba = self.by_type.get(ComponentType.MAMBA)
        self.requests: dict[int, Request] = {}
        self.counters: Counter[str] = Counter()
        self._null_root = TreeNode(None, b"", 0, 0)
        TieringMixin.__init__(self, controller)

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
        arr = token_array(tokens)
        n = arr.size - arr.size % self.page_size
        key = arr[:n].tobytes()
        # With a controller, a namespace this tree has not seen may still hit beyond it.
        root = self.namespace_root(extra_key, create=self.controller is not None and n > 0)
        self.counters["match_calls"] += 1
        if root is None or n == 0:
            result = MatchResult(_EMPTY, 0, root or self._null_root)
        else:
            path, partial, k = self.walk(root, key)
            last_node, prefix_nodes = self._device_match(root, path, partial, k)
            slots = self._concat_slots(prefix_nodes)
            if len(prefix_nodes) == 1:
                slots = slots.copy()  # never hand out a node's own array
            result = MatchResult(slots, last_node.end, last_node)
            if prefix_nodes:
                self.touch(prefix_nodes)
                self.on_prefix_hit(prefix_nodes)
            if self.controller is not None and last_node.end < n:
                self.match_beyond_device(root, key, result, path, partial, k)
            if not root.children:
                self.roots.pop(extra_key, None)
        self.counters["device_hit_tokens"] += result.prefix_len
        if result.host_hit_len or result.disk_hit_len or result.remote_hit_len:
            self.counters["host_hit_tokens"] += result.host_hit_len
            self.counters["disk_hit_tokens"] += result.disk_hit_len
            self.counters["remote_hit_tokens"] += result.remote_hit_len
        if req is not None:
            self._attach(req, result, arr)
        return result

    def _device_match(
        self, root: TreeNode, path: list[TreeNode], partial: TreeNode | None, k: int
    ) -> tuple[TreeNode, list[TreeNode]]:
        """The deepest end on the device every component accepts: (last node, its path)."""
        dev = 0
        while dev < len(path) and path[dev].data[0].value is not None:
            dev += 1
        cand = path[:dev] if dev < len(path) else path
        partial_end = None
        if partial is not None and dev == len(path) and partial.data[0].value is not None:
            cand = [*cand, partial]
            partial_end = partial.start + k
        if len(self.components) == 1:  # FULL alone accepts every position on the device
            if partial_end is not None:
                cand[-1] = self.split(partial, k)
            return (cand[-1], cand) if cand else (root, cand)
        checks = [f for f in (c.match_check(cand) for c in self.components) if f is not None]
        for i in range(len(cand) - 1, -1, -1):
            end = partial_end if (partial_end is not None and i == len(cand) - 1) else cand[i].end
            if all(check(i, end) for check in checks):
                if end < cand[i].end:
                    cand[i] = self.split(cand[i], end - cand[i].start)
                return cand[i], cand[: i + 1]
        return root, []

    @staticmethod
    def _concat_slots(nodes: list[TreeNode]) -> np.ndarray:
        if not nodes:
            return _EMPTY
        if len(nodes) == 1:
            return nodes[0].data[0].value
        return np.concatenate([n.data[0].value for n in nodes])

    def _attach(self, req: Request, result: MatchResult, tokens: np.ndarray) -> None:
        """Give ``req`` the matched device prefix: lock, slots and its own Mamba state."""
        if req.kv_slots.size or req.lock_receipt is not None:
            raise ValueError(f"{req!r} already holds slots; match_prefix needs a fresh request")
        receipt = self.lock(result.last_node)
        if self.mamba is not None:
            try:
                slot = self.alloc_mamba_state()
            except PoolExhaustedError:
                self.unlock(receipt, touch=False)
                raise
            src = self.mamba.state_of(result.last_node) if result.prefix_len else None
            if src is None:
                self.pools.mamba.conv[:, slot].zero_()
                self.pools.mamba.ssm[:, slot].zero_()
            else:
                self.pools.mamba.copy_state(src, slot)
            req.mamba_slot = slot
            result.mamba_slot = slot
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
        self.poll_transfers()
        arr = token_array(tokens)
        slots = np.asarray(
            kv_indices.numpy() if isinstance(kv_indices, torch.Tensor) else kv_indices,
            dtype=np.int64,
        )
        n = arr.size
        if n % self.page_size or slots.size != n:
            raise ValueError(
                f"insert needs whole pages and one slot per token: {n} tokens, {slots.size} "
                f"slots, page_size {self.page_size}"
            )
        if n and not self.pools.full.check_whole_pages(slots[prev_prefix_len:]):
            raise ValueError("insert: kv_indices beyond prev_prefix_len are not whole pages")
        root = self.namespace_root(extra_key, create=n > 0)
        if n == 0:
            if mamba_slot is not None:
                self.pools.mamba.free_state(mamba_slot)
            return 0
        key = arr.tobytes()
        swa_from = self._swa_valid_from(slots, prev_prefix_len, n)
        node, pos, cached, touched = root, 0, 0, []
        while pos < n:
            child = node.children.get(key[pos * 8 : pos * 8 + self.page_bytes])
            if child is None:
                break
            m = min(child.num_tokens, self._common_tokens(child.key, key, pos * 8))
            if m < child.num_tokens:
                child = self.split(child, m)
            if child.start < swa_from < child.end and self._lacks_swa(child):
                # Cut where the request's SWA pages begin: the part after it can be filled
                # (host-only) or can adopt them (an SWA tombstone on the device).
                child = self.split(child, swa_from - child.start)
                m = child.num_tokens
            if child.data[0].value is not None:
                dup = slots[max(pos, prev_prefix_len) : pos + m]
                if dup.size:
                    dup_pages = dup[:: self.page_size] // self.page_size
                    if pos >= prev_prefix_len:
                        self._adopt_swa(child, dup_pages)
                    self.pools.free_kv_pages(dup_pages)
                cached = pos + m
            else:
                self._fill_node(child, slots[pos : pos + m], swa_from)
            touched.append(child)
            node, pos = child, pos + m
        while pos < n:
            end = swa_from if pos < swa_from < n else n
            end = self.leaf_policy.insert_end(key, pos, end)
            child = self.add_child(node, key[pos * 8 : end * 8])
            self._fill_node(child, slots[pos:end], swa_from)
            touched.append(child)
            node, pos = child, end
        if mamba_slot is not None:
            if self.mamba.state_of(node) is None:
                self.set_value(node, self.mamba, mamba_slot)
            else:
                self.pools.mamba.free_state(mamba_slot)
        self.touch(touched)
        self.after_insert(touched)
        return cached

    def _swa_valid_from(self, slots: np.ndarray, prev_prefix_len: int, n: int) -> int:
        """Token position from which the inserted tokens have SWA pages (n when none do).

        The request's own pages may have lost their SWA pages from the front (they fell
        out of the window); a gap anywhere else is an error of the caller.
        """
        if self.pools.swa is None:
            return n
        own = slots[prev_prefix_len : n : self.page_size] // self.page_size
        has = self.pools.full_to_swa[own] >= 0
        first = int(np.argmax(has)) if has.any() else has.size
        if not has[first:].all():
            raise ValueError("insert: SWA pages are missing after the window start")
        return prev_prefix_len + first * self.page_size

    def _lacks_swa(self, node: TreeNode) -> bool:
        swa = self.by_type.get(ComponentType.SWA)
        return node.data[0].value is None or (swa is not None and node.data[swa.idx].value is None)

    def _adopt_swa(self, node: TreeNode, own_pages: np.ndarray) -> None:
        """``node`` lost its SWA pages, and the request inserting the same tokens holds
        its own (``own_pages`` are its FULL pages there): the node takes them, so the
        request, which goes on with the node's slots, keeps the SWA KV of its window."""
        swa = self.by_type.get(ComponentType.SWA)
        if swa is None or node.data[swa.idx].value is not None:
            return
        swa_pages = self.pools.full_to_swa[own_pages]
        if (swa_pages < 0).any():
            return
        self.pools.full_to_swa[own_pages] = -1
        self.pools.full_to_swa[self.full.pages(node.data[0].value)] = swa_pages
        self.set_value(node, swa, swa_pages.copy())

    def _fill_node(self, node: TreeNode, slots: np.ndarray, swa_from: int) -> None:
        """Install request-owned ``slots`` as ``node``'s FULL (and SWA, when it has them)."""
        self.set_value(node, self.full, slots.copy())
        swa = self.by_type.get(ComponentType.SWA)
        if swa is not None and node.start >= swa_from:
            pages = slots[:: self.page_size] // self.page_size
            self.set_value(node, swa, self.pools.full_to_swa[pages].copy())

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
        self.make_room(full_pages=n, swa_pages=n if self.pools.swa is not None else 0)
        return self.pools.alloc_kv_pages(n)

    def make_room(self, full_pages: int = 0, swa_pages: int = 0, mamba_states: int = 0) -> None:
        """Evict until the pools have the asked free amounts, if the tree can give them."""
        ps = self.page_size
        short_full = full_pages * ps - self.pools.full.available()
        short_swa = swa_pages * ps - self.pools.swa.available() if self.pools.swa else 0
        short_mamba = mamba_states - self.pools.mamba.available() if self.pools.mamba else 0
        if short_full > 0 or short_swa > 0 or short_mamba > 0:
            self.evict(max(short_full, 0), max(short_swa, 0), max(short_mamba, 0))

    def alloc_mamba_state(self) -> int:
        """A free Mamba state slot, evicting a cached state if none is free."""
        self.make_room(mamba_states=1)
        return self.pools.mamba.alloc_state()

    def checkpoint_mamba(self, req: Request) -> None:
        """Copy ``req``'s working state aside, valid at its computed length (which must be
        page aligned), so that caching can later use the state at that page boundary."""
        if self.mamba is None:
            return
        if req.computed_len % self.page_size:
            raise ValueError(f"checkpoint_mamba at {req.computed_len}: not a page boundary")
        if req.mamba_ckpt_slot is None:
            req.mamba_ckpt_slot = self.alloc_mamba_state()
        self.pools.mamba.copy_state(req.mamba_slot, req.mamba_ckpt_slot)
        req.mamba_ckpt_len = req.computed_len

    def release_swa_outside_window(self, req: Request) -> int:
        """Free the SWA pages of ``req``'s own pages that lie wholly before its window;
        returns the SWA slots freed."""
        if self.pools.swa is None:
            return 0
        ps = self.page_size
        limit = max(0, req.computed_len - self.config.sliding_window)
        limit -= limit % ps
        start = max(req.prefix_len, req.swa_released_upto)
        if limit <= start:
            return 0
        freed = self.pools.free_swa_of(req.kv_slots[start:limit:ps] // ps)
        req.swa_released_upto = limit
        return freed

    def _state_for_insert(
        self, req: Request, aligned: int, finishing: bool
    ) -> tuple[int, int | None]:
        """How far ``req`` can be cached and the Mamba state slot to hand over there.

        Without Mamba layers: every aligned token. With them, only up to a page boundary
        where a state exists: the working state (when computed exactly there), else the
        checkpoint."""
        if self.mamba is None:
            return aligned, None
        if req.computed_len == aligned and aligned > req.prefix_len:
            if finishing:
                slot, req.mamba_slot = req.mamba_slot, None
            else:
                slot = self.alloc_mamba_state()
                self.pools.mamba.copy_state(req.mamba_slot, slot)
            return aligned, slot
        if req.mamba_ckpt_slot is not None and req.prefix_len < req.mamba_ckpt_len <= aligned:
            slot, req.mamba_ckpt_slot = req.mamba_ckpt_slot, None
            return req.mamba_ckpt_len, slot
        return req.prefix_len, None

    def _insert_request(self, req: Request, finishing: bool) -> int:
        """Cache what ``req`` computed; returns the new cached length (its new prefix)."""
        aligned = req.computed_len - req.computed_len % self.page_size
        end, state = self._state_for_insert(req, aligned, finishing)
        if end <= req.prefix_len:
            return req.prefix_len
        self.insert(req.token_ids[:end], req.kv_slots[:end], state, req.extra_key, req.prefix_len)
        return end

    def cache_unfinished_req(self, req: Request) -> None:
        """Cache what ``req`` has computed so far (whole pages) and move its lock there;
        ``req.kv_slots`` then points at the tree's slots for that prefix."""
        end = self._insert_request(req, finishing=False)
        if end == req.prefix_len:
            return
        root = self.namespace_root(req.extra_key)
        path, partial, _ = self.walk(root, req.token_ids[:end].tobytes())
        assert partial is None and path and path[-1].end == end, "inserted prefix not found"
        old = req.lock_receipt
        req.kv_slots = np.concatenate([self._concat_slots(path), req.kv_slots[end:]])
        req.lock_receipt = self.lock(path[-1])
        req.last_node = path[-1]
        req.prefix_len = end
        req.swa_released_upto = max(req.swa_released_upto, end)
        if old is not None:
            self.unlock(old, touch=False)

    def _return_state(self, req: Request) -> None:
        """A request that computed nothing past its prefix holds that prefix's state: give
        it to the prefix's end node when the node has none (e.g. after a load-back, whose
        state went to the request)."""
        node = req.last_node
        if (
            self.mamba is None
            or req.mamba_slot is None
            or node is None
            or node.parent is None
            or self.mamba.state_of(node) is not None
        ):
            return
        self.set_value(node, self.mamba, req.mamba_slot)
        req.mamba_slot = None
        self.after_insert([node])

    def cache_finished_req(self, req: Request, insert: bool = True) -> None:
        """Cache what ``req`` computed (when ``insert``), free everything else it holds
        (unaligned tail, working and checkpoint states) and release its lock."""
        if req.finished:
            raise ValueError(f"{req!r} finished twice")
        end = self._insert_request(req, finishing=True) if insert else req.prefix_len
        if insert and end == req.computed_len == req.prefix_len:
            self._return_state(req)
        tail = req.kv_slots[end:]
        if tail.size:
            self.pools.free_kv_pages(self.pools.full.slots_to_pages(tail))
        for attr in ("mamba_slot", "mamba_ckpt_slot"):
            slot = getattr(req, attr)
            if slot is not None:
                self.pools.mamba.free_state(slot)
                setattr(req, attr, None)
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
        for node in self.iter_nodes():
            nodes += 1
            if node.data[0].value is not None:
                total += node.num_tokens
        return CacheStats(
            dict(self.evictable),
            dict(self.protected),
            total,
            self.host_only_tokens,
            nodes,
            dict(self.counters),
            sum(pages.size for q in self._quarantine for _, pages in q.slots),
        )

    def reset(self) -> None:
        """Drop everything cached on the device (no request may be in flight)."""
        self.flush_backups()
        if self.requests:
            raise RuntimeError(f"reset with {len(self.requests)} requests still holding slots")
        if self._pending:
            raise RuntimeError(
                f"reset with {len(self._pending)} backups whose copies may still read the "
                "device pages (an unanswered sidecar); retry once they have settled"
            )
        result = EvictResult()
        for node in reversed(list(self.iter_nodes())):
            for comp in self.free_order:
                cd = node.data[comp.idx]
                if cd.value is not None:
                    assert cd.lock_ref == 0, f"reset: {node} is locked"
                    result.add(comp.ctype, comp.free(node, self.take_value(node, comp)))
        self.clear()

    def check_invariants(self) -> None:
        """Check every invariant of ARCHITECTURE §3; raises AssertionError naming the first
        broken one. Slot ownership: every allocated page of every pool is owned by exactly
        one of the tree, a request, and the free list."""
        from hicache.invariants import check_cache

        check_cache(self)
