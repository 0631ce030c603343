"""Why a lookup or a load-back fell short: the reasons, what the store remembers of pages
that left, and the counts per reason, tier and component.

Counted (``Counters`` key ``("miss_reasons", reason, tier, component)``, the metric
``hicache_miss_reasons_total``):

* a **lookup** that misses a page of a component counts one reason for that component:
  the reason of its first absent page (where the usable prefix stops). The lookups that
  hit every page add nothing but a ``P_ABSENT in row`` scan; the reason is read from what
  the store remembered when the page left (:class:`MissLog` — a bounded map of recent
  departures keyed by storage key), then from the remote tier's state (its breaker
  open), else the page was never stored here;
* a **load-back** that fails counts the reason of its failure, one per load: the pin
  expired, the reads outlasted the deadline, a value failed its checksum or was of
  another layout, a page was gone (the reason it left);
* an engine refused for its **layout** counts ``layout`` once (all its lookups miss).

A namespace mismatch cannot be told from page hashes alone (the namespace is hashed into
every page): ``hicachectl explain --tokens`` tells it, by looking for the prompt's first
page under the chain seeds the index holds (docs/metrics.md, "Miss reasons").
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from hicache.controller.store.counters import Counters, component_label
from hicache.keys import HASH_BYTES
from hicache.types import ComponentType, Tier

__all__ = [
    "NO_TIER",
    "ChainRoots",
    "Departure",
    "MissLog",
    "MissReason",
    "RecentLookup",
    "tier_label",
]

#: The ``tier`` label of a reason that no tier is to blame for (never stored).
NO_TIER = "none"
_ENGINES_KEPT = 32  # engines whose last lookups are kept (an engine's id per connection)
_PAGES_KEPT = 1024  # pages of one lookup kept for explain (a sidecar asks in such chunks)


class MissReason(enum.Enum):
    """Why a page was not there to serve (the ``reason`` label)."""

    NEVER_STORED = "never_stored"  # no tier of this node held it lately
    EVICTED = "evicted"  # a tier evicted it for room (the tier label says which)
    CLEARED = "cleared"  # an admin clear dropped it
    NAMESPACE = "namespace"  # the prompt is stored here under another namespace
    LAYOUT = "layout"  # stored under another layout, or the engine's layout was refused
    CHECKSUM = "checksum"  # its value failed the checksum or header checks: dropped
    DEADLINE = "deadline"  # the reads that bring it to host outlasted the load's deadline
    BREAKER_OPEN = "breaker_open"  # the remote tier's breaker was open: it was not asked
    WRITE_POLICY = "write_policy"  # a lower tier's write policy did not keep it
    WRITE_FAILED = "write_failed"  # its write to the disk tier was refused (full) or failed
    PIN_EXPIRED = "pin_expired"  # the load came after its pin had expired
    # A lower tier holds it, but loading it would be slower than recomputing it; counted
    # by the cost rule that decides so (``MissLog.count``).
    SLOWER_THAN_RECOMPUTE = "slower_than_recompute"


def tier_label(tier: Tier | None) -> str:
    return NO_TIER if tier is None else tier.name.lower()


class ChainRoots:
    """The parents of chain heads the page index saw lately (a namespace's seed, mostly:
    ``h_0``), latest last, at most ``limit``: where ``explain`` looks for a prompt stored
    under another namespace. The index notes one where a FULL page comes whose parent it
    does not hold."""

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self._roots: dict[bytes, None] = {}

    def note(self, parent_hash: bytes) -> None:
        self._roots.pop(parent_hash, None)
        self._roots[parent_hash] = None
        if len(self._roots) > self._limit:
            del self._roots[next(iter(self._roots))]

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._roots))


class Departure(NamedTuple):
    """Why a page left its last tier, which tier, and when (``time.monotonic``). A named
    tuple: one is made per page evicted, in a third of a frozen dataclass's time."""

    reason: MissReason
    tier: Tier | None
    at: float


@dataclass
class RecentLookup:
    """One lookup of an engine as it was answered (kept for ``explain --engine``): when,
    how many pages, the reason its first miss counted per component, the loads that
    failed after it, its first ``_PAGES_KEPT`` presence rows (the lookup's own lists,
    not copied) and, for a lookup that missed a page, those pages' hashes (joined: what
    ``explain`` asks about the absent pages)."""

    at: float
    pages: int
    reasons: dict[ComponentType, tuple[MissReason, Tier | None]]
    hashes: bytes
    rows: dict[ComponentType, list[int]]
    load_failures: list[tuple[MissReason, Tier | None]] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        page_hashes: Sequence[bytes],
        rows: dict[ComponentType, list[int]],
        reasons: dict[ComponentType, tuple[MissReason, Tier | None]],
    ) -> RecentLookup:
        """A lookup just answered, whose ``rows`` nothing changes after (kept as they are,
        cut to ``_PAGES_KEPT`` pages; the hashes copied only when it missed a page)."""
        n = len(page_hashes)
        if n > _PAGES_KEPT:
            rows = {c: row[:_PAGES_KEPT] for c, row in rows.items()}
        hashes = b"".join(page_hashes[:_PAGES_KEPT]) if reasons else b""
        return cls(time.monotonic(), n, reasons, hashes, rows)

    @property
    def page_hashes(self) -> list[bytes]:
        h = self.hashes
        return [h[i : i + HASH_BYTES] for i in range(0, len(h), HASH_BYTES)]


# ``Departure(...)`` without the Python-level ``__new__`` of a named tuple: once per page
# evicted from host.
_new_tuple = tuple.__new__


class MissLog:
    """Recent departures (bounded, oldest forgotten first), the counts of miss reasons,
    and each engine's last lookups. Called with the page store's lock held where it
    records a departure; :meth:`count` and :meth:`classify` need no lock."""

    def __init__(self, counters: Counters, remembered_pages: int, recent_lookups: int) -> None:
        self._counters = counters
        self._limit = remembered_pages
        self._departures: collections.OrderedDict[bytes, Departure] = collections.OrderedDict()
        self._recent_n = recent_lookups
        # Per engine (the last _ENGINES_KEPT engines that looked up), its last lookups.
        self._recent: collections.OrderedDict[str, collections.deque[RecentLookup]] = (
            collections.OrderedDict()
        )

    # -- departures ----------------------------------------------------------------------

    def departed(self, skey: bytes, reason: MissReason, tier: Tier | None) -> None:
        """The page of storage key ``skey`` left ``tier`` for ``reason``."""
        if self._limit <= 0:
            return
        d = self._departures
        d[skey] = _new_tuple(Departure, (reason, tier, time.monotonic()))  # Departure(…)
        d.move_to_end(skey)
        if len(d) > self._limit:
            d.popitem(last=False)

    def departure(self, skey: bytes) -> Departure | None:
        """What is remembered of the last departure of ``skey``, if anything."""
        return self._departures.get(skey)

    # -- counts --------------------------------------------------------------------------

    def count(
        self, reason: MissReason, tier: Tier | None, component: ComponentType, n: int = 1
    ) -> None:
        """Count ``n`` misses of ``component`` for ``reason`` at ``tier`` (the hook of
        every rule that turns a hit into a miss, ``slower_than_recompute`` included)."""
        key = ("miss_reasons", reason.value, tier_label(tier), component_label(component))
        self._counters.add(n, *key)

    # -- an engine's last lookups --------------------------------------------------------

    def remember(self, engine_id: str, lookup: RecentLookup) -> None:
        """Keep ``lookup`` among ``engine_id``'s last ``recent_lookups``."""
        if self._recent_n <= 0:
            return
        ring = self._recent.get(engine_id)
        if ring is None:
            ring = self._recent[engine_id] = collections.deque(maxlen=self._recent_n)
            if len(self._recent) > _ENGINES_KEPT:
                self._recent.popitem(last=False)
        ring.append(lookup)

    def load_failed(self, engine_id: str, reason: MissReason, tier: Tier | None) -> None:
        """Note a failed load of ``engine_id`` on its last lookup (for ``explain``)."""
        ring = self._recent.get(engine_id)
        if ring:
            ring[-1].load_failures.append((reason, tier))

    def recent(self, engine_id: str, n: int) -> list[RecentLookup]:
        """``engine_id``'s last ``n`` lookups, oldest first."""
        ring = self._recent.get(engine_id)
        return list(ring)[-n:] if ring and n > 0 else []
