"""Staging pages: pages in the sidecar's layout that an engine and its sidecar both address.

An engine whose own KV memory the sidecar cannot map (vLLM's per-layer blocks, SGLang's
host pools on the copy path) registers a staging area instead: a store copies the
engine's pages into staging pages and asks the sidecar to back those up; a load asks the
sidecar to fill staging pages and copies them out. The pools live in named shared memory
on a CPU (CUDA memory the sidecar maps by IPC on a GPU).

Pages are handed out and taken back by number, per component (FULL and SWA pages, Mamba
state slots), under one lock held only for that, so threads that stage in different
directions (loads, stores) never wait on each other's transfers. A transfer given up on
(no reply by its deadline) may still run in the sidecar and touch its pages: freed with
its handle, they stay in the :class:`~hicache.quarantine.Quarantine` (the class the
engine-side cache uses for its own slots) until the handle is done, so a late copy never
mixes with a newer call's pages.
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import torch

from hicache.controller_api import TransferHandle
from hicache.layout import ModelLayout
from hicache.pools import DevicePools, PageAllocator
from hicache.quarantine import HeldSlots, Quarantine
from hicache.types import ComponentType, ConfigError


class StagingArea:
    """``pages`` pages of ``page_size`` slots in each KV pool of ``layout``, and ``pages``
    Mamba state slots where it has Mamba layers, on ``device``.

    ``pools`` is what the engine registers with the sidecar; ``counters`` holds
    ``quarantine_released`` (transfers given up on whose pages came back).
    """

    def __init__(
        self,
        layout: ModelLayout,
        page_size: int,
        pages: int,
        device: str | torch.device = "cpu",
    ) -> None:
        if pages < 1:
            raise ConfigError(f"a staging area needs at least one page, got {pages}")
        device = torch.device(device)
        self.layout = layout
        self.page_size = page_size
        self.pools = DevicePools.allocate_pages(
            layout, page_size, pages, device=str(device), shared_memory=device.type == "cpu"
        )
        self.counters: Counter[str] = Counter()
        self._quarantine = Quarantine(self.counters)
        self._lock = threading.Lock()  # held for alloc and free only, never for a copy

    def _pool(self, component: ComponentType) -> PageAllocator:
        """The pool that holds ``component``'s pages (Mamba: its state slots)."""
        pool = {
            ComponentType.FULL: self.pools.full,
            ComponentType.SWA: self.pools.swa,
            ComponentType.MAMBA: self.pools.mamba,
        }.get(component)
        if pool is None:
            raise ConfigError(f"the staging layout has no {component.name} pages")
        return pool

    def alloc(self, component: ComponentType, n: int) -> np.ndarray:
        """Up to ``n`` free pages of ``component``: fewer, possibly none, when the area is
        short (pages held for an unsettled transfer are not free). Pages of transfers
        that have ended come back first."""
        pool = self._pool(component)
        with self._lock:
            self._quarantine.release_settled()
            return pool.alloc_pages(max(0, min(n, pool.available_pages())))

    def free(
        self,
        component: ComponentType,
        pages: np.ndarray,
        unsettled: TransferHandle | None = None,
    ) -> None:
        """Give ``pages`` back; with ``unsettled`` (a transfer the sidecar may still be
        running on them) not done yet, they stay in the quarantine until it is."""
        pool = self._pool(component)
        with self._lock:
            if unsettled is not None and not unsettled.done():
                self._quarantine.hold(HeldSlots(unsettled, [(pool, pages)]))
            else:
                pool.free_pages(pages)

    def available(self, component: ComponentType) -> int:
        """Pages (Mamba: state slots) of ``component`` free now."""
        with self._lock:
            return self._pool(component).available_pages()

    @property
    def held_pages(self) -> int:
        """Pages held for transfers given up on that have not ended (as of the last
        allocation, which releases those that have)."""
        with self._lock:
            return self._quarantine.pages

    def check_invariants(self) -> None:
        """Every held page is handed out by its pool (so no allocation returns it) and held
        once; raises AssertionError naming the first broken one."""
        with self._lock:
            seen: set[tuple[int, int]] = set()
            for pool, pages in self._quarantine.owned():
                assert pool.is_allocated(pages), f"a held {pool.name} page is free"
                for page in pages.tolist():
                    assert (id(pool), page) not in seen, f"{pool.name} page {page} held twice"
                    seen.add((id(pool), page))

    def close(self) -> None:
        """Release the pools' shared memory (no page may be used afterwards)."""
        self.pools.close()
