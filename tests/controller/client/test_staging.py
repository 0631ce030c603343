"""The staging area an engine shares with its sidecar (controller/client/staging.py): pages
of each component handed out by number, fewer when it is short, pages a transfer given up on
held by the quarantine until the transfer ends, and its shared memory gone at close."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from hicache import ComponentType, ConfigError
from hicache.controller.client import StagingArea
from tests.support.cache import make_layout

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
PAGE = 4


class Handle:
    """A transfer the test ends by hand."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    def done(self) -> bool:
        return self.ended.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.ended.wait(timeout_s)


@pytest.fixture
def staging():
    area = StagingArea(make_layout("full+swa+mamba"), PAGE, pages=4)
    yield area
    area.close()


def test_alloc_hands_out_distinct_pages_of_each_component(staging):
    pools = staging.pools
    assert pools.full.capacity == pools.swa.capacity == 4 * PAGE
    assert pools.mamba.num_pages == 4

    full, swa, mamba = staging.alloc(FULL, 3), staging.alloc(SWA, 2), staging.alloc(MAMBA, 4)

    assert len(set(full.tolist())) == full.size == 3
    assert swa.size == 2 and mamba.size == 4
    assert (staging.available(FULL), staging.available(SWA), staging.available(MAMBA)) == (1, 2, 0)
    staging.check_invariants()


def test_free_gives_pages_back(staging):
    pages = staging.alloc(FULL, 4)

    staging.free(FULL, pages)

    assert staging.available(FULL) == 4
    assert sorted(staging.alloc(FULL, 4).tolist()) == [0, 1, 2, 3]
    staging.check_invariants()


def test_exhaustion_returns_fewer_pages_then_none(staging):
    first = staging.alloc(FULL, 3)

    second, third = staging.alloc(FULL, 3), staging.alloc(FULL, 3)

    assert first.size == 3 and second.size == 1 and third.size == 0
    assert third.dtype == np.int64
    assert set(first.tolist()).isdisjoint(second.tolist())
    staging.check_invariants()


def test_pages_freed_with_an_unsettled_transfer_are_held_until_it_ends(staging):
    late = Handle()
    given_up = staging.alloc(MAMBA, 2)
    staging.free(MAMBA, given_up, late)

    newer = staging.alloc(MAMBA, 4)  # a newer call never gets the late copy's slots
    assert newer.size == 2 and set(newer.tolist()).isdisjoint(given_up.tolist())
    assert staging.held_pages == 2
    staging.check_invariants()

    late.ended.set()
    again = staging.alloc(MAMBA, 4)

    assert sorted(again.tolist()) == sorted(given_up.tolist())
    assert staging.held_pages == 0 and staging.counters["quarantine_released"] == 1
    staging.check_invariants()


def test_pages_freed_with_a_transfer_already_done_go_back_at_once(staging):
    done = Handle()
    done.ended.set()
    pages = staging.alloc(SWA, 4)

    staging.free(SWA, pages, done)

    assert staging.available(SWA) == 4 and staging.held_pages == 0
    staging.check_invariants()


def test_a_component_the_layout_lacks_has_no_pages():
    area = StagingArea(make_layout("full"), PAGE, pages=2)
    try:
        with pytest.raises(ConfigError, match="MAMBA"):
            area.alloc(MAMBA, 1)
        assert area.pools.swa is None and area.pools.mamba is None
    finally:
        area.close()


def test_close_frees_the_shared_memory():
    area = StagingArea(make_layout("full+swa+mamba"), PAGE, pages=2)
    names = [t["shm_name"] for t in area.pools.shared_tensors().values()]
    assert len(names) == 4 and all(os.path.exists(f"/dev/shm/{n}") for n in names)

    area.close()

    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
