"""The page index's rebuild at start (:meth:`PageIndex.restore_disk
<hicache.controller.store.page_index.PageIndex.restore_disk>`): the pages found on disk,
oldest first, indexed into an empty index with the same entries, counts and eviction
order as ``create`` + ``set_disk`` per page, in one pass with one heapify (a rebuild of a
million pages is bound by this loop, and the per-page calls doubled it). It sets the
index's own fields; apart from page_index.py, which stays within the size limit.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

from hicache.controller.store.page_entry import DiskRecordLike, DiskState, PageEntry
from hicache.types import ComponentType, Tier

_FULL = ComponentType.FULL
_FULL_TAG = bytes((int(_FULL),))


def restore_disk(index: Any, records: Iterable[DiskRecordLike]) -> None:
    """Fill ``index`` (an empty ``PageIndex``) with ``records``, one per LMDB key."""
    assert not index._entries, "restore_disk fills an empty index"
    entries = index._entries
    children_of = index._children_of
    pages = index.disk_pages
    live = 0
    for r in records:  # one per LMDB key: keys are unique
        e = PageEntry(r.component, r.page_hash, r.parent_hash)
        e.attached = True
        index._clock += 1
        e.last_access = index._clock
        entries[e.skey] = e
        if e.component is _FULL:
            children_of.setdefault(e.parent_hash, set()).add(e)
        elif e.skey[-1:] not in index._aux_tags:
            index._note_aux(e.component)
        e.disk_state = DiskState.READY
        e.disk_nbytes = r.nbytes
        live += r.nbytes
        pages[e.component] += 1
    index.disk_live_bytes += live
    for parent_hash, kids in children_of.items():
        parent = entries.get(parent_hash + _FULL_TAG)
        if parent is not None:
            parent.children[Tier.DISK] = len(kids)  # every entry is on disk now
        else:
            index.roots.note(parent_hash)
    heap = index._disk_heap
    for e in entries.values():
        if index.evictable(e, Tier.DISK):
            seq = next(index._seq)
            e.heap_key[Tier.DISK] = (e.last_access, seq)
            heap.append((e.last_access, seq, e))
    heapq.heapify(heap)
