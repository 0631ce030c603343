"""The quarantine: slots that a copy its caller stopped waiting for may still touch.

The one class for every pool a sidecar copies into or out of. In the engine-side cache, a
load-back whose copy the controller gave up on (a sidecar that did not answer in time)
may still write into the slots it was given, and a write-back whose copy is not done when
its node is evicted may still read the node's pages; in a staging area
(:mod:`hicache.controller.client.staging`), a store's or load's pages may still be read or
written by a transfer given up on. Such slots belong to neither the free list nor any
user until the copy's handle is done; ``release_settled`` (called by every eviction and
load-back, and by every staging allocation) then frees them. The quarantine takes no
lock: its owner calls it under the lock that guards its pools.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.types import ComponentType


@dataclass
class HeldSlots:
    """Slots kept out of their pools until ``pending`` (a transfer handle) is done.

    ``slots`` are (allocator, pages) pairs. For a node being evicted, ``components`` names
    the components whose values the eviction detaches into ``slots`` instead of freeing.
    """

    pending: Any
    slots: list[tuple[Any, np.ndarray]] = field(default_factory=list)
    components: frozenset[ComponentType] = frozenset()


class Quarantine:
    """The held slots of every unsettled copy, and the counter of those released."""

    def __init__(self, counters: Counter[str]) -> None:
        self._held: list[HeldSlots] = []
        self._counters = counters

    def hold(self, held: HeldSlots) -> None:
        """Keep ``held.slots`` (filled now or by the caller right after) until settled."""
        self._held.append(held)

    def release_settled(self) -> None:
        """Free the slots of every copy that is done."""
        if not self._held:
            return
        still = []
        for held in self._held:
            if held.pending.done():
                for allocator, pages in held.slots:
                    allocator.free_pages(pages)
                self._counters["quarantine_released"] += 1
            else:
                still.append(held)
        self._held = still

    def owned(self) -> Iterator[tuple[Any, np.ndarray]]:
        """Every (allocator, pages) held, for the slot-ownership invariant."""
        for held in self._held:
            yield from held.slots

    @property
    def pages(self) -> int:
        """Pages (states for MAMBA) held, over every pool."""
        return sum(pages.size for _, pages in self.owned())
