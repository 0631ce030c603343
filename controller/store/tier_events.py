"""What the store tells a listener about residency: a page became resident on a tier, left
it, or a whole tier was emptied.

The page index calls :meth:`TierEvents.stored` and :meth:`TierEvents.removed` where it
marks a tier present or absent (host: a page filled and ready, or its page freed; disk: a
value committed, or forgotten; remote: a value written, found or removed by this node),
and the admin ``clear`` calls :meth:`TierEvents.cleared`. The calls are made with the
store's lock held: a listener reads what it needs of the entries at once (their component,
page hash and parent hash may change later) and returns without blocking or taking a lock
that a store caller could hold. The KV event publisher
(:mod:`hicache.controller.sidecar.kv_events`) is the one listener.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from hicache.controller.store.page_entry import PageEntry
from hicache.types import Tier

__all__ = ["TierEvents"]


class TierEvents(Protocol):
    """A listener to page residency changes (see the module docstring)."""

    def stored(self, tier: Tier, entries: Sequence[PageEntry]) -> None:
        """``entries`` became resident on ``tier`` (ready to serve from it)."""

    def removed(self, tier: Tier, entries: Sequence[PageEntry]) -> None:
        """``entries`` are no longer resident on ``tier``."""

    def cleared(self, tiers: frozenset[Tier]) -> None:
        """An admin clear left every tier of ``tiers`` empty."""
