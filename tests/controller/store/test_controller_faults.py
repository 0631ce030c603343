"""Failures at every stage of a backup and a load leave the controller consistent.

Each scenario arms one fault, runs the operation, checks that it reported failure (False
or ControllerError), that the index, pools, pins and holds are consistent, and that the
same operation succeeds once the fault is gone.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.local import LocalController
from hicache.controller_api import ControllerError, LoadResult, Presence
from hicache.types import Tier
from tests.support.controller import (
    ALL,
    FULL,
    PAGE,
    SWA,
    Engine,
    assert_same_bytes,
    controller_config,
    hybrid_layout,
    load_into,
)


def _disk_only(tmp_path, pages: int = 4, **overrides):
    """A chain stored, then a restart: every page is on disk and none on host."""
    layout = hybrid_layout()
    engine = Engine(layout)
    ctl = LocalController(controller_config(tmp_path, **overrides))
    ctl.register(layout, PAGE, engine.pools)
    chain = engine.write_chain(range(pages * PAGE), mamba_every=pages)
    snap = engine.snapshot(chain)
    assert ctl.backup(chain.refs()).wait(5.0)
    ctl.close()
    ctl = LocalController(controller_config(tmp_path, **overrides))
    ctl.register(layout, PAGE, engine.pools)
    ctl.faults = FaultPlan()
    return engine, ctl, chain, snap


def _pin_and_load(ctl, engine, chain, timeout_s=5.0):
    target = engine.place(chain.hashes, chain.parents, sorted(chain.mamba_slots))
    refs = target.refs()
    pin = ctl.pin([r.key for r in refs], 30.0)
    assert pin is not None
    return ctl.load(refs, pin, timeout_s), pin


def _no_holds(ctl) -> None:
    ctl.check_invariants()
    stats = ctl.stats()
    assert stats["pins_active"] == 0
    assert all(e.busy == 0 and e.pins == 0 for e in ctl.store._index)


def test_pin_failure_raises_and_pins_nothing(tmp_path):
    engine, ctl, chain, snap = _disk_only(tmp_path)
    ctl.faults.pin = 1
    with pytest.raises(ControllerError, match="injected"):
        ctl.pin(chain.page_keys(), 5.0)
    _no_holds(ctl)
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.close()


def test_disk_read_error_fails_the_load_and_keeps_the_page(tmp_path):
    engine, ctl, chain, snap = _disk_only(tmp_path)
    ctl.faults.disk_read = 1
    ok, pin = _pin_and_load(ctl, engine, chain)
    assert ok == LoadResult.FAILED  # failed, nothing left writing
    ctl.unpin(pin)
    assert ctl.stats()["failures"]["disk_read_error"] == 1
    _no_holds(ctl)
    # A read error may be transient: the stored page is kept and serves the retry.
    assert ctl.lookup(chain.hashes, [FULL]).leading(FULL, Presence.DISK) == 4
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.check_invariants(deep=True)
    ctl.close()


def test_copy_to_device_error_fails_the_load_and_releases_holds(tmp_path):
    engine, ctl, chain, snap = _disk_only(tmp_path)
    ctl.faults.copy_to_device = 1
    ok, pin = _pin_and_load(ctl, engine, chain)
    assert ok == LoadResult.FAILED  # failed, nothing left writing
    ctl.unpin(pin)
    assert ctl.stats()["failures"]["copy_error"] == 1
    _no_holds(ctl)
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.close()


def test_copy_to_host_error_fails_the_backup_and_indexes_nothing(tmp_path):
    layout = hybrid_layout()
    engine = Engine(layout)
    ctl = LocalController(controller_config(tmp_path))
    ctl.register(layout, PAGE, engine.pools)
    ctl.faults = FaultPlan(copy_to_host=1)
    chain = engine.write_chain(range(3 * PAGE))
    assert ctl.backup(chain.refs()).wait(5.0) is False
    assert ctl.stats()["entries"] == 0
    assert ctl.stats()["host"]["used_bytes"] == 0
    _no_holds(ctl)
    assert ctl.backup(chain.refs()).wait(5.0)
    assert ctl.lookup(chain.hashes, [FULL]).leading(FULL, Presence.HOST) == 3
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_copy_failure_in_a_later_chunk_keeps_the_chunks_copied_before_it(tmp_path):
    layout = hybrid_layout()
    engine = Engine(layout)
    ctl = LocalController(controller_config(tmp_path))
    ctl.register(layout, PAGE, engine.pools)
    ctl.config.backup_chunk_bytes = 2 * ctl.store.host_page_bytes()[FULL]
    chain = engine.write_chain(range(6 * PAGE), mamba_every=6)
    snap = engine.snapshot(chain)
    inner = ctl._copies.transfer.to_host
    calls = []

    def to_host(component, buffers, device_index, host_pages, ready_event=None):
        calls.append(component)
        if len(calls) == 3:
            raise RuntimeError("the device is gone")
        return inner(component, buffers, device_index, host_pages, ready_event)

    ctl._copies.transfer.to_host = to_host
    refs = chain.refs()  # per page FULL, SWA; page 5 also MAMBA
    assert ctl.backup(refs).wait(5.0) is False
    assert ctl.stats()["failures"]["copy_error"] == 1
    assert ctl.flush(5.0)  # the kept parts' disk write-through, which holds their pages
    _no_holds(ctl)
    # Parts go one component after the other and close at 2 FULL pages' bytes: FULL 0-1,
    # FULL 2-3 were copied and are kept; the copy of FULL 4-5 failed and gave its host
    # pages back; the SWA and Mamba parts were never started.
    assert calls == [FULL, FULL, FULL]
    held = ctl.lookup(chain.hashes, ALL)
    assert held.leading(FULL, Presence.HOST) == 4 and held.leading(SWA, Presence.HOST) == 0
    assert ctl.stats()["entries"] == 4
    assert ctl.stats()["host"]["used_bytes"] == 4 * ctl.store.host_page_bytes()[FULL]
    ctl._copies.transfer.to_host = inner
    assert ctl.backup(refs).wait(5.0)
    assert ctl.stats()["backup"]["deduped_pages"] == 4
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_failed_copy_waits_for_the_copies_its_part_already_issued(tmp_path):
    """A part's second copy fails while its first may still run on the GPU: the host pages
    go back only after the first copy's event has been waited for."""
    layout = hybrid_layout()
    engine = Engine(layout)
    ctl = LocalController(controller_config(tmp_path))
    ctl.register(layout, PAGE, engine.pools)
    ctl.config.backup_chunk_bytes = 0  # one part: a FULL copy, then an SWA copy
    chain = engine.write_chain(range(3 * PAGE), mamba_every=3)
    inner = ctl._copies.transfer.to_host
    order = []

    class RunningCopy:  # a CUDA event of a copy still in flight
        def synchronize(self):
            order.append(("waited", ctl.stats()["host"]["used_bytes"]))

        def query(self):
            return False

    def to_host(component, buffers, device_index, host_pages, ready_event=None):
        if component is SWA:
            raise RuntimeError("the second copy of the part failed")
        inner(component, buffers, device_index, host_pages, ready_event)
        return RunningCopy()

    ctl._copies.transfer.to_host = to_host
    assert ctl.backup(chain.refs()).wait(5.0) is False
    # Waited while the part's host pages were still taken; given back only afterwards.
    assert order and order[0][1] > 0
    assert ctl.stats()["host"]["used_bytes"] == 0
    assert ctl.stats()["entries"] == 0
    _no_holds(ctl)
    ctl._copies.transfer.to_host = inner
    assert ctl.backup(chain.refs()).wait(5.0)
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_running_backup_keeps_its_engines_buffers_until_it_is_published(tmp_path):
    """An engine leaves (a sidecar drops its connection) while its backup's copy still
    runs on the GPU: the copy's source memory must stay held until the copy has ended,
    then be let go."""
    layout = hybrid_layout()
    engine = Engine(layout)
    ctl = LocalController(controller_config(tmp_path))
    ctl.register(layout, PAGE, engine.pools, "leaving")
    chain = engine.write_chain(range(3 * PAGE), mamba_every=3)
    inner = ctl._copies.transfer.to_host
    done = threading.Event()

    class RunningCopy:  # a CUDA event of a copy in flight until ``done``
        def synchronize(self):
            done.wait(5.0)

        def query(self):
            return done.is_set()

    def to_host(component, buffers, device_index, host_pages, ready_event=None):
        inner(component, buffers, device_index, host_pages, ready_event)
        return RunningCopy()

    ctl._copies.transfer.to_host = to_host
    handle = ctl.backup(chain.refs(), engine_id="leaving")
    buffers = weakref.ref(ctl._engines["leaving"])
    # The engine is gone from the controller (as when its connection was replaced while
    # the backup ran); only the queued copy may still hold its buffers.
    with ctl._lock:
        ctl._engines.pop("leaving")
    gc.collect()
    assert buffers() is not None, "the running copy's source was let go"
    done.set()
    assert handle.wait(5.0)
    gc.collect()
    assert buffers() is None, "a published backup still holds the engine's buffers"
    assert ctl.flush(10.0)  # the pages' disk writes too
    _no_holds(ctl)
    ctl.check_invariants(deep=True)
    ctl.close()


def test_slow_disk_times_the_load_out_and_the_reads_finish_later(tmp_path):
    engine, ctl, chain, snap = _disk_only(tmp_path)
    ctl.faults.disk_read_delay_s = 0.3
    ok, pin = _pin_and_load(ctl, engine, chain, timeout_s=0.02)
    assert ok == LoadResult.FAILED  # failed, nothing left writing
    ctl.unpin(pin)
    assert ctl.stats()["failures"]["load_timeout"] == 1
    ctl.check_invariants()  # consistent with the reads still in flight
    assert ctl.prefetch(chain.page_keys()).wait(10.0)  # waits for the same reads
    _no_holds(ctl)
    assert ctl.lookup(chain.hashes, [FULL]).leading(FULL, Presence.HOST) == 4
    ctl.faults.disk_read_delay_s = 0.0
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.close()


def test_a_page_evicted_meanwhile_fails_the_load(tmp_path):
    engine, ctl, chain, _ = _disk_only(tmp_path)
    ctl.faults.evict_before_load = 1
    ok, pin = _pin_and_load(ctl, engine, chain)
    assert ok == LoadResult.FAILED  # failed, nothing left writing
    ctl.unpin(pin)
    ctl.unpin(pin)  # twice: harmless
    assert ctl.stats()["failures"]["page_absent"] == 1
    _no_holds(ctl)
    last = chain.refs()[-1].key
    assert ctl.store.tiers_of([last]) == [frozenset()]
    assert ctl.pin([last], 5.0) is None  # a miss now
    ctl.check_invariants(deep=True)
    ctl.close()


@pytest.mark.parametrize(
    "direct, way", [(True, "disk_to_device"), (False, "disk_to_host")]
)  # read straight into its slot (CPU pools), or into a host page again
def test_a_host_copy_evicted_meanwhile_is_read_again_from_disk(tmp_path, direct, way):
    engine, ctl, chain, snap = _disk_only(tmp_path, disk_load_direct=direct)
    assert ctl.prefetch(chain.page_keys()).wait(5.0)  # everything on host now
    on_host = sum(ctl.stats()["host"]["used_pages"].values())
    ctl.faults.evict_host_before_load = 1
    before = ctl.stats()["transfer"]
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    after = ctl.stats()["transfer"]
    assert after[way]["pages"] == before.get(way, {"pages": 0})["pages"] + 1
    assert after["disk_to_host"]["pages"] == before["disk_to_host"]["pages"] + (not direct)
    # Read straight into its slot, the page is on disk only now; else on host again.
    assert sum(ctl.stats()["host"]["used_pages"].values()) == on_host - direct
    _no_holds(ctl)
    ctl.check_invariants(deep=True)
    ctl.close()


def test_an_expired_pin_fails_the_load_and_frees_its_pages(tmp_path):
    engine, ctl, chain, _ = _disk_only(tmp_path)
    target = engine.place(chain.hashes, chain.parents, sorted(chain.mamba_slots))
    refs = target.refs()
    pin = ctl.pin([r.key for r in refs], 0.01)
    time.sleep(0.05)
    assert ctl.load(refs, pin, 5.0) == LoadResult.FAILED  # failed, nothing left writing
    assert ctl.stats()["failures"]["pin_expired"] == 1
    assert ctl.stats()["pins"]["expired"] == 1
    ctl.unpin(pin)  # after expiry: harmless
    _no_holds(ctl)
    ctl.close()


def test_pin_ttl_is_capped_and_must_be_positive(tmp_path):
    engine, ctl, chain, _ = _disk_only(tmp_path, pin_ttl_max_s=2.0, pin_ttl_default_s=1.0)
    pin = ctl.pin(chain.page_keys(), 3600.0)
    assert pin.deadline - time.monotonic() <= 2.0
    with pytest.raises(ControllerError, match="ttl_s"):
        ctl.pin(chain.page_keys(), 0.0)
    ctl.unpin(pin)
    _no_holds(ctl)
    ctl.close()


def test_disk_write_error_keeps_pages_on_host_only(tmp_path):
    layout = hybrid_layout()
    engine = Engine(layout)
    ctl = LocalController(controller_config(tmp_path))
    ctl.register(layout, PAGE, engine.pools)
    # Every writer transaction fails: the nine pages may reach the writer in one batch or
    # in several, as the backup's parts are published.
    ctl.faults = FaultPlan(disk_write=1000)
    chain = engine.write_chain(range(3 * PAGE))
    assert ctl.backup(chain.refs()).wait(5.0)
    ctl.flush()
    assert ctl.stats()["failures"]["disk_write_error"] == 9
    assert all(t == frozenset({Tier.HOST}) for t in ctl.store.tiers_of(chain.page_keys()))
    _no_holds(ctl)
    ctl.check_invariants(deep=True)
    ctl.close()


def test_lookup_answers_while_a_load_waits_on_a_slow_disk(tmp_path):
    engine, ctl, chain, _ = _disk_only(tmp_path)
    ctl.faults.disk_read_delay_s = 0.3  # 9 reads on 2 reader threads: 1.5 s
    result = {}
    loader = threading.Thread(target=lambda: result.update(ok=_pin_and_load(ctl, engine, chain)))
    loader.start()
    time.sleep(0.05)
    lookup = ctl.lookup(chain.hashes, ALL)  # the index only: no wait on the reads
    assert loader.is_alive()
    assert lookup.leading(FULL, Presence.DISK) == 4
    loader.join()
    ok, pin = result["ok"]
    assert ok
    ctl.unpin(pin)
    _no_holds(ctl)
    ctl.close()
