"""Freeing pages: the single-page path, the distinct-pages fast path, and its debug check."""

from __future__ import annotations

import numpy as np
import pytest

from hicache import pools
from hicache.pools import PageAllocator
from hicache.types import SlotStateError


def test_debug_checks_are_on_in_the_tests():
    assert pools.DEBUG_CHECKS


@pytest.mark.parametrize("distinct", [False, True])
def test_free_returns_pages_and_refuses_bad_ones_changing_nothing(distinct):
    alloc = PageAllocator(8, 4, "full")
    pages = alloc.alloc_pages(5)
    alloc.free_pages(pages[:1], distinct)  # the single-page path
    alloc.free_pages(pages[1:3], distinct)
    assert alloc.available_pages() == 6
    for bad in ([pages[0]], [pages[3], pages[0]], [8], [-1], [pages[3], 99]):
        with pytest.raises(SlotStateError):
            alloc.free_pages(np.array(bad, dtype=np.int64), distinct)
        assert alloc.available_pages() == 6
    assert sorted(alloc.allocated_pages().tolist()) == sorted(pages[3:].tolist())


def test_a_duplicate_page_is_refused_even_when_the_caller_claims_distinct(monkeypatch):
    alloc = PageAllocator(8, 4, "full")
    pages = alloc.alloc_pages(3)
    twice = np.array([pages[0], pages[1], pages[0]], dtype=np.int64)
    with pytest.raises(SlotStateError, match="twice"):
        alloc.free_pages(twice)
    with pytest.raises(SlotStateError, match="twice"):
        alloc.free_pages(twice, distinct=True)  # the debug check catches the false claim
    assert alloc.available_pages() == 5
    monkeypatch.setattr(pools, "DEBUG_CHECKS", False)
    alloc.free_pages(pages, distinct=True)  # the fast path: no sort, same result
    assert alloc.available_pages() == 8
    assert sorted(alloc.alloc_pages(8).tolist()) == list(range(8))
