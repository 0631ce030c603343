"""A load of pages held on disk: each read's pages are copied into the engine's slots by
the reader as the read ends (``CopyAsRead``, for pages of ``copy_as_read_min_page_bytes``
and more), the others when the reads are done. The bytes are exact whichever way a page
went, and a load that gave up leaves nothing writing into the engine's slots. These are
the loads of ``disk_load_direct = false`` (pages read into host pages, kept there); the
default reads them straight into CPU slots (test_direct_loads.py)."""

from __future__ import annotations

import time

import pytest

from hicache.controller.store.faults import FaultPlan
from hicache.controller_api import LoadResult, Presence
from tests.support.controller import (
    FULL,
    assert_same_bytes,
    load_into,
    stored_then_restarted,
)


def _stored_then_restarted(tmp_path, pages: int, **overrides):
    """Its pages are small: every load copies as read all the same; read into host pages
    unless ``disk_load_direct`` is given."""
    overrides.setdefault("copy_as_read_min_page_bytes", 0)
    overrides.setdefault("disk_load_direct", False)
    return stored_then_restarted(tmp_path, pages, **overrides)


def test_pages_read_in_several_batches_arrive_exact(tmp_path):
    engine, ctl, chain, snap = _stored_then_restarted(tmp_path, pages=40, reader_threads=3)
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.check_invariants(deep=True)
    # The pages read stay on host: the next load copies them from there.
    assert ctl.lookup(chain.hashes, [FULL]).leading(FULL, Presence.HOST) == len(chain.hashes)
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.close()


def test_a_load_of_pages_on_host_and_on_disk_arrives_exact(tmp_path):
    engine, ctl, chain, snap = _stored_then_restarted(tmp_path, pages=12)
    half = set(chain.page_keys()[: len(chain.page_keys()) // 2])
    load_into(ctl, engine, chain, only=half)  # those now on host as well
    ctl.check_invariants()
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.check_invariants(deep=True)
    ctl.close()


def test_small_pages_are_copied_when_the_reads_have_ended(tmp_path):
    engine, ctl, chain, snap = _stored_then_restarted(
        tmp_path, pages=6, copy_as_read_min_page_bytes=1 << 30
    )
    assert ctl._copies.copy_as_read(chain.refs(), ctl._engines["local"]) is None
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.check_invariants(deep=True)
    ctl.close()


@pytest.mark.parametrize("direct", [False, True])  # read into host pages, or into the slots
def test_a_load_that_timed_out_writes_nothing_after_it_returned(tmp_path, direct):
    engine, ctl, chain, snap = _stored_then_restarted(
        tmp_path, pages=8, reader_threads=2, disk_load_direct=direct
    )
    ctl.faults = FaultPlan(disk_read_delay_s=0.3)
    target = engine.place(chain.hashes, chain.parents, sorted(chain.mamba_slots))
    engine.scribble(target)
    refs = target.refs()
    pin = ctl.pin([r.key for r in refs], 30.0)
    assert pin is not None
    assert ctl.load(refs, pin, 0.05) == LoadResult.FAILED
    at_return = engine.snapshot(target)
    # The reads end later and fill host pages; none of them copies on into the slots.
    assert ctl.prefetch(chain.page_keys()).wait(10.0)
    time.sleep(0.1)
    assert engine.snapshot(target) == at_return
    ctl.unpin(pin)
    ctl.check_invariants(deep=True)
    ctl.faults.disk_read_delay_s = 0.0
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.close()
