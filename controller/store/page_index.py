"""The page index: where each cached page lives, its chain, its pins, and eviction order.

An entry is one page of one component (a :class:`PageKey`). Per tier it is absent,
in flight (a host page being filled; a disk write queued) or ready. The index is the
single source of truth for presence; the host pool and LMDB only hold bytes.

Prefix-aware eviction, per tier: a FULL page is evictable there only while none of its
FULL children (pages whose parent hash is its hash) is present in that tier, so a chain
is always cut from its tail. SWA and Mamba pages hang off the FULL page of the same
hash: they are leaves, evictable on their own, and evicting the FULL page evicts them
(so the FULL page is held while one of them is pinned or busy). Pinned or busy entries
(being filled, written, read or copied) are never evictable.

Eviction order is least recently used, in lazy min-heaps keyed by a logical clock: one
per host component (host pages are pooled per component), one for disk (one budget). An
entry is pushed when it becomes evictable or is touched; a popped item that no longer
matches its entry's latest push is stale and skipped. An entry of no tenant already
queued at a lower key than its order key is not pushed again when it is released (the
unpin of every page of every load): when its item comes up, it is queued again at its
order key then, so it leaves the heap in the same order as if it had been pushed at each
touch. Every operation is O(log n). Past
1.5 items per entry, each push also removes the stale ones among the next few items of a
cycling cursor, so a heap stays bounded without a whole compaction (a second's pause at
a million pages), which remains only as a backstop.

Host pages that served a load-back are kept longer (``host_hit_retention``; most pages
a device evicts to host are never asked for again): such a page is queued at its last
access plus ``host_hit_retention`` times the host *turnover* (the running mean of the
ticks a host victim had gone unused); 0 is plain LRU. Only host leaves are candidates.

Every method here is called with the controller's lock held. An entry's own fields are
:class:`hicache.controller.store.page_entry.PageEntry`'s.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

from hicache.controller.store.index_checks import check_index
from hicache.controller.store.index_restore import restore_disk
from hicache.controller.store.lazy_heap import compact, sweep
from hicache.controller.store.miss_reasons import ChainRoots
from hicache.controller.store.page_entry import DiskRecordLike, DiskState, HostState, PageEntry
from hicache.controller.store.tenants import TenantLedger
from hicache.controller.store.tier_events import TierEvents
from hicache.controller_api import P_ABSENT, P_DISK, P_HOST
from hicache.types import ComponentType, Tier

__all__ = ["DiskState", "HostState", "PageEntry", "PageIndex"]

# Enum members bound once: a class attribute lookup of one costs several times a global's,
# and these run several times per page of every store, pin and eviction.
_FULL = ComponentType.FULL
_TAG = {c: bytes((int(c),)) for c in ComponentType}  # of storage keys, as PageEntry's
_FULL_TAG = _TAG[_FULL]
_AUX = (ComponentType.SWA, ComponentType.MAMBA)
_HOST, _DISK = Tier.HOST, Tier.DISK
_TIERS = (_HOST, _DISK)
_TURNOVER_WINDOW = 1024  # host victims over which the turnover is averaged

_HOST_NONE, _HOST_FILLING, _HOST_READY = HostState.NONE, HostState.FILLING, HostState.READY
_DISK_NONE, _DISK_READY = DiskState.NONE, DiskState.READY


class PageIndex:
    """Entries by storage key, FULL chains, and per-tier prefix-aware LRU heaps
    (``host_hit_retention``: see the module docstring)."""

    def __init__(
        self, host_hit_retention: float = 0.0, tenants: TenantLedger | None = None
    ) -> None:
        if not host_hit_retention >= 0:
            raise ValueError(f"host_hit_retention must be >= 0, got {host_hit_retention}")
        self.host_hit_retention = host_hit_retention
        self.host_turnover = 0.0  # running mean of a host victim's ticks since its use
        self._host_victims = 0
        self._entries: dict[bytes, PageEntry] = {}
        # The entry of a storage key, None when absent: the dict's own ``get`` (no frame
        # of ours around it), as a lookup, a pin and a store call it for every page.
        self.get: Callable[[bytes], PageEntry | None] = self._entries.get
        # FULL entries by their parent hash: lets a parent created after its children
        # (a restart, a re-backup of a dropped page) count them.
        self._children_of: dict[bytes, set[PageEntry]] = {}
        self._host_heaps: dict[ComponentType, list] = {c: [] for c in ComponentType}
        # The tags of the SWA/Mamba components that have had an entry, in ``_AUX`` order:
        # a FULL-only layout never looks for a FULL page's SWA/Mamba pages.
        self._aux_tags: tuple[bytes, ...] = ()
        self._disk_heap: list = []
        self._seq = itertools.count(1)
        self._sweep_at: dict[int, int] = {}  # per heap (by id): where the stale sweep is
        self._clock = 0
        self.disk_live_bytes = 0
        self.disk_pages = dict.fromkeys(ComponentType, 0)
        self.events: TierEvents | None = None  # told where a tier becomes present or absent
        self.roots = ChainRoots()  # parents of chain heads: where ``explain`` looks
        self.tenants = tenants or TenantLedger()  # whose pages are where (store/tenants.py)

    # -- queries -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[PageEntry]:
        return iter(list(self._entries.values()))

    def presence(self, page_hashes: Sequence[bytes], component: ComponentType) -> list[int]:
        """Per page of ``component``: ``Presence`` as a plain int (host when ready there,
        else disk when stored or queued, else absent). One pass, no per-page calls: a
        lookup asks this for every page of a chain."""
        get = self._entries.get
        tag = _TAG[component]
        row = []
        for h in page_hashes:
            e = get(h + tag)
            if e is None:
                row.append(P_ABSENT)
            elif e.host_state is _HOST_READY:
                row.append(P_HOST)
            elif e.disk_state is not _DISK_NONE:
                row.append(P_DISK)
            else:
                row.append(P_ABSENT)
        return row

    def aux_in(self, entry: PageEntry, tier: Tier) -> list[PageEntry]:
        """SWA/Mamba entries of a FULL entry's hash that are present in ``tier``."""
        out = []
        for tag in self._aux_tags:
            aux = self._entries.get(entry.page_hash + tag)
            if aux is not None and aux.present(tier):
                out.append(aux)
        return out

    def evictable(self, entry: PageEntry, tier: Tier) -> bool:
        """Whether ``entry`` may lose its copy in ``tier`` now (see the module docstring)."""
        if entry.pins or entry.busy or entry.children[tier]:
            return False
        if tier is _HOST:
            if entry.host_state is not _HOST_READY:
                return False
        elif entry.disk_state is not _DISK_READY:
            return False
        if entry.component is _FULL and self._aux_tags:
            get, h = self._entries.get, entry.page_hash
            for tag in self._aux_tags:  # held while one of its SWA/Mamba pages is
                a = get(h + tag)
                if a is not None and (a.pins or a.busy) and a.present(tier):
                    return False
        return True

    # -- the logical clock ---------------------------------------------------------------

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    def served(self, entry: PageEntry) -> None:
        """``entry`` was loaded from the host tier into a device: most recently used, and
        kept ``host_hit_retention`` host turnovers longer than an unused page."""
        entry.retain = int(self.host_hit_retention * self.host_turnover)
        self.touch(entry)

    def served_all(self, entries: Sequence[PageEntry]) -> None:
        """:meth:`served` of each of ``entries``, in order."""
        retain = int(self.host_hit_retention * self.host_turnover)  # the same for each
        for e in entries:
            e.retain = retain
        self.touch_all(entries)

    def touch_all(self, entries: Iterable[PageEntry]) -> None:
        """:meth:`touch` each of ``entries``, in order."""
        for e in entries:
            self._clock += 1
            e.last_access = self._clock
            if not (e.pins or e.busy):
                self._push_ready(e)

    def touch(self, entry: PageEntry) -> None:
        """Mark ``entry`` most recently used."""
        self._clock += 1
        entry.last_access = self._clock
        if entry.pins or entry.busy:
            return  # not evictable now; pushed when released
        self._push_ready(entry)

    def _push_ready(self, entry: PageEntry) -> None:
        """:meth:`_maybe_push` in each tier where ``entry`` is ready (in no other is it
        evictable)."""
        if entry.host_state is _HOST_READY:
            self._maybe_push(entry, _HOST)
        if entry.disk_state is _DISK_READY:
            self._maybe_push(entry, _DISK)

    # -- entries -------------------------------------------------------------------------

    def create(
        self, component: ComponentType, page_hash: bytes, parent_hash: bytes, last_access: int = 0
    ) -> PageEntry:
        """A new, absent entry (the caller then gives it a tier)."""
        entry = PageEntry(component, page_hash, parent_hash)
        assert entry.skey not in self._entries, f"{entry} exists already"
        entry.attached = True
        entry.last_access = last_access or self.tick()
        self._entries[entry.skey] = entry
        if component is not _FULL and entry.skey[-1:] not in self._aux_tags:
            self._note_aux(component)
        if component is _FULL:
            self._children_of.setdefault(parent_hash, set()).add(entry)
            if parent_hash + _FULL_TAG not in self._entries:
                self.roots.note(parent_hash)
            kids = self._children_of.get(page_hash)
            if kids:  # children indexed before their parent (a restart, a re-backup)
                for tier in _TIERS:
                    entry.children[tier] = sum(1 for k in kids if k.present(tier))
        return entry

    def _note_aux(self, component: ComponentType) -> None:
        """An entry of SWA/Mamba ``component`` exists: FULL pages look for theirs now."""
        seen = {*self._aux_tags, _TAG[component]}
        self._aux_tags = tuple(_TAG[c] for c in _AUX if _TAG[c] in seen)

    def restore_disk(self, records: Iterable[DiskRecordLike]) -> None:
        """Index the pages found on disk at start, oldest first, into an empty index: the
        same entries, counts and eviction order as ``create`` + ``set_disk`` per page, in
        one pass with one heapify (index_restore.py)."""
        restore_disk(self, records)

    def set_parent(self, entry: PageEntry, parent_hash: bytes) -> None:
        """Move ``entry`` to the chain of ``parent_hash``: for a page created before its
        parent was known (a remote fill of a chain's first page learns it from the value)."""
        if entry.component is ComponentType.FULL and parent_hash != entry.parent_hash:
            present = [t for t in _TIERS if entry.present(t)]
            for t in present:
                self._presence_changed(entry, t, -1)
            siblings = self._children_of[entry.parent_hash]
            siblings.discard(entry)
            if not siblings:
                del self._children_of[entry.parent_hash]
            entry.parent_hash = parent_hash
            self._children_of.setdefault(parent_hash, set()).add(entry)
            for t in present:
                self._presence_changed(entry, t, +1)
        entry.parent_hash = parent_hash

    def discard_if_unused(self, entry: PageEntry) -> bool:
        """Drop ``entry`` when it is in no tier and nothing is in flight on it."""
        if not entry.attached or entry.held or entry.busy:
            return False
        del self._entries[entry.skey]
        entry.attached = False
        if entry.component is _FULL:
            siblings = self._children_of[entry.parent_hash]
            siblings.discard(entry)
            if not siblings:
                del self._children_of[entry.parent_hash]
        return True

    # -- tier transitions ----------------------------------------------------------------

    def set_host(self, entry: PageEntry, page: int, ready: bool) -> None:
        """Give ``entry`` host page ``page``, filled (ready) or being filled."""
        assert entry.host_state is _HOST_NONE, f"{entry} already has a host page"
        entry.host_page = page
        entry.host_state = _HOST_READY if ready else _HOST_FILLING
        self._presence_changed(entry, _HOST, +1)
        if ready:  # a filling page is never evictable; mark_host_ready queues it
            self._maybe_push(entry, _HOST)
            if self.events is not None:
                self.events.stored(_HOST, (entry,))

    def host_filled(self, entries: Sequence[PageEntry]) -> None:
        """The fills of ``entries``, each held (:meth:`acquire`) for its fill, ended:
        :meth:`mark_host_ready` and :meth:`release` of each, in order, in one pass, and
        the listener told of them in one call."""
        released = self._released
        for e in entries:
            assert e.host_state is _HOST_FILLING, f"{e} is not being filled"
            assert e.busy > 0, f"release of {e} that is not held"
            e.host_state = _HOST_READY
            e.busy -= 1  # held until now: mark_host_ready would have pushed nothing
            if e.busy == 0:
                released(e)
        if self.events is not None and entries:
            self.events.stored(_HOST, entries)

    def mark_host_ready(self, entry: PageEntry) -> None:
        assert entry.host_state is _HOST_FILLING, f"{entry} is not being filled"
        entry.host_state = _HOST_READY
        self._maybe_push(entry, _HOST)
        if self.events is not None:
            self.events.stored(_HOST, (entry,))

    def clear_host(self, entry: PageEntry) -> int:
        """Take the host page away from ``entry``; returns the page id to free."""
        assert entry.host_state is not _HOST_NONE, f"{entry} has no host page"
        page = entry.host_page
        was_ready = entry.host_state is _HOST_READY
        entry.host_page = -1
        entry.host_state = _HOST_NONE
        self._presence_changed(entry, _HOST, -1)
        if was_ready and self.events is not None:
            self.events.removed(_HOST, (entry,))
        return page

    def set_disk(self, entry: PageEntry, state: DiskState, nbytes: int = 0) -> None:
        """Queue (PENDING) or commit (READY, ``nbytes`` stored) ``entry`` on disk."""
        assert state is not DiskState.NONE
        before = entry.disk_state
        assert before is not DiskState.READY, f"{entry} is on disk already"
        entry.disk_state = state
        if state is DiskState.READY:
            entry.disk_nbytes = nbytes
            self.disk_live_bytes += nbytes
            self.disk_pages[entry.component] += 1
        if before is DiskState.NONE:
            self._presence_changed(entry, Tier.DISK, +1)
        self._maybe_push(entry, Tier.DISK)
        if state is DiskState.READY and self.events is not None:
            self.events.stored(Tier.DISK, (entry,))

    def clear_disk(self, entry: PageEntry) -> int:
        """Forget ``entry``'s disk copy (queued or committed); returns the bytes it held."""
        assert entry.disk_state is not DiskState.NONE, f"{entry} is not on disk"
        nbytes = 0
        was_ready = entry.disk_state is DiskState.READY
        if was_ready:
            nbytes = entry.disk_nbytes
            self.disk_live_bytes -= nbytes
            self.disk_pages[entry.component] -= 1
        entry.disk_state = DiskState.NONE
        entry.disk_nbytes = 0
        entry.pending_payload = None
        self._presence_changed(entry, Tier.DISK, -1)
        if was_ready and self.events is not None:
            self.events.removed(Tier.DISK, (entry,))
        return nbytes

    def _presence_changed(self, entry: PageEntry, tier: Tier, delta: int) -> None:
        if entry.tenant:
            self.tenants.charge(entry, tier, delta)
        if entry.component is _FULL:
            parent = self._entries.get(entry.parent_hash + _FULL_TAG)
            if parent is not None:
                children = parent.children
                children[tier] += delta
                if children[tier] == 0:
                    self._maybe_push(parent, tier)
        else:
            full = self._entries.get(entry.page_hash + _FULL_TAG)
            if full is not None:
                self._maybe_push(full, tier)

    # -- pins and in-flight holds --------------------------------------------------------

    def pin(self, entry: PageEntry) -> None:
        entry.pins += 1

    def pin_all(self, entries: Iterable[PageEntry]) -> None:
        """:meth:`pin` each of ``entries`` (one listed twice is pinned twice)."""
        for e in entries:
            e.pins += 1

    def unpin(self, entry: PageEntry) -> None:
        assert entry.pins > 0, f"unpin of {entry} that is not pinned"
        entry.pins -= 1
        if entry.pins == 0:
            self._released(entry)

    def unpin_all(self, entries: Iterable[PageEntry]) -> None:
        """:meth:`unpin` each of ``entries``, in order."""
        released = self._released
        for e in entries:
            assert e.pins > 0, f"unpin of {e} that is not pinned"
            e.pins -= 1
            if e.pins == 0:
                released(e)

    def acquire(self, entry: PageEntry) -> None:
        """Hold ``entry`` against eviction while an operation is in flight on it."""
        entry.busy += 1

    def release(self, entry: PageEntry) -> None:
        assert entry.busy > 0, f"release of {entry} that is not held"
        entry.busy -= 1
        if entry.busy == 0:
            self._released(entry)

    def _released(self, entry: PageEntry) -> None:
        if not entry.attached or entry.pins or entry.busy:
            return  # still held: nothing became evictable
        self._push_ready(entry)
        if entry.component is not _FULL:
            full = self._entries.get(entry.page_hash + _FULL_TAG)
            if full is not None:
                self._push_ready(full)

    # -- LRU heaps -----------------------------------------------------------------------

    def _maybe_push(self, entry: PageEntry, tier: Tier) -> None:
        if not entry.attached or not self.evictable(entry, tier):
            return
        heap_key = entry.heap_key
        current = heap_key[tier]
        if tier is _HOST:  # the order key (_order_key)
            key = entry.last_access + entry.retain
            heap = self._host_heaps[entry.component]
        else:
            key = entry.last_access
            heap = self._disk_heap
        if current is not None and (current[0] == key or (current[0] < key and not entry.tenant)):
            return  # its item is valid, or comes up earlier and is queued again then
        seq = next(self._seq)
        heap_key[tier] = (key, seq)
        heapq.heappush(heap, (key, seq, entry))
        if entry.tenant:
            self.tenants.push(entry, tier, (key, seq, entry))
        if 2 * len(heap) > 3 * len(self._entries) + 2048:
            self._sweep_at[id(heap)] = sweep(heap, self._sweep_at.get(id(heap), 0), tier)
            if len(heap) > 2 * len(self._entries) + 1024:
                self._compact(heap, tier)

    @staticmethod
    def _order_key(entry: PageEntry, tier: Tier) -> int:
        """Where ``entry`` stands in ``tier``'s eviction order (lowest goes first)."""
        return entry.last_access + entry.retain if tier is Tier.HOST else entry.last_access

    _compact = staticmethod(compact)

    def pop_victim(self, tier: Tier, component: ComponentType | None = None) -> PageEntry | None:
        """The least recently used evictable entry of ``tier`` (host: of ``component``).

        The entry leaves the heap; the caller evicts it (if it does not, the next change
        that makes it evictable pushes it again).
        """
        host = tier is _HOST
        if host:
            assert component is not None, "host victims are chosen per component"
            heap = self._host_heaps[component]
        else:
            heap = self._disk_heap
        while heap:
            _, seq, entry = heapq.heappop(heap)
            key = entry.heap_key[tier]
            if not entry.attached or key is None or key[1] != seq:
                continue  # stale: a newer item (or none) stands for this entry
            if not self.evictable(entry, tier):
                entry.heap_key[tier] = None  # queued again once it is
                continue
            order = self._order_key(entry, tier)
            if key[0] < order:  # touched since it was queued (see _maybe_push)
                seq = next(self._seq)
                entry.heap_key[tier] = (order, seq)
                heapq.heappush(heap, (order, seq, entry))
                if entry.tenant:
                    self.tenants.push(entry, tier, (order, seq, entry))
                continue
            entry.heap_key[tier] = None
            if host:
                self._host_victims += 1
                age = self._clock - entry.last_access
                weight = 1.0 / min(self._host_victims, _TURNOVER_WINDOW)
                self.host_turnover += weight * (age - self.host_turnover)
            return entry
        return None

    def requeue(self, entry: PageEntry) -> None:
        """Queue ``entry`` at its order key in each tier where it waits at a lower one (see
        :meth:`_maybe_push`): before it joins a tenant's heaps, whose items stand exact."""
        for tier in (_HOST, _DISK):
            key = entry.heap_key[tier]
            if key is not None and key[0] != self._order_key(entry, tier):
                entry.heap_key[tier] = None
                self._maybe_push(entry, tier)

    def pop_tenant_victim(
        self, tenant: int, tier: Tier, component: ComponentType | None = None
    ) -> PageEntry | None:
        """Tenant ``tenant``'s least recently used evictable entry of ``tier`` (one with a
        quota there; host: of ``component`` first), as :meth:`pop_victim` hands it out."""
        return self.tenants.pop_victim(tenant, tier, component, self.evictable)

    # -- checks --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Recompute every derived number and compare (index_checks.py); AssertionError."""
        check_index(self)
