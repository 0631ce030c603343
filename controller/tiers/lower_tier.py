"""The one interface between the page store and the tiers behind its host pool.

:class:`LowerTier` is what the store asks of a tier below host: the LMDB tier
(:class:`hicache.controller.tiers.disk_tier.DiskTier`) and the remote tier
(:class:`hicache.controller.tiers.remote_tier.RemoteTier`) implement it, and the store
holds them as a list of it. :class:`TierHost` is the other direction: the operations of
the page store that a lower tier may use (the store implements it). The page index stays
the store's: a tier changes it only through these operations.

The store tells every tier what happens on host (a page arrived, is leaving, served a
load) and asks them for pages the host lacks. One tier is *indexed*: the index records
what the LMDB tier holds (a page's disk state), so its pages are found by a lookup and
filled on request; the remote tier is not a source of truth, and adds what it holds to a
lookup itself (``probe``) and offers pages the index does not know (``offers``).

Methods whose name ends in ``_locked`` are called with the store's lock held and must not
block; the others are called without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from hicache.types import ComponentType, Tier

if TYPE_CHECKING:
    from concurrent.futures import Future

    import numpy as np

    from hicache.controller.store.cost_rule import ReadCost
    from hicache.controller.store.counters import Failure
    from hicache.controller.store.faults import FaultPlan
    from hicache.controller.store.page_codec import ReadStatus
    from hicache.controller.store.page_entry import PageEntry
    from hicache.controller.tiers.lmdb_tier import DiskRecord
    from hicache.controller_api import PageKey

__all__ = [
    "DirectSink",
    "FillResult",
    "FillsHostOnly",
    "FsckResult",
    "LowerTier",
    "TierHost",
    "flush_deletes",
]

log = logging.getLogger(__name__)

REPAIR_WAIT_S = 30.0  # how long an admin command waits for its deletes to be committed


@dataclass
class FillResult:
    """How a read into a host page ended: the page's ``status`` and, for a page filled
    before its chain parent was known (``TierHost.begin_fill_locked`` without one), the
    parent read from the value."""

    page: PageEntry
    status: ReadStatus
    parent: bytes | None = None


@dataclass
class FsckResult:
    """What an fsck of a tier found: values ``checked``, ``ok``, ``corrupt``, ``foreign``
    (another layout's: never served, not corrupt), ``repaired`` (corrupt ones deleted)."""

    checked: int = 0
    ok: int = 0
    corrupt: int = 0
    foreign: int = 0
    repaired: int = 0
    # Sound values whose layout digest was not compared: no layout was known (no engine
    # had registered and the sidecar's config names none). ``ok`` counts them too.
    layout_unchecked: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class LowerTier(Protocol):
    """A tier behind the host pool, as the page store uses it (see the module docstring)."""

    #: DISK for the LMDB tier, REMOTE for the remote tier: the source of its fills.
    tier: Tier

    def probe(self, page_hashes: Sequence[bytes], rows: dict[ComponentType, list[int]]) -> None:
        """Mark in ``rows`` (one presence per page, per component) the pages that the
        index lacks and this tier holds."""

    def offers(self, key: PageKey) -> bool:
        """Whether this tier can fill ``key``, which the index does not hold (lock held)."""

    def refusing(self) -> bool:
        """Whether this tier answers no lookup now without being asked (the remote
        tier's breaker is open): the reason a page it might hold is missed."""

    def holds_foreign(self, first_hash: Callable[[bytes], bytes]) -> bool:
        """Whether this tier holds, as a value of another layout, the first page of a
        chain whose hash under a chain seed ``r`` is ``first_hash(r)`` (lock held)."""

    def fill_locked(
        self, keys: Sequence[PageKey], then: Callable[[list[PageEntry]], None] | None = None
    ) -> bool:
        """Start reading ``keys`` into host pages (:meth:`TierHost.begin_fill_locked`):
        pages it offers, or, for the indexed tier, pages the index has only there. False
        when one could not be started (the reads already started go on). ``then(pages)``,
        where the tier supports it, is called on the reading thread with the pages of each
        read that passed every check, before they are settled (their host pages held by
        the read, their bytes final): a load copies them on from there."""

    def read_direct_locked(
        self, pages: Sequence[PageEntry], sink: DirectSink, serial: bool = False
    ) -> list[Future]:
        """Start reading ``pages`` (held by the load, on this tier only) straight into
        where ``sink`` puts them, no host page between; the futures of the reads, each
        True when all its pages were served (``serial``: on one thread, whatever their
        size). Only the indexed tier is asked; the others read into host pages only
        (:class:`FillsHostOnly`)."""

    def read_cost(self) -> ReadCost | None:
        """What reading from this tier costs, as measured on its reads (None: not known;
        the cost rule then offers its pages as they are)."""

    def on_host_ready_locked(self, page: PageEntry, source: Tier) -> None:
        """``page`` is ready on host, from ``source`` (DEVICE: a backup; a lower tier: a
        fill from it)."""

    def on_host_evict_locked(self, page: PageEntry) -> None:
        """``page`` is about to leave the host tier (its bytes are still there)."""

    def on_served_locked(self, pages: Sequence[PageEntry]) -> None:
        """``pages`` served a load-back from the host tier (or straight from this one)."""

    def engine_reads(self) -> dict[str, Any] | None:
        """Where an engine on this host may read this tier's pages itself (docs/protocol.md,
        "Disk pages the engine reads itself"); None: it may not."""

    def read_by_engine_locked(self, pages: Sequence[PageEntry], nbytes: int, s: float) -> None:
        """An engine read ``pages`` (``nbytes`` of payload, in ``s`` seconds) of this tier
        into its slots itself: count the transfer and its cost."""

    def clear_stale_readers(self) -> None:
        """Free what readers of a process gone hold (an engine that read pages itself)."""

    def on_close_locked(self) -> None:
        """The store is closing: queue what must not be lost (LMDB write-back)."""

    def delete_locked(self, skeys: Sequence[bytes]) -> None:
        """Drop these stored pages: the index has forgotten them (the indexed tier). Queued
        under the lock, so that a page stored again later is written after the delete."""

    def flush(self, timeout_s: float | None) -> bool:
        """Wait until what is queued is stored (or dropped); False when ``timeout_s`` ran out."""

    def stats(self) -> dict[str, Any]:
        """The tier's state, JSON/msgpack-safe."""

    def health(self, timeout_s: float) -> dict[str, Any]:
        """:meth:`stats` and whether the tier works: its threads, its remote nodes."""

    def fsck(self, repair: bool, progress: Callable[[int, int], None] | None) -> FsckResult:
        """Check every value the tier stores; with ``repair``, forget and delete the
        corrupt ones (:meth:`TierHost.forget_stored`). ``progress(done, total)`` is
        called as it goes."""

    def check_invariants(self, ready: set[bytes], queued: set[bytes]) -> None:
        """Compare what the tier stores with what the index says it holds committed
        (``ready``) and queued; AssertionError on a mismatch (flushed, nothing running)."""

    def close(self, timeout_s: float) -> bool:
        """Store what is queued (within ``timeout_s``), stop, release; True when drained."""


class DirectSink(Protocol):
    """Where a load's pages read straight from a tier go (an engine's slots in memory the
    controller can write), and its end: no read starts once it is ``closed``."""

    closed: bool

    def takes(self, page: PageEntry) -> bool:
        """Whether ``page`` (on the indexed tier only) may be read straight into the load's
        slot rather than into a host page first (the store's lock held)."""

    def pieces(self, pages: list[PageEntry]) -> list[tuple] | None:
        """On a reader thread, before reading ``pages``: where each page's payload goes,
        ``(runs, slot)`` as ``page_codec.verify_runs`` takes them; None when closed
        (nothing is read). Every call
        that returns pieces is followed by :meth:`ended`."""

    def ended(self, pages: list[PageEntry], statuses: list[ReadStatus]) -> None:
        """The reads of ``pages`` have ended, as ``statuses`` tell: nothing more is written."""


class FillsHostOnly:
    """:meth:`LowerTier.read_direct_locked` and the engines' own reads of a tier that is
    never asked them."""

    def read_direct_locked(
        self, pages: Sequence[PageEntry], sink: DirectSink, serial: bool = False
    ) -> list[Future]:
        raise NotImplementedError("only the indexed tier reads pages straight into a load")

    def engine_reads(self) -> dict[str, Any] | None:
        return None  # engines read only the indexed tier's pages themselves

    def read_by_engine_locked(self, pages: Sequence[PageEntry], nbytes: int, s: float) -> None:
        raise NotImplementedError("engines read only the indexed tier's pages themselves")

    def clear_stale_readers(self) -> None:
        pass  # no engine reads this tier


class TierHost(Protocol):
    """What a lower tier may ask of the page store (which implements it)."""

    @property
    def faults(self) -> FaultPlan | None:
        """Armed failures for tests (None in production)."""

    def fault(self, what: str) -> bool:
        """Whether a ``what`` failure is armed (and now taken)."""

    def holds_locked(self, key: PageKey) -> bool:
        """Whether a tier of the index (host, or the indexed lower tier) holds ``key``."""

    def begin_fill_locked(self, key: PageKey, parent_hash: bytes | None) -> PageEntry | None:
        """Reserve a host page for ``key`` and mark it filling (held until
        :meth:`finish_fills`); the page is indexed first if it is not (under
        ``parent_hash``, or provisionally when None). None when no host page is free."""

    def prewarm_fill(self, keys: Sequence[PageKey]) -> tuple[list[Future], int, int, bool]:
        """Start reading those of ``keys`` held only by the indexed tier into free host
        pages, evicting nothing: the reads' futures, the pages and bytes started, and False
        once the host tier had no free page left for one."""

    def fill_started_locked(self, pages: Sequence[PageEntry], fill: Future) -> None:
        """``fill`` resolves when the reads into ``pages`` end (True: all filled)."""

    def host_row(self, page: PageEntry) -> np.ndarray:
        """The host page that ``page`` is filling, or holds (its bytes, uint8)."""

    def finish_fills(self, results: Sequence[FillResult], source: Tier) -> int:
        """Settle reads from ``source``: a page read well is ready on host, another gives
        its host page back (and, read from the indexed tier, loses a copy found invalid
        there). Returns the bytes filled."""

    def finish_direct_reads(self, results: Sequence[FillResult]) -> None:
        """Settle reads from the indexed tier that went straight into a load (no host
        page): a page whose value failed its checks or was gone loses its copy there."""

    def tier_changed(self, tier: Tier, pages: Sequence[PageEntry], removed: bool) -> None:
        """Tell the store's listener that ``pages`` were stored on (or ``removed`` from)
        ``tier``, a tier that the index does not record."""

    def copy_host_pages(
        self, pages: Sequence[PageEntry], copy: Callable[[PageEntry, np.ndarray], Any]
    ) -> list[Any]:
        """``copy(page, host_row)`` for each page still ready on host (under the lock),
        None for the others."""

    def begin_write_locked(self, page: PageEntry, keep_copy: bool) -> Any:
        """Mark ``page`` queued to the indexed tier and hold it until :meth:`finish_writes`;
        its frame (room for the header, then the payload): the host page's own, or with
        ``keep_copy`` a copy that also serves reads until the write commits. None when the
        page is stored or queued already."""

    def finish_writes(self, results: Sequence[tuple[PageEntry, int | Failure]]) -> None:
        """Settle writes: ``(page, bytes stored)``, or ``(page, why it was not stored)``."""

    def unwritten_host_pages_locked(self) -> list[PageEntry]:
        """Pages ready on host that the indexed tier neither stores nor has queued."""

    def restore_stored(self, records: Iterable[DiskRecord]) -> None:
        """Index the pages the indexed tier found at start (oldest first)."""

    def stored_bytes(self) -> int:
        """Bytes the index says the indexed tier holds committed."""

    def evict_stored(self, nbytes: int) -> list[bytes]:
        """Forget at least ``nbytes`` of least-recently-used pages of the indexed tier (the
        prefix order kept); the keys to delete."""

    def forget_stored(
        self, skeys: Sequence[bytes], still_bad: Callable[[list[bytes]], list[bytes]]
    ) -> list[bytes]:
        """Forget the indexed tier's copies of ``skeys`` that ``still_bad`` confirms (asked
        under the lock) and no operation holds, and delete them; the keys deleted."""


def flush_deletes(tier: LowerTier, count: int) -> bool:
    """Wait until ``tier`` has committed the ``count`` deletes just queued, so that what an
    admin command reports gone is gone (a check or a crash right after it does not find
    it again). False when it did not get to them within ``REPAIR_WAIT_S``; they stay
    queued and are committed later."""
    if tier.flush(REPAIR_WAIT_S):
        return True
    log.warning("%d LMDB deletes still queued after %ss", count, REPAIR_WAIT_S)
    return False
