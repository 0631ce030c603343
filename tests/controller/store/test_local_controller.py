"""LocalController end to end on a real LMDB environment: device → host → disk and back."""

from __future__ import annotations

import time
from concurrent.futures import Future

import lmdb
import numpy as np
import pytest

from hicache.controller.admin import ops as admin_ops
from hicache.controller.config import DiskWritePolicy
from hicache.controller.store.local import ControllerLayoutMismatch, LocalController
from hicache.controller.store.page_codec import HEADER_BYTES
from hicache.controller_api import CacheController, ControllerError, LoadResult, PageKey, Presence
from hicache.types import LayoutMismatchError, Tier
from tests.support.controller import (
    ALL,
    FULL,
    MAMBA,
    PAGE,
    SWA,
    Engine,
    assert_same_bytes,
    controller_config,
    hybrid_layout,
    load_into,
    registered_controller,
)


def _store(ctl, chain) -> None:
    assert ctl.backup(chain.refs()).wait(10.0)
    ctl.check_invariants()


def _presence(ctl, chain, component=FULL) -> list[int]:
    return ctl.lookup(chain.hashes, [component]).presence[component].tolist()


def test_controller_implements_the_protocol(tmp_path):
    _, _, ctl = registered_controller(tmp_path)
    assert isinstance(ctl, CacheController)
    assert isinstance(ctl.session("e1"), CacheController)
    ctl.close()


def test_backup_then_load_into_other_slots_is_bit_for_bit(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(6 * PAGE), mamba_every=2)
    before = engine.snapshot(chain)
    _store(ctl, chain)
    engine.scribble(chain)  # the engine reuses its slots
    lookup = ctl.lookup(chain.hashes, ALL)
    assert lookup.leading(FULL, Presence.HOST) == 6
    assert lookup.leading(SWA, Presence.HOST) == 6
    assert lookup.presence[MAMBA].tolist() == [0, 1, 0, 1, 0, 1]

    target = load_into(ctl, engine, chain)
    assert_same_bytes(engine.snapshot(target), before)
    ctl.check_invariants(deep=True)
    stats = ctl.stats()
    assert stats["transfer"]["host_to_device"]["pages"] == 6 + 6 + 3
    assert stats["disk"]["pages"] == {"full": 6, "swa": 6, "mamba": 3}
    ctl.close()


def _count_copies(ctl) -> list[tuple]:
    """Wrap the controller's device → host copy; the list gets each copy's component and
    page count."""
    calls: list[tuple] = []
    inner = ctl._copies.transfer.to_host

    def to_host(component, buffers, device_index, host_pages, ready_event=None):
        calls.append((component, len(host_pages)))
        return inner(component, buffers, device_index, host_pages, ready_event)

    ctl._copies.transfer.to_host = to_host
    return calls


def test_a_backup_larger_than_a_chunk_is_copied_in_parts_and_stored_whole(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    full_bytes = ctl.store.host_page_bytes()[FULL]
    ctl.config.backup_chunk_bytes = 2 * full_bytes  # a chunk closes at 2 FULL pages' bytes
    copies = _count_copies(ctl)
    chain = engine.write_chain(range(8 * PAGE), mamba_every=2)
    before = engine.snapshot(chain)
    refs = chain.refs()
    # A duplicate of the first page in a later chunk is found already being backed up.
    assert ctl.backup([*refs, refs[0]]).wait(10.0)
    ctl.check_invariants(deep=True)
    # Parts go one component after the other: FULL pages two to a part, SWA pages (half
    # the bytes here) four, then the Mamba states.
    assert [c for c, _ in copies] == sorted(c for c, _ in copies)
    assert [k for c, k in copies if c is FULL] == [2, 2, 2, 2]
    assert [k for c, k in copies if c is SWA] == [4, 4]
    assert sum(k for _, k in copies) == len(refs)
    stats = ctl.stats()
    assert stats["backup"]["stored_pages"] == len(refs) == 8 + 8 + 4
    assert stats["transfer"]["device_to_host"]["pages"] == len(refs)
    engine.scribble(chain)
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), before)
    # 0 turns chunking off: one copy per component.
    ctl.config.backup_chunk_bytes = 0
    copies.clear()
    other = engine.write_chain(range(100 * PAGE, 108 * PAGE), mamba_every=2)
    assert ctl.backup(other.refs()).wait(10.0)
    assert sorted(k for _, k in copies) == [4, 8, 8]
    ctl.check_invariants(deep=True)
    ctl.close()


def test_backup_time_counts_overlapping_parts_once(tmp_path):
    """Parts in flight at once (or backups of two engines) count their union as transfer
    time, so bytes / seconds is the throughput, not a fraction of it."""
    from hicache.controller.store.fills import QueuedBackup

    _, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(4 * PAGE))
    refs = chain.refs([FULL])
    store = ctl.store
    t_start = time.perf_counter() - 1.0  # both parts began a second ago
    parts = []
    for ref in (refs[:2], refs[2:]):
        fill = Future()
        booked = store.book_backup(ref, 0, 1 << 30, set(), fill)
        parts.append(QueuedBackup(booked.plan, [], t_start, fill))
    for part in parts:
        store.backup_copied(part)
    ctl.check_invariants()
    d2h = ctl.stats()["transfer"]["device_to_host"]
    assert d2h["pages"] == 4
    assert 1.0 <= d2h["seconds"] < 1.5  # not 2: the second part's second overlapped
    ctl.close()


def test_transfer_seconds_are_the_union_of_overlapping_transfers():
    from hicache.controller.store.counters import Counters

    c = Counters()
    c.transfer("disk_to_host", 1, 100, 1.0)  # two reads of a second, at once
    c.transfer("disk_to_host", 1, 100, 1.0)
    c.transfer("host_to_disk", 1, 100, 1.0)  # another direction counts on its own
    time.sleep(0.05)
    c.transfer("disk_to_host", 1, 100, 0.01)  # after a gap: all of it counts
    snap = c.snapshot()["transfer"]
    assert snap["disk_to_host"]["bytes"] == 300 and snap["disk_to_host"]["pages"] == 3
    assert 1.01 <= snap["disk_to_host"]["seconds"] < 1.05
    assert 1.0 <= snap["host_to_disk"]["seconds"] < 1.05


def test_backup_dedupes_pages_already_held(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(3 * PAGE))
    _store(ctl, chain)
    _store(ctl, chain)
    stats = ctl.stats()
    assert stats["backup"]["stored_pages"] == 9  # 3 FULL, 3 SWA, 3 Mamba states
    assert stats["backup"]["deduped_pages"] == 9
    assert stats["transfer"]["device_to_host"]["pages"] == 9
    ctl.close()


def test_host_evicted_pages_come_back_from_disk(tmp_path):
    # Room for about 40 FULL host pages; 4 chains of 16 pages overflow it.
    _, engine, ctl = registered_controller(tmp_path, host_pool_bytes=40 * (512 + 256 + 168 // 4))
    chains = [
        engine.write_chain(range(k, k + 16 * PAGE), mamba_every=4) for k in (0, 1000, 2000, 3000)
    ]
    snaps = [engine.snapshot(c) for c in chains]
    for c in chains:
        _store(ctl, c)
        # Pages queued for the writer are held on host: let it catch up, as a disk that
        # keeps pace would (a backup meeting a host full of queued pages fails instead).
        ctl.flush()
    first = _presence(ctl, chains[0])
    assert Presence.DISK in first and Presence.ABSENT not in first
    for c, snap in zip(chains, snaps):
        assert_same_bytes(engine.snapshot(load_into(ctl, engine, c)), snap)
        ctl.check_invariants()
    assert ctl.stats()["evictions"]["host"]["full"] > 0
    ctl.check_invariants(deep=True)
    ctl.close()


def test_restart_finds_every_page_and_loads_it_bit_for_bit(tmp_path):
    layout, engine, ctl = registered_controller(tmp_path, disk_sync=True)
    chains = [engine.write_chain(range(k, k + 5 * PAGE), mamba_every=5) for k in (0, 500)]
    snaps = [engine.snapshot(c) for c in chains]
    for c in chains:
        _store(ctl, c)
    ctl.close()  # drains the writer

    engine2 = Engine(layout, seed=1)  # a fresh engine process: new pools, same layout
    ctl2 = LocalController(controller_config(tmp_path))
    ctl2.register(layout, PAGE, engine2.pools)
    for c, snap in zip(chains, snaps):
        lookup = ctl2.lookup(c.hashes, ALL)
        assert lookup.leading(FULL, Presence.DISK) == 5
        assert lookup.leading(SWA, Presence.DISK) == 5
        assert lookup.presence[MAMBA][-1] == Presence.DISK
        assert_same_bytes(engine2.snapshot(load_into(ctl2, engine2, c)), snap)
    ctl2.check_invariants(deep=True)
    ctl2.close()


def test_write_back_writes_at_host_eviction_and_at_close(tmp_path):
    layout, engine, ctl = registered_controller(
        tmp_path,
        host_pool_bytes=12 * (512 + 256 + 168 // 4),
        disk_write_policy=DiskWritePolicy.WRITE_BACK,
    )
    first = engine.write_chain(range(8 * PAGE), mamba_every=8)
    snap = engine.snapshot(first)
    _store(ctl, first)
    ctl.flush()
    assert ctl.stats()["disk"]["pages"]["full"] == 0  # nothing written yet
    second = engine.write_chain(range(1000, 1000 + 8 * PAGE), mamba_every=8)
    _store(ctl, second)
    ctl.flush()
    assert Presence.DISK in _presence(ctl, first)  # evicted pages went to disk
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, first)), snap)
    ctl.check_invariants(deep=True)
    ctl.close()  # writes what is only on host

    ctl2 = LocalController(controller_config(tmp_path))
    ctl2.register(layout, PAGE, engine.pools)
    for c in (first, second):
        assert ctl2.lookup(c.hashes, [FULL]).leading(FULL) == 8
    ctl2.close()


def _flip_byte(tmp_path, key: bytes, offset: int) -> None:
    env = lmdb.open(str(tmp_path / "lmdb"), map_size=1 << 30)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(key))
        value[offset] ^= 0x40
        txn.put(key, bytes(value))
    env.close()


@pytest.mark.parametrize("direct", [True, False])  # read into the slots, or into host pages
def test_corrupt_payload_is_never_served_and_is_counted(tmp_path, direct):
    layout, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(4 * PAGE))
    _store(ctl, chain)
    ctl.close()
    bad = chain.refs([FULL])[2].key
    _flip_byte(tmp_path, bad.storage_key(), HEADER_BYTES + 100)

    ctl = LocalController(controller_config(tmp_path, disk_load_direct=direct))
    ctl.register(layout, PAGE, engine.pools)
    assert _presence(ctl, chain) == [2, 2, 2, 2]  # the index knows only headers
    target = engine.place(chain.hashes, chain.parents)
    refs = target.refs([FULL])
    pin = ctl.pin([r.key for r in refs], 5.0)
    assert ctl.load(refs, pin, 5.0) == LoadResult.FAILED  # failed, nothing left writing
    ctl.unpin(pin)
    assert ctl.stats()["failures"]["checksum"] == 1
    # The bad page is gone, a miss now; the others read stay on disk only (direct) or
    # are on host as well.
    kept = 2 if direct else 1
    assert _presence(ctl, chain) == [kept, kept, 0, kept]
    ctl.check_invariants(deep=True)  # and deleted from LMDB
    ctl.close()


@pytest.mark.parametrize("direct", [True, False])
def test_a_corrupt_page_fails_its_read_batch_alone(tmp_path, direct):
    """Disk pages are read in batches (one reader, one transaction each): a corrupt value
    amid a batch is dropped, the others of the batch are served, every byte exact."""
    layout, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(12 * PAGE))
    _store(ctl, chain)
    ctl.close()
    bad = chain.refs([FULL])[5].key
    _flip_byte(tmp_path, bad.storage_key(), HEADER_BYTES + 7)

    ctl = LocalController(controller_config(tmp_path, reader_threads=1, disk_load_direct=direct))
    ctl.register(layout, PAGE, engine.pools)
    target = engine.place(chain.hashes, chain.parents)
    refs = target.refs([FULL])
    pin = ctl.pin([r.key for r in refs], 5.0)
    assert ctl.load(refs, pin, 5.0) == LoadResult.FAILED
    ctl.unpin(pin)
    ctl.check_invariants(deep=True)
    assert ctl.stats()["failures"]["checksum"] == 1
    kept = 2 if direct else 1  # the others stayed on disk only (direct), or reached host
    assert _presence(ctl, chain) == [kept] * 5 + [0] + [kept] * 6
    good = {r.key for r in chain.refs([FULL])} - {bad}
    got = load_into(ctl, engine, chain, [FULL], only=good)
    want = {k: v for k, v in engine.snapshot(chain).items() if k[0] is FULL and k[1] != 5}
    assert_same_bytes({k: v for k, v in engine.snapshot(got).items() if k in want}, want)
    ctl.check_invariants(deep=True)
    ctl.close()


def _corrupt_a_stored_page(ctl, engine):
    """Store a 3-page chain on disk and flip a bit in its second FULL page's LMDB value;
    returns the chain, that page's storage key and its good value."""
    chain = engine.write_chain(range(3 * PAGE))
    _store(ctl, chain)
    assert ctl.flush(10.0)
    bad = chain.refs([FULL])[1].key.storage_key()
    with ctl.store._disk.lmdb.env.begin(write=True) as txn:
        good = bytes(txn.get(bad))
        value = bytearray(good)
        value[HEADER_BYTES + 3] ^= 0x10
        txn.put(bad, bytes(value))
    return chain, bad, good


def test_fsck_repair_returns_once_the_corrupt_value_is_gone_from_lmdb(tmp_path):
    """A repair reports a value repaired only when its delete is committed: a check right
    after it (``hicachectl fsck`` twice in a row) must not find the value again. A slow
    writer batch interval makes the old behaviour (return with the delete still queued)
    fail every time."""
    from hicache.controller.admin.ops import fsck

    _, engine, ctl = registered_controller(tmp_path, writer_flush_interval_s=0.5)
    chain, bad, _ = _corrupt_a_stored_page(ctl, engine)
    env = ctl.store._disk.lmdb.env
    first = fsck(ctl, repair=True)
    assert (first.corrupt, first.repaired) == (1, 1)
    with env.begin() as txn:
        assert txn.get(bad) is None
    again = fsck(ctl)
    assert again.corrupt == 0 and again.ok == first.ok
    # The host copy was never corrupt and stays; the disk copy is gone from the index too.
    tiers = ctl.store.tiers_of([r.key for r in chain.refs([FULL])])
    assert tiers == [{Tier.HOST, Tier.DISK}, {Tier.HOST}, {Tier.HOST, Tier.DISK}]
    ctl.check_invariants(deep=True)
    ctl.close()


def test_admin_clear_and_evict_return_once_the_disk_values_are_gone(tmp_path):
    """What ``clear`` and ``evict`` report dropped from disk is gone from LMDB when they
    return (a crash right after them must not bring it back), however slow the writer."""
    from hicache.controller.admin.ops import clear, evict

    _, engine, ctl = registered_controller(tmp_path, writer_flush_interval_s=0.5)
    a = engine.write_chain(range(3 * PAGE))
    b = engine.write_chain(range(100, 100 + 2 * PAGE))
    _store(ctl, a)
    _store(ctl, b)
    assert ctl.flush(10.0)
    env = ctl.store._disk.lmdb.env

    def on_disk(chain) -> list[bool]:
        with env.begin() as txn:
            return [txn.get(r.key.storage_key()) is not None for r in chain.refs()]

    assert all(on_disk(a)) and all(on_disk(b))
    page = ctl.store._index.get(a.refs([FULL])[0].key.storage_key()).disk_nbytes
    freed = evict(ctl, Tier.DISK, page)  # the least recently used chain's tail first
    assert freed["pages"] >= 1
    assert sum(not x for x in on_disk(a) + on_disk(b)) == freed["pages"]
    ctl.check_invariants(deep=True)
    res = clear(ctl, None, [Tier.DISK])
    assert res.disk_pages + freed["pages"] == len(a.refs()) + len(b.refs())
    assert not any(on_disk(a)) and not any(on_disk(b))
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_clear_right_after_a_backup_drops_its_pages_from_every_tier(tmp_path):
    """A page stored just before a clear (its disk write still queued behind a slow
    writer) is dropped by the clear, not kept as in flight and written to disk after it."""
    _, engine, ctl = registered_controller(tmp_path, writer_flush_interval_s=0.5)
    chain = engine.write_chain(range(3 * PAGE))
    _store(ctl, chain)
    res = admin_ops.clear(ctl, None, [Tier.HOST, Tier.DISK])
    assert res.kept_pages == 0 and res.host_pages == res.disk_pages == len(chain.refs())
    assert ctl.flush(10.0)
    assert ctl.store.tiers_of(chain.page_keys()) == [set()] * len(chain.refs())
    with ctl.store._disk.lmdb.env.begin() as txn:
        assert all(txn.get(r.key.storage_key()) is None for r in chain.refs())
    ctl.check_invariants(deep=True)
    ctl.close()


def test_corrupt_header_is_dropped_when_the_index_is_rebuilt(tmp_path):
    layout, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(3 * PAGE))
    _store(ctl, chain)
    ctl.close()
    _flip_byte(tmp_path, chain.refs([FULL])[1].key.storage_key(), 30)  # in the parent hash

    ctl = LocalController(controller_config(tmp_path))
    ctl.register(layout, PAGE, engine.pools)
    assert _presence(ctl, chain) == [2, 0, 2]
    assert ctl.stats()["disk"]["invalid_dropped"] == 1
    ctl.check_invariants(deep=True)
    ctl.close()


def test_pages_of_another_layout_are_never_served(tmp_path):
    layout, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(3 * PAGE))
    _store(ctl, chain)
    ctl.close()

    other = hybrid_layout(head_dim=16)
    engine_b = Engine(other)
    ctl_b = LocalController(controller_config(tmp_path))
    ctl_b.register(other, PAGE, engine_b.pools)
    assert ctl_b.lookup(chain.hashes, ALL).leading(FULL) == 0
    stats = ctl_b.stats()
    assert stats["disk"]["foreign_pages"] == 9 and stats["entries"] == 0
    ctl_b.check_invariants(deep=True)
    ctl_b.close()


def _on_disk(ctl, keys) -> list[int]:
    return [int(Tier.DISK in t) for t in ctl.store.tiers_of(keys)]


def test_tiny_disk_budget_evicts_lru_chains_from_the_tail(tmp_path):
    page_value = 512 + HEADER_BYTES
    _, engine, ctl = registered_controller(tmp_path, disk_budget_bytes=10 * page_value)
    old = engine.write_chain(range(6 * PAGE))
    new = engine.write_chain(range(1000, 1000 + 6 * PAGE))
    for c in (old, new):
        assert ctl.backup(c.refs([FULL])).wait()
        ctl.flush()
        ctl.check_invariants()
    stats = ctl.stats()
    assert stats["disk"]["live_bytes"] <= 10 * page_value
    # The older chain keeps its head and loses its tail; the newer one is whole.
    assert _on_disk(ctl, old.page_keys([FULL])) == [1, 1, 1, 1, 0, 0]
    assert _on_disk(ctl, new.page_keys([FULL])) == [1] * 6
    assert stats["evictions"]["disk"]["full"] == 2
    ctl.check_invariants(deep=True)
    ctl.close()


def test_tiny_map_size_rejects_pages_with_a_clear_error_and_keeps_committed_ones(tmp_path):
    # A 64 KiB budget in an 80 KiB map: LMDB's own pages make the map fill first.
    sizes = dict(disk_budget_bytes=64 << 10, lmdb_map_size_bytes=80 << 10)
    layout, engine, ctl = registered_controller(tmp_path, writer_batch_pages=4, **sizes)
    chains = [
        engine.write_chain(range(k, k + 8 * PAGE), mamba_every=8) for k in range(0, 12000, 1000)
    ]
    snaps = [engine.snapshot(c) for c in chains]
    for c in chains:
        _store(ctl, c)
        ctl.flush()
    stats = ctl.stats()
    assert stats["disk"]["map_full_events"] > 0
    assert stats["disk"]["live_bytes"] <= 64 << 10
    ctl.check_invariants(deep=True)
    ctl.close()

    # After a restart (no host copies), every page the index has loads back bit for bit.
    ctl = LocalController(controller_config(tmp_path, **sizes))
    ctl.register(layout, PAGE, engine.pools)
    found = 0
    for c, snap in zip(chains, snaps):
        keys = c.page_keys()
        held = {k for k, on in zip(keys, _on_disk(ctl, keys)) if on}
        if not held:
            continue
        target = load_into(ctl, engine, c, only=held)
        loaded = {
            (comp, i): b
            for (comp, i), b in engine.snapshot(target).items()
            if PageKey(comp, c.hashes[i]) in held
        }
        assert_same_bytes(loaded, snap)
        found += len(held)
    assert found > 0
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_second_layout_is_refused(tmp_path):
    layout, engine, ctl = registered_controller(tmp_path)
    other = Engine(hybrid_layout(head_dim=16))
    with pytest.raises(ControllerLayoutMismatch) as info:
        ctl.register(other.layout, PAGE, other.pools, engine_id="other")
    assert isinstance(info.value, LayoutMismatchError)
    assert isinstance(info.value, ControllerError)
    assert ctl.engines == ["local"]
    ctl.close()


def test_engines_share_pages_and_a_closed_session_loses_its_pins(tmp_path):
    layout = hybrid_layout()
    ctl = LocalController(controller_config(tmp_path))
    a, b = Engine(layout, seed=1), Engine(layout, seed=2)
    sa, sb = ctl.session("a"), ctl.session("b")
    sa.register(layout, PAGE, a.pools)
    sb.register(layout, PAGE, b.pools)
    chain = a.write_chain(range(3 * PAGE))
    snap = a.snapshot(chain)
    assert sa.backup(chain.refs()).wait(5.0)
    assert_same_bytes(b.snapshot(load_into(ctl, b, chain, engine_id="b")), snap)

    pin = sb.pin(chain.page_keys(), 60.0)
    with pytest.raises(ControllerError):
        sa.unpin(pin)  # not a's pin
    sb.close()
    assert ctl.stats()["pins_active"] == 0
    assert ctl.engines == ["a"]
    ctl.check_invariants()
    ctl.close()


def test_pin_is_all_or_nothing(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(3 * PAGE))
    _store(ctl, chain)
    missing = engine.write_chain(range(900, 900 + PAGE))
    assert ctl.pin(chain.page_keys() + missing.page_keys(), 5.0) is None
    assert ctl.stats()["pins_active"] == 0
    assert all(ctl.store._index.get(k.storage_key()).pins == 0 for k in chain.page_keys())
    ctl.check_invariants()
    ctl.close()


def test_closed_controller_refuses_calls_and_close_is_idempotent(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    ctl.close()
    ctl.close()
    with pytest.raises(ControllerError, match="closed"):
        ctl.lookup([b"\0" * 16], [FULL])


def test_bad_refs_are_refused_with_a_clear_error(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(PAGE))
    ref = chain.refs([FULL])[0]
    bad = type(ref)(FULL, ref.page_hash, ref.parent_hash, 10**6)
    with pytest.raises(ControllerError, match="outside"):
        ctl.backup([bad])
    with pytest.raises(ControllerError, match="not registered"):
        ctl.backup([ref], engine_id="nobody")
    ctl.check_invariants()
    assert np.all(ctl.lookup(chain.hashes, [FULL]).presence[FULL] == 0)
    ctl.close()


def test_backup_reports_host_full_when_no_host_page_can_be_evicted(tmp_path):
    # No disk tier; room for about 8 FULL pages, all pinned by a pending load.
    _, engine, ctl = registered_controller(
        tmp_path, disk_path=None, host_pool_bytes=8 * (512 + 256 + 42)
    )
    held = engine.write_chain(range(8 * PAGE), mamba_every=8)
    _store(ctl, held)
    pin = ctl.pin(held.page_keys(), 30.0)
    more = engine.write_chain(range(1000, 1000 + 2 * PAGE), mamba_every=2)
    assert ctl.backup(more.refs()).wait(5.0) is False
    assert ctl.stats()["failures"]["host_full"] > 0
    assert ctl.lookup(held.hashes, [FULL]).leading(FULL, Presence.HOST) == 8
    ctl.check_invariants()
    ctl.unpin(pin)
    _store(ctl, more)  # unpinned pages make room again
    assert ctl.lookup(more.hashes, [FULL]).leading(FULL, Presence.HOST) == 2
    ctl.close()


def test_host_tier_cuts_chains_from_the_tail(tmp_path):
    _, engine, ctl = registered_controller(
        tmp_path, disk_path=None, host_pool_bytes=10 * (512 + 256 + 42)
    )
    old = engine.write_chain(range(6 * PAGE), mamba_every=6)
    _store(ctl, old)
    ctl.lookup(old.hashes[:1], [FULL])  # a lookup does not reorder eviction
    new = engine.write_chain(range(1000, 1000 + 6 * PAGE), mamba_every=6)
    _store(ctl, new)
    assert _presence(ctl, old) == [1, 1, 1, 1, 0, 0]
    assert _presence(ctl, new) == [1] * 6
    # SWA pages hang off their FULL pages: evicting the FULL page took them too.
    assert _presence(ctl, old, SWA) == [1, 1, 1, 1, 0, 0]
    assert ctl.stats()["evictions"]["host"] == {"full": 2, "swa": 2, "mamba": 1}
    ctl.check_invariants()
    ctl.close()


def test_verify_on_open_drops_a_corrupt_payload_before_serving(tmp_path):
    layout, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(3 * PAGE), mamba_every=3)
    _store(ctl, chain)
    ctl.close()
    _flip_byte(tmp_path, chain.refs([FULL])[1].key.storage_key(), HEADER_BYTES + 7)

    ctl = LocalController(controller_config(tmp_path, disk_verify_on_open=True))
    ctl.register(layout, PAGE, engine.pools)
    assert _presence(ctl, chain) == [2, 0, 2]
    assert ctl.stats()["disk"]["invalid_dropped"] == 1
    ctl.check_invariants(deep=True)
    ctl.close()


def test_prefetch_brings_disk_pages_to_host(tmp_path):
    layout, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(4 * PAGE), mamba_every=4)
    _store(ctl, chain)
    ctl.close()
    ctl = LocalController(controller_config(tmp_path))
    ctl.register(layout, PAGE, engine.pools)
    missing = engine.write_chain(range(900, 900 + PAGE))
    assert ctl.prefetch(missing.page_keys()).wait(5.0) is False  # not held anywhere
    handle = ctl.prefetch(chain.page_keys())
    assert handle.wait(5.0) and handle.done()
    assert all(Tier.HOST in t for t in ctl.store.tiers_of(chain.page_keys()))
    assert ctl.stats()["transfer"]["disk_to_host"]["pages"] == 9
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_smaller_budget_at_reopen_evicts_down_to_it_tail_first(tmp_path):
    page_value = 512 + HEADER_BYTES
    layout, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(8 * PAGE))
    assert ctl.backup(chain.refs([FULL])).wait(5.0)
    ctl.close()
    ctl = LocalController(controller_config(tmp_path, disk_budget_bytes=5 * page_value))
    ctl.register(layout, PAGE, engine.pools)
    ctl.flush()
    assert _on_disk(ctl, chain.page_keys([FULL])) == [1, 1, 1, 1, 1, 0, 0, 0]
    assert ctl.stats()["disk"]["live_bytes"] <= 5 * page_value
    ctl.check_invariants(deep=True)
    ctl.close()


def test_fsck_repair_leaves_a_value_stored_again_since_its_scan(tmp_path):
    """The scan runs outside the lock; a corrupt value may be dropped and stored again
    (a good copy, from a new backup) before the repair: the repair re-reads each value
    under the lock and deletes only what is still corrupt (it deleted the good copy)."""
    from hicache.controller.admin.ops import fsck

    _, engine, ctl = registered_controller(tmp_path)
    _, bad, good = _corrupt_a_stored_page(ctl, engine)
    env = ctl.store._disk.lmdb.env

    def stored_again(done, total):  # the scan's last progress call: the scan is over
        if done >= total:
            with env.begin(write=True) as txn:
                txn.put(bad, good)

    out = fsck(ctl, repair=True, progress=stored_again)
    assert out.corrupt == 1 and out.repaired == 0
    with env.begin() as txn:
        assert bytes(txn.get(bad)) == good
    assert fsck(ctl).corrupt == 0
    ctl.check_invariants(deep=True)
    ctl.close()
