"""A fourth component, defined only here: per-page "indexer" keys in a pool of their own.

DeepSeek-style sparse attention keeps, next to each token's KV, a small key its indexer
scores to pick the tokens attention reads. As a cached state it is one page of its own
pool per FULL page, needed on every page before a match end (like FULL), and droppable
from any unlocked node (like SWA, leaving a tombstone that a match cannot cross). Nothing
in the tree, the cache, the eviction or the tiering knows about it: it plugs in through
the component hooks, its pool through a DevicePools subclass, and the test doubles (the
marker engine, the fake controller) learn to write and copy its bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hicache import DevicePools, UnifiedRadixCache
from hicache.components.base import MatchCheck, PagedComponent
from hicache.controller_api import PageRef
from hicache.node import TreeNode
from hicache.pools import PageAllocator
from hicache.records import Request
from tests.support.cache import MarkerEngine, kv_marker, make_cache
from tests.support.fake_controller import FakeController


class IndexerType(enum.IntEnum):
    """The indexer's tag: a value no shipped ComponentType uses."""

    INDEXER = 7


INDEXER = IndexerType.INDEXER


class IndexerPools(DevicePools):
    """The shipped pools plus an indexer pool: every FULL page gets an indexer page with it
    (``full_to_indexer``), allocated and freed together, all or nothing."""

    indexer_slots: int | None = None  # set by make_indexer_cache before allocating

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        ps = self.config.page_size
        slots = self.indexer_slots or self.config.full_slots
        self.indexer = PageAllocator(slots // ps, ps, "indexer")
        self.indexer_keys = torch.zeros(self.indexer.capacity, dtype=torch.float32)
        self.full_to_indexer = np.full(self.full.num_pages, -1, dtype=np.int64)

    def alloc_kv_pages(self, n: int) -> np.ndarray:
        pages = super().alloc_kv_pages(n)
        try:
            self.full_to_indexer[pages] = self.indexer.alloc_pages(n)
        except Exception:
            super().free_kv_pages(pages)
            raise
        return pages

    def free_indexer_of(self, full_pages: np.ndarray) -> int:
        full_pages = np.asarray(full_pages, dtype=np.int64)
        mine = self.full_to_indexer[full_pages]
        mine = mine[mine >= 0]
        self.indexer.free_pages(mine)
        self.full_to_indexer[full_pages] = -1
        return int(mine.size) * self.indexer.page_size

    def free_kv_pages(self, full_pages: np.ndarray, distinct: bool = False) -> None:
        self.free_indexer_of(full_pages)
        super().free_kv_pages(full_pages, distinct)

    def indexer_slots_of(self, full_slots: np.ndarray) -> np.ndarray:
        ps = self.full.page_size
        pages = self.full_to_indexer[full_slots // ps]
        return np.where(pages >= 0, pages * ps + full_slots % ps, -1)

    def all(self) -> list[PageAllocator]:
        return [*super().all(), self.indexer]


class IndexerComponent(PagedComponent):
    """Value: the indexer page of each FULL page of the node; a node without it is a
    tombstone, which no match may end after."""

    ctype = INDEXER
    priority = 1

    def _full_pages(self, node: TreeNode) -> np.ndarray:
        return node.base.value[:: self.page_size] // self.page_size

    def pool(self) -> PageAllocator:
        return self.pools.indexer

    def free(self, node: TreeNode, value: np.ndarray) -> int:
        return self.pools.free_indexer_of(self._full_pages(node))

    def owned_pages(self, node: TreeNode, value: np.ndarray) -> np.ndarray:
        return value

    def detach(self, node: TreeNode, value: np.ndarray) -> list[tuple[Any, np.ndarray]]:
        self.pools.full_to_indexer[self._full_pages(node)] = -1
        return [(self.pools.indexer, value)]

    def match_check(self, path: Sequence[TreeNode]) -> MatchCheck:
        idx = self.idx
        intact = []
        ok = True
        for node in path:
            ok = ok and node.data[idx].value is not None
            intact.append(ok)
        return lambda i, end: intact[i]

    def lock(self, node: TreeNode) -> int:
        """Lock up to the root, stopping at a tombstone; returns that boundary."""
        while node.parent is not None:
            if node.data[self.idx].value is None:
                return node.end
            self.tree.inc_lock(node, self)
            node = node.parent
        return 0

    def unlock(self, node: TreeNode, boundary: int) -> None:
        while node.parent is not None and node.start >= boundary:
            self.tree.dec_lock(node, self)
            node = node.parent

    def backup_refs(self, node: TreeNode) -> list[PageRef]:
        value = node.data[self.idx].value
        return [] if value is None else self.page_refs(node, value.tolist())

    def install(self, node: TreeNode, pages: np.ndarray) -> None:
        self.pools.full_to_indexer[self._full_pages(node)] = pages
        self.tree.set_value(node, self, pages)

    # -- what requests hold -----------------------------------------------------------

    def fill_from_request(self, node: TreeNode, full_pages: np.ndarray, valid_from: Any) -> None:
        self.tree.set_value(node, self, self.pools.full_to_indexer[full_pages].copy())

    def adopt_from_request(self, node: TreeNode, own_pages: np.ndarray) -> None:
        if node.data[self.idx].value is not None:
            return
        mine = self.pools.full_to_indexer[own_pages]
        self.pools.full_to_indexer[own_pages] = -1
        self.pools.full_to_indexer[self._full_pages(node)] = mine
        self.tree.set_value(node, self, mine.copy())

    def request_owned(self, req: Request, own_pages: np.ndarray) -> np.ndarray:
        mine = self.pools.full_to_indexer[own_pages]
        assert (mine >= 0).all(), f"{req!r}: a page of its own has no indexer page"
        return mine

    def check_node(self, node: TreeNode) -> None:
        mapped = self.pools.full_to_indexer[self._full_pages(node)]
        value = node.data[self.idx].value
        expect = np.full(mapped.size, -1) if value is None else value
        assert np.array_equal(mapped, expect), f"{node}: indexer mapping differs"


def make_indexer_cache(
    mix: str, *args: Any, indexer_slots: int | None = None, **kwargs: Any
) -> UnifiedRadixCache:
    """As tests.support.cache.make_cache, with the indexer as a fourth component (its pool of
    ``indexer_slots`` tokens, default as many as the FULL pool)."""
    pools = type("SizedIndexerPools", (IndexerPools,), {"indexer_slots": indexer_slots})
    return make_cache(mix, *args, pools_class=pools, extra_components=(IndexerComponent,), **kwargs)


def indexer_marker(tokens: np.ndarray, start: int) -> torch.Tensor:
    """What the engine writes as the indexer key of ``tokens`` at positions ``start...``."""
    return kv_marker(tokens, start) + 0.25


class IndexerEngine(MarkerEngine):
    """The marker engine, also writing and checking indexer keys."""

    def verify_prefix(
        self, req: Request, tokens: np.ndarray, length: int, state: bool = True
    ) -> None:
        super().verify_prefix(req, tokens, length, state)
        slots = self.pools.indexer_slots_of(req.kv_slots[:length])
        assert (slots >= 0).all(), "the prefix has a token without an indexer key"
        got = self.pools.indexer_keys[torch.from_numpy(slots)]
        assert torch.equal(got, indexer_marker(tokens[:length], 0)), "indexer keys differ"

    def compute(self, req: Request, tokens: np.ndarray, upto: int) -> None:
        start = req.computed_len
        try:
            super().compute(req, tokens, upto)
        finally:  # what was computed has its keys, also when a checkpoint found no room
            end = req.computed_len
            slots = self.pools.indexer_slots_of(req.kv_slots[start:end])
            self.pools.indexer_keys[torch.from_numpy(slots)] = indexer_marker(
                tokens[start:end], start
            )


class IndexerController(FakeController):
    """The fake controller, also copying indexer pages."""

    def _read(self, ref: PageRef) -> tuple[torch.Tensor, ...]:
        if ref.component == INDEXER:
            return (self.pools.indexer_keys[self._slots(ref.device_index)].clone(),)
        return super()._read(ref)

    def _write(self, ref: PageRef, data: tuple[torch.Tensor, ...]) -> None:
        if ref.component == INDEXER:
            self.pools.indexer_keys[self._slots(ref.device_index)] = data[0]
        else:
            super()._write(ref, data)

    def _pool(self, component):
        return self.pools.indexer if component == INDEXER else super()._pool(component)
