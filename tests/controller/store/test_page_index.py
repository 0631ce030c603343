"""The page index: prefix-aware LRU eviction per tier, aux pages, holds, and pins."""

from __future__ import annotations

import hashlib
import heapq
import random
from types import SimpleNamespace

import pytest

from hicache.controller.store.lazy_heap import remove_at as _remove_at
from hicache.controller.store.page_index import DiskState, PageEntry, PageIndex
from hicache.controller.store.pins import PinTable
from hicache.types import ComponentType, Tier

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
ROOT = b"\0" * 16


def h(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def chain(index: PageIndex, names: str, parent: bytes = ROOT, tier=Tier.HOST) -> list[PageEntry]:
    """FULL pages ``names[0] → names[1] → ...``, ready in ``tier`` (host page = position)."""
    out = []
    for i, n in enumerate(names):
        e = index.create(FULL, h(n), parent)
        _give(index, e, tier, i)
        parent = h(n)
        out.append(e)
    return out


def _give(index: PageIndex, e: PageEntry, tier: Tier, page: int = 0) -> None:
    if tier is Tier.HOST:
        index.set_host(e, page, ready=True)
    else:
        index.set_disk(e, DiskState.READY, 100)


def drain(index: PageIndex, tier: Tier, component=FULL) -> list[str]:
    """Evict everything evictable from ``tier``, returning the order (as short names)."""
    names = {h(c): c for c in "abcdefghijklmnopqrstuvwxyz"}
    order = []
    while (v := index.pop_victim(tier, component if tier is Tier.HOST else None)) is not None:
        if tier is Tier.HOST:
            index.clear_host(v)
        else:
            index.clear_disk(v)
        order.append(names[v.page_hash] + ("" if v.component is FULL else v.component.name[0]))
        index.discard_if_unused(v)
        index.check_invariants()
    return order


def test_a_chain_is_cut_from_its_tail_even_when_its_head_is_newest():
    index = PageIndex()
    a, b, c = chain(index, "abc")
    index.touch(a)  # the head is the most recently used page
    index.check_invariants()
    assert drain(index, Tier.HOST) == ["c", "b", "a"]
    assert len(index) == 0


def test_least_recently_used_leaf_goes_first_across_chains():
    index = PageIndex()
    x = chain(index, "ab")
    chain(index, "cd")
    index.touch(x[1])  # chain x is now the more recent one
    assert drain(index, Tier.HOST) == ["d", "c", "b", "a"]


def test_a_branch_point_waits_for_all_its_children():
    index = PageIndex()
    a, b = chain(index, "ab")
    (c,) = chain(index, "c", parent=h("a"))
    index.touch(a)
    assert drain(index, Tier.HOST) == ["b", "c", "a"]


def test_tiers_evict_independently():
    index = PageIndex()
    a, b = chain(index, "ab")
    for e in (a, b):
        _give(index, e, Tier.DISK)
    assert drain(index, Tier.DISK) == ["b", "a"]
    # Still on host: the entries stay, evictable there in the same order.
    assert len(index) == 2 and not a.present(Tier.DISK)
    assert drain(index, Tier.HOST) == ["b", "a"]


def test_aux_pages_are_leaves_and_held_aux_pages_hold_their_full_page():
    index = PageIndex()
    (a,) = chain(index, "a")
    swa = index.create(SWA, h("a"), ROOT)
    index.set_host(swa, 0, ready=True)
    index.pin(swa)
    assert index.pop_victim(Tier.HOST, FULL) is None  # its SWA page is pinned
    assert index.pop_victim(Tier.HOST, SWA) is None
    index.unpin(swa)  # pushes the FULL page back
    index.check_invariants()
    assert index.pop_victim(Tier.HOST, FULL) is a
    assert index.aux_in(a, Tier.HOST) == [swa]


def test_pinned_busy_and_filling_entries_are_not_evictable():
    index = PageIndex()
    a, b = chain(index, "ab")
    index.pin(b)
    assert index.pop_victim(Tier.HOST, FULL) is None
    index.unpin(b)
    index.acquire(b)
    assert index.pop_victim(Tier.HOST, FULL) is None
    index.release(b)
    c = index.create(FULL, h("c"), h("b"))
    index.set_host(c, 2, ready=False)  # being filled: neither c nor its parent may go
    assert index.pop_victim(Tier.HOST, FULL) is None
    index.mark_host_ready(c)
    index.check_invariants()
    assert drain(index, Tier.HOST) == ["c", "b", "a"]


def test_a_parent_created_after_its_child_counts_it():
    index = PageIndex()
    child = index.create(FULL, h("b"), h("a"))
    index.set_host(child, 1, ready=True)
    parent = index.create(FULL, h("a"), ROOT)
    index.set_host(parent, 0, ready=True)
    assert parent.children[Tier.HOST] == 1
    index.check_invariants()
    assert drain(index, Tier.HOST) == ["b", "a"]


def test_check_invariants_catches_a_wrong_child_count():
    index = PageIndex()
    a, _ = chain(index, "ab")
    a.children[Tier.HOST] = 0
    with pytest.raises(AssertionError, match="children"):
        index.check_invariants()


def test_heaps_stay_bounded_under_many_touches():
    index = PageIndex()
    entries = chain(index, "abcd")
    for _ in range(5000):
        index.touch(entries[-1])
    assert len(index._host_heaps[FULL]) <= 2 * len(index) + 1024 + 1
    index.check_invariants()
    assert drain(index, Tier.HOST) == ["d", "c", "b", "a"]


@pytest.mark.parametrize("seed", range(4))
def test_pages_loaded_again_and_again_leave_in_exact_lru_order_without_a_push_per_load(seed):
    """A load pins, touches and unpins its pages: a page already queued is not pushed
    again at the unpin, yet every tier still gives up its least recently used page
    first (the waiting item is queued again when it comes up)."""
    rng = random.Random(seed)
    index = PageIndex()
    names = "abcdefghijklmnop"
    pages = {n: chain(index, n)[0] for n in names}  # leaves of their own chains
    for e in pages.values():
        index.set_disk(e, DiskState.READY, 100)
    index.check_invariants()
    queued = len(index._host_heaps[FULL]), len(index._disk_heap)
    for _ in range(200):
        load = rng.sample(names, rng.randint(1, 5))
        entries = [pages[n] for n in load]
        index.pin_all(entries)
        index.touch_all(entries)
        index.unpin_all(entries)
        index.check_invariants()
    assert (len(index._host_heaps[FULL]), len(index._disk_heap)) == queued
    by_age = sorted(names, key=lambda n: pages[n].last_access)
    assert drain(index, Tier.DISK) == by_age
    assert drain(index, Tier.HOST) == by_age


def test_disk_bytes_and_pages_follow_commits_and_evictions():
    index = PageIndex()
    e = index.create(FULL, h("a"), ROOT)
    index.set_disk(e, DiskState.PENDING)
    assert index.disk_live_bytes == 0  # queued bytes are not live yet
    index.set_disk(e, DiskState.READY, 4096)
    assert index.disk_live_bytes == 4096 and index.disk_pages[FULL] == 1
    assert index.clear_disk(e) == 4096
    assert index.disk_live_bytes == 0
    assert index.discard_if_unused(e) and len(index) == 0


def test_pins_expire_release_once_and_go_with_their_engine():
    index = PageIndex()
    a, b = chain(index, "ab")
    pins = PinTable(index)
    p1 = pins.add("e1", [a, b], deadline=10.0)
    p2 = pins.add("e2", [b], deadline=20.0)
    assert b.pins == 2
    assert pins.expire(now=15.0) == 1  # p1 only
    assert pins.get(p1.pin_id) is None and a.pins == 0 and b.pins == 1
    assert pins.release(p1.pin_id) is False  # after expiry: harmless
    pins.check_invariants()
    assert pins.release_engine("e2") == 1
    assert pins.get(p2.pin_id) is None and b.pins == 0
    pins.check_invariants()
    index.check_invariants()


def _turn_over(index: PageIndex, names: str, age_ticks: int) -> None:
    """Measure a host turnover: single pages ``names`` evicted ``age_ticks`` after their use."""
    for n in names:
        (e,) = chain(index, n)
        for _ in range(age_ticks):
            index.tick()
        assert index.pop_victim(Tier.HOST, FULL) is e
        index.clear_host(e)
        index.discard_if_unused(e)


@pytest.mark.parametrize("retention", [0.0, 1.0, 3.0])
def test_a_host_page_that_served_a_load_outlives_unused_pages_by_the_retention(retention):
    """With retention R, a page that served a load ranks as if used R host turnovers
    later: pages unused since before that point go first, newer ones after; with 0 it
    is plain LRU. Tail-first order holds regardless."""
    index = PageIndex(host_hit_retention=retention)
    _turn_over(index, "uvw", age_ticks=100)  # a turnover of about 100 ticks
    turnover = index.host_turnover
    assert 95 <= turnover <= 105
    (served,) = chain(index, "s")
    index.served(served)  # loaded into a device: retained
    stamp = served.last_access
    older = chain(index, "o")  # used just after the served page
    for _ in range(int(retention * turnover) + 5):
        index.tick()
    newer = chain(index, "n")  # used after the served page's retained point
    index.check_invariants()
    order = drain(index, Tier.HOST)
    if retention == 0:
        assert order == ["s", "o", "n"]
    else:
        assert order == ["o", "s", "n"]
        assert served.retain == int(retention * turnover)
    assert older[0].last_access > stamp and newer[0].last_access > stamp + served.retain


def test_retention_never_breaks_tail_first_order():
    """A served head of a chain still waits for its unserved tail, and the tail's own
    (unretained) key decides when the chain starts to go."""
    index = PageIndex(host_hit_retention=10.0)
    _turn_over(index, "uvw", age_ticks=50)
    a, b = chain(index, "ab")
    index.served(a)
    (c,) = chain(index, "c")
    index.check_invariants()
    assert drain(index, Tier.HOST) == ["b", "c", "a"]


def test_negative_retention_is_refused():
    with pytest.raises(ValueError, match="host_hit_retention"):
        PageIndex(host_hit_retention=-1.0)


def _disk_forest(seed: int) -> list[SimpleNamespace]:
    """Records of a random forest of FULL chains with SWA and Mamba pages on some of them,
    oldest first, as a disk scan returns them (children may come before their parent)."""
    rng = random.Random(seed)
    full: list[bytes] = []
    records = []
    for i in range(300):
        parent = rng.choice(full) if full and rng.random() < 0.8 else ROOT
        page = h(f"{seed}-{i}")
        full.append(page)
        records.append((FULL, page, parent))
        for comp in (SWA, MAMBA):
            if rng.random() < 0.3:
                records.append((comp, page, parent))
    rng.shuffle(records)
    return [
        SimpleNamespace(
            skey=p + bytes((int(c),)), component=c, page_hash=p, parent_hash=par, nbytes=100 + i
        )
        for i, (c, p, par) in enumerate(records)
    ]


@pytest.mark.parametrize("seed", range(4))
def test_restore_disk_builds_what_page_by_page_indexing_builds(seed):
    records = _disk_forest(seed)
    slow = PageIndex()
    for r in records:
        e = slow.get(r.skey) or slow.create(r.component, r.page_hash, r.parent_hash)
        slow.set_disk(e, DiskState.READY, r.nbytes)
    fast = PageIndex()
    fast.restore_disk(records)
    slow.check_invariants()
    fast.check_invariants()
    assert fast.disk_live_bytes == slow.disk_live_bytes == sum(r.nbytes for r in records)
    assert fast.disk_pages == slow.disk_pages
    by_key = {e.skey: e for e in slow}
    assert {e.skey for e in fast} == set(by_key)
    for e in fast:
        twin = by_key[e.skey]
        assert (e.children, e.last_access) == (twin.children, twin.last_access)
    # The same eviction order: tails first, the least recently restored first.
    order = []
    for index in (slow, fast):
        seen = []
        while (v := index.pop_victim(Tier.DISK)) is not None:
            seen.append(v.skey)
            index.clear_disk(v)
            index.discard_if_unused(v)
            index.check_invariants()
        order.append(seen)
    assert order[0] == order[1] and len(order[0]) == len(records)


def test_restore_disk_wants_an_empty_index():
    index = PageIndex()
    chain(index, "a")
    with pytest.raises(AssertionError):
        index.restore_disk([])


def test_a_heap_that_grew_is_swept_a_few_items_per_push_never_compacted_whole(monkeypatch):
    index = PageIndex()
    leaves = [chain(index, f"{c}", tier=Tier.HOST)[0] for c in "abcdefgh"]
    many = [index.create(FULL, h(f"x{i}"), ROOT) for i in range(3000)]
    for i, e in enumerate(many):
        index.set_host(e, 100 + i, ready=True)
    monkeypatch.setattr(PageIndex, "_compact", staticmethod(_no_compaction))
    rng = random.Random(0)
    everyone = leaves + many
    for step in range(60_000):
        index.touch(rng.choice(everyone))
        if step % 20_000 == 0:
            index.check_invariants()
    heap = index._host_heaps[FULL]
    assert len(heap) <= 1.5 * len(index) + 1024 + 8
    index.check_invariants()
    # LRU order is intact: every entry comes out, least recently touched first.
    last_access = []
    while (v := index.pop_victim(Tier.HOST, FULL)) is not None:
        last_access.append(v.last_access)
        index.clear_host(v)
        index.discard_if_unused(v)
    assert len(last_access) == len(everyone) and last_access == sorted(last_access)


def _no_compaction(heap, tier):
    raise AssertionError("a whole-heap compaction ran")


@pytest.mark.parametrize("seed", range(3))
def test_remove_at_keeps_the_heap_order_and_the_other_items(seed):
    rng = random.Random(seed)
    heap = [(rng.randrange(50), i, None) for i in range(400)]
    heapq.heapify(heap)
    items = sorted(heap[:])
    while heap:
        i = rng.randrange(len(heap))
        gone = heap[i]
        _remove_at(heap, i)
        items.remove(gone)
        assert sorted(heap) == items
        assert all(heap[(j - 1) // 2] <= heap[j] for j in range(1, len(heap)))
