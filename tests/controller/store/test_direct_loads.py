"""``disk_load_direct`` (on by default): a load into CPU pools reads its pages held only on
disk straight into the engine's slots (``controller/store/load_reads.py``), one copy,
checked there.
The bytes are exact for every component, the pages stay on disk only, a value that fails
its checks is never served (the load fails, the value is dropped), and a load that gave
up leaves nothing writing into the slots (test_load_copies.py)."""

from __future__ import annotations

import threading

import pytest

from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.page_codec import HEADER_BYTES
from hicache.controller.tiers import disk_tier
from hicache.controller.tiers.lmdb_tier import LmdbTier
from hicache.controller.tiers.prewarm import UseLog
from hicache.controller_api import LoadResult, PageRef, Presence
from hicache.types import ComponentType
from tests.support.controller import (
    FULL,
    assert_same_bytes,
    load_into,
    stored_then_restarted,
)


def _on_disk(tmp_path, pages: int, **overrides):
    """A chain stored, then a restart with direct loads on (the default, named here so
    that these tests keep it): every page on disk only."""
    overrides.setdefault("disk_load_direct", True)
    return stored_then_restarted(tmp_path, pages, **overrides)


def _on_host(ctl, chain) -> int:
    return sum(1 for e in ctl.store._index if e.host_page >= 0)


def _no_holds(ctl) -> None:
    assert ctl.stats()["pins_active"] == 0
    assert all(e.busy == 0 and e.pins == 0 and e.copies == 0 for e in ctl.store._index)


@pytest.mark.parametrize("reader_threads", [1, 3])
def test_pages_read_straight_into_the_slots_arrive_exact_and_stay_on_disk(tmp_path, reader_threads):
    engine, ctl, chain, snap = _on_disk(tmp_path, pages=40, reader_threads=reader_threads)
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.check_invariants(deep=True)
    _no_holds(ctl)
    assert _on_host(ctl, chain) == 0  # no host page was taken
    assert ctl.lookup(chain.hashes, [FULL]).leading(FULL, Presence.DISK) == len(chain.hashes)
    moved = ctl.stats()["transfer"]["disk_to_device"]
    assert moved["pages"] == len(chain.refs())
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)  # and again
    ctl.check_invariants(deep=True)
    ctl.close()


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("serial", [True, False])
def test_small_pages_are_read_on_the_serial_reader_and_large_on_the_pool_both_exact(
    tmp_path, monkeypatch, direct, serial
):
    """Pages below ``SERIAL_READ_BELOW_BYTES`` are read one batch after another on the
    serial reader thread, larger ones on the pool; either way the bytes are exact."""
    monkeypatch.setattr(disk_tier, "SERIAL_READ_BELOW_BYTES", (1 << 30) if serial else 0)
    threads: set[str] = set()
    for name in ("read_pieces", "read_many"):
        original = getattr(LmdbTier, name)

        def spy(self, *args, _original=original, **kwargs):
            threads.add(threading.current_thread().name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(LmdbTier, name, spy)
    engine, ctl, chain, snap = _on_disk(
        tmp_path, pages=40, reader_threads=2, disk_load_direct=direct
    )
    threads.clear()  # the reads at the restart's prewarm, if any
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.check_invariants(deep=True)
    _no_holds(ctl)
    assert threads
    on_serial = {t.startswith("hicache-lmdb-serial-reader") for t in threads}
    assert on_serial == {serial}
    ctl.close()


def test_pages_read_straight_into_the_slots_are_recorded_as_used_for_the_next_prewarm(
    tmp_path,
):
    engine, ctl, chain, snap = _on_disk(tmp_path, pages=4)
    assert UseLog(tmp_path / "lmdb").read() == {}  # stored, never loaded
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.close()  # the use log flushed
    assert set(UseLog(tmp_path / "lmdb").read()) == {k.storage_key() for k in chain.page_keys()}


def test_off_the_pages_read_stay_on_host(tmp_path):
    engine, ctl, chain, snap = _on_disk(tmp_path, pages=6, disk_load_direct=False)
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    assert ctl.lookup(chain.hashes, [FULL]).leading(FULL, Presence.HOST) == len(chain.hashes)
    assert "disk_to_device" not in ctl.stats()["transfer"]
    ctl.close()


def test_a_load_of_pages_on_host_and_on_disk_arrives_exact(tmp_path):
    engine, ctl, chain, snap = _on_disk(tmp_path, pages=12)
    half = set(chain.page_keys()[: len(chain.page_keys()) // 2])
    assert ctl.prefetch(list(half)).wait(10.0)  # those on host as well
    ctl.check_invariants()
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.check_invariants(deep=True)
    _no_holds(ctl)
    ctl.close()


def test_a_corrupt_value_fails_the_load_is_dropped_and_the_others_stay(tmp_path):
    engine, ctl, chain, snap = _on_disk(tmp_path, pages=12)
    bad = chain.refs([FULL])[5].key
    with ctl.store._disk.lmdb.env.begin(write=True) as txn:  # a bit flipped on disk
        value = bytearray(txn.get(bad.storage_key()))
        value[HEADER_BYTES + 7] ^= 0x40
        txn.put(bad.storage_key(), bytes(value))
    target = engine.place(chain.hashes, chain.parents, sorted(chain.mamba_slots))
    refs = target.refs()
    pin = ctl.pin([r.key for r in refs], 5.0)
    assert ctl.load(refs, pin, 5.0) == LoadResult.FAILED
    ctl.unpin(pin)
    assert ctl.stats()["failures"]["checksum"] == 1
    _no_holds(ctl)
    ctl.check_invariants(deep=True)  # the bad value is deleted from LMDB
    presence = ctl.lookup(chain.hashes, [FULL]).presence[FULL].tolist()
    assert presence == [2] * 5 + [0] + [2] * 6
    # The pages before it load, exact, from what stayed on disk.
    head = {r.key for r in chain.refs() if r.key.page_hash in chain.hashes[:5]}
    got = engine.snapshot(load_into(ctl, engine, chain, only=head))
    assert_same_bytes({k: v for k, v in got.items() if k[1] < 5}, snap)
    ctl.check_invariants(deep=True)
    ctl.close()


@pytest.mark.parametrize(
    "fault, counted", [("disk_read", "disk_read_error"), ("copy_to_device", "copy_error")]
)
def test_a_read_or_copy_failure_fails_the_load_and_keeps_the_pages(tmp_path, fault, counted):
    engine, ctl, chain, snap = _on_disk(tmp_path, pages=4)
    ctl.faults = FaultPlan(**{fault: 1})
    target = engine.place(chain.hashes, chain.parents, sorted(chain.mamba_slots))
    refs = target.refs()
    pin = ctl.pin([r.key for r in refs], 5.0)
    assert ctl.load(refs, pin, 5.0) == LoadResult.FAILED
    ctl.unpin(pin)
    assert ctl.stats()["failures"][counted] == 1
    _no_holds(ctl)
    # Either may be transient: the stored pages are kept and serve the retry.
    assert ctl.lookup(chain.hashes, [FULL]).leading(FULL, Presence.DISK) == len(chain.hashes)
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), snap)
    ctl.check_invariants(deep=True)
    ctl.close()


@pytest.mark.parametrize("direct", [True, False])
def test_a_page_named_twice_goes_through_host_into_both_slots(tmp_path, direct):
    engine, ctl, chain, snap = _on_disk(tmp_path, pages=3, disk_load_direct=direct)
    target = engine.place(chain.hashes[:2], chain.parents[:2])
    h, p = chain.hashes[0], chain.parents[0]
    refs = [PageRef(FULL, h, p, target.full_pages[0]), PageRef(FULL, h, p, target.full_pages[1])]
    pin = ctl.pin([refs[0].key], 5.0)
    assert ctl.load(refs, pin, 5.0) == LoadResult.LOADED
    ctl.unpin(pin)
    got = engine.snapshot(target)
    assert got[FULL, 0] == got[FULL, 1] == snap[FULL, 0]
    _no_holds(ctl)
    ctl.check_invariants(deep=True)
    ctl.close()


def test_direct_reads_cover_every_component_of_a_hybrid_layout(tmp_path):
    engine, ctl, chain, snap = _on_disk(tmp_path, pages=3)
    slots = ctl._copies.copy_as_read(chain.refs(), ctl._engines["local"])
    assert set(slots._geometry) == {ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA}
    slots.close()
    ctl.close()


def test_an_engines_own_disk_read_is_booked_by_the_pages_the_store_holds_on_disk(tmp_path):
    """An unpin saying the engine read pages only on disk itself books the pages and bytes
    of the pin the store holds on disk only (the engine sends only the seconds), and the
    pages stay on disk."""
    engine, ctl, chain, snap = _on_disk(tmp_path, pages=6)
    refs = chain.refs()
    keys = list(dict.fromkeys(r.key for r in refs))
    pin = ctl.pin(keys, 30.0)
    assert pin is not None
    ctl.unpin(pin, loaded_s=0.01, disk_s=0.001)
    moved = ctl.stats()["transfer"]["disk_to_device"]
    page_bytes = ctl.store.host_page_bytes()
    assert moved["pages"] == len(keys)
    assert moved["bytes"] == sum(page_bytes[k.component] for k in keys)
    assert ctl.stats()["load"]["engine_read"] == 1
    assert _on_host(ctl, chain) == 0
    ctl.check_invariants(deep=True)
    _no_holds(ctl)
    ctl.close()
