"""The page index's self-check (:meth:`PageIndex.check_invariants
<hicache.controller.store.page_index.PageIndex.check_invariants>`): every number the index
derives, recomputed from its entries and compared. It reads the index's own fields and
runs none of its operations; apart from page_index.py, which stays within the size limit.
"""

from __future__ import annotations

from typing import Any

from hicache.controller.store.page_entry import DiskState, HostState
from hicache.types import ComponentType, Tier

_TIERS = (Tier.HOST, Tier.DISK)


def check_index(index: Any) -> None:
    """Raise AssertionError where ``index`` (a ``PageIndex``) disagrees with itself."""
    live = 0
    pages = dict.fromkeys(ComponentType, 0)
    heap_seqs = {
        Tier.HOST: {it[1] for h in index._host_heaps.values() for it in h},
        Tier.DISK: {it[1] for it in index._disk_heap},
    }
    for heap in (*index._host_heaps.values(), index._disk_heap):
        for i in range(1, len(heap)):
            assert heap[(i - 1) // 2][:2] <= heap[i][:2], f"heap order broken at {i}"
    for skey, e in index._entries.items():
        assert e.attached and e.skey == skey, f"{e} filed under the wrong key"
        assert e.held or e.busy, f"{e} is in no tier yet still indexed"
        assert e.pins >= 0 and e.busy >= 0, f"{e} has a negative count"
        assert (e.host_page >= 0) == (e.host_state is not HostState.NONE), f"{e} host page"
        if e.disk_state is DiskState.READY:
            live += e.disk_nbytes
            pages[e.component] += 1
        if e.component is ComponentType.FULL:
            assert e in index._children_of.get(e.parent_hash, ()), f"{e} not in its chain"
            kids = index._children_of.get(e.page_hash, ())
            for tier in _TIERS:
                want = sum(1 for k in kids if k.present(tier))
                assert e.children[tier] == want, (
                    f"{e}: {tier.name} children {e.children[tier]} != {want}"
                )
        else:
            assert e.children == [0, 0, 0], f"{e}: an SWA/Mamba page has children"
        for tier in _TIERS:
            if index.evictable(e, tier):
                key, order = e.heap_key[tier], index._order_key(e, tier)
                # One of no tenant may wait at a lower key: queued again when it comes up.
                assert key is not None and (key[0] == order or (key[0] < order and not e.tenant)), (
                    f"{e} is evictable from {tier.name} but not queued at its order key"
                )
                assert key[1] in heap_seqs[tier], f"{e}: its {tier.name} heap item is gone"
    for parent, kids in index._children_of.items():
        for k in kids:
            assert k.attached and k.parent_hash == parent, f"{k} in a wrong chain set"
    full = ComponentType.FULL
    aux = {e.skey[-1:] for e in index._entries.values() if e.component is not full}
    assert aux <= set(index._aux_tags), f"SWA/Mamba entries not looked for: {aux}"
    assert live == index.disk_live_bytes, f"disk live bytes {index.disk_live_bytes} != {live}"
    assert pages == index.disk_pages, f"disk pages {index.disk_pages} != {pages}"
    index.tenants.check_invariants(index._entries.values(), index.evictable)
