"""The warm start: last uses recorded beside LMDB, and the hottest pages read back to host
after a restart, never a page that fails its checksum."""

from __future__ import annotations

import time

from hicache.controller.store.local import LocalController
from hicache.controller.store.page_codec import HEADER_BYTES
from hicache.controller.tiers.prewarm import USE_LOG_NAME, UseLog
from hicache.controller_api import PageKey
from hicache.types import ComponentType, Tier
from tests.support.controller import (
    PAGE,
    assert_same_bytes,
    controller_config,
    load_into,
    registered_controller,
)

FULL = ComponentType.FULL


def _prewarmed(ctl: LocalController, timeout_s: float = 30.0) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        stats = ctl.stats()["disk"]["prewarm"]
        if stats["state"] in ("done", "off"):
            return stats
        time.sleep(0.01)
    raise AssertionError(f"the prewarm did not end: {stats}")


def _stored_bytes(ctl: LocalController, keys) -> int:
    with ctl.store._disk.lmdb.env.begin() as txn:
        return sum(len(txn.get(k.storage_key())) for k in keys)


def _two_chains(tmp_path):
    """Chain ``hot`` stored first and loaded later, chain ``cold`` stored after it and never
    loaded: ``hot`` is the more recently used though ``cold`` was written last."""
    layout, engine, ctl = registered_controller(tmp_path, host_pool_bytes=4 << 20)
    hot = engine.write_chain(range(6 * PAGE))
    assert ctl.backup(hot.refs()).wait(10.0)
    cold = engine.write_chain(range(1000, 1000 + 6 * PAGE))
    assert ctl.backup(cold.refs()).wait(10.0)
    assert ctl.flush(10.0)
    time.sleep(0.01)  # the load's use is later than every write
    load_into(ctl, engine, hot)
    ctl.check_invariants()
    budget = _stored_bytes(ctl, hot.page_keys())
    ctl.close()
    assert (tmp_path / "lmdb" / USE_LOG_NAME).stat().st_size > 0
    return layout, engine, hot, cold, budget


def test_the_prewarm_brings_back_the_most_recently_used_pages_first(tmp_path):
    layout, engine, hot, cold, budget = _two_chains(tmp_path)
    snap = engine.snapshot(hot)

    ctl = LocalController(controller_config(tmp_path, prewarm_bytes=budget))
    ctl.register(layout, PAGE, engine.pools)
    stats = _prewarmed(ctl)
    ctl.check_invariants(deep=True)

    assert stats["target_bytes"] == stats["bytes_read"] == budget
    assert stats["pages_read"] == len(hot.page_keys())
    assert all(Tier.HOST in t for t in ctl.store.tiers_of(hot.page_keys()))
    assert not any(Tier.HOST in t for t in ctl.store.tiers_of(cold.page_keys()))
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, hot)), snap)  # host hits
    ctl.check_invariants(deep=True)
    ctl.close()


def test_without_recorded_uses_the_last_written_pages_come_first(tmp_path):
    layout, engine, hot, cold, _ = _two_chains(tmp_path)
    (tmp_path / "lmdb" / USE_LOG_NAME).unlink()
    ctl = LocalController(controller_config(tmp_path, prewarm_bytes=1))
    ctl.register(layout, PAGE, engine.pools)
    assert _prewarmed(ctl)["target_pages"] == 0  # a budget smaller than a page: nothing
    ctl.close()
    ctl = LocalController(controller_config(tmp_path, prewarm_bytes=None))  # half the pool
    ctl.register(layout, PAGE, engine.pools)
    _prewarmed(ctl)
    ctl.check_invariants(deep=True)
    assert all(Tier.HOST in t for t in ctl.store.tiers_of(cold.page_keys()))
    ctl.close()


def test_the_prewarm_never_serves_a_page_that_fails_its_checksum(tmp_path):
    import lmdb

    layout, engine, hot, cold, budget = _two_chains(tmp_path)
    bad = hot.refs([FULL])[2].key
    env = lmdb.open(str(tmp_path / "lmdb"), map_size=1 << 30)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(bad.storage_key()))
        value[HEADER_BYTES + 11] ^= 0x08
        txn.put(bad.storage_key(), bytes(value))
    env.close()

    ctl = LocalController(controller_config(tmp_path, prewarm_bytes=budget))
    ctl.register(layout, PAGE, engine.pools)
    stats = _prewarmed(ctl)
    ctl.check_invariants(deep=True)
    assert stats["batches_failed"] == 1
    assert ctl.stats()["failures"]["checksum"] == 1
    assert ctl.store.tiers_of([bad]) == [frozenset()]  # dropped: a miss, never served
    others = [k for k in hot.page_keys() if k != bad]
    assert all(Tier.HOST in t for t in ctl.store.tiers_of(others))
    assert ctl.pin(hot.page_keys(), 5.0) is None  # the chain is no longer whole
    ctl.close()


def test_the_use_log_keeps_the_newest_use_and_ignores_a_torn_record(tmp_path):
    log = UseLog(tmp_path)
    a, b = b"a" * 17, b"b" * 17
    log.record(a)
    log.flush()
    time.sleep(0.001)
    log.record(b)
    log.record(a)
    log.flush()
    with open(log.path, "ab") as f:
        f.write(b"torn")
    uses = log.read()
    assert set(uses) == {a, b} and uses[a] >= uses[b]
    log.rewrite({a: uses[a]})
    assert log.read() == {a: uses[a]}


def test_the_next_hottest_pages_are_handed_to_the_os_cache_after_the_hosts(tmp_path):
    """Past the host's budget, the next hottest pages (up to ``prewarm_disk_bytes``) are
    read ahead into the OS page cache, hottest first, before any host read starts; none
    is put on host for it, and loads from disk stay exact."""
    layout, engine, hot, cold, budget = _two_chains(tmp_path)
    snap = engine.snapshot(hot)
    ctl = LocalController(controller_config(tmp_path, prewarm_bytes=0, prewarm_disk_bytes=budget))
    ctl.register(layout, PAGE, engine.pools)
    stats = _prewarmed(ctl)
    assert stats["target_pages"] == 0 and stats["disk_pages"] == len(hot.page_keys())
    assert stats["bytes_advised"] == budget  # the hot chain's values, the cold one's not
    end = time.monotonic() + 30  # and faulted into the sidecar's map, in the background
    while ctl.stats()["disk"]["prewarm"]["bytes_mapped"] < budget and time.monotonic() < end:
        time.sleep(0.01)
    assert ctl.stats()["disk"]["prewarm"]["bytes_mapped"] == budget
    assert not any(Tier.HOST in t for t in ctl.store.tiers_of(hot.page_keys()))
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, hot)), snap)  # from disk
    ctl.check_invariants(deep=True)
    ctl.close()


def test_the_readahead_goes_before_the_host_reads_and_follows_the_order():
    from hicache.controller.tiers.prewarm import Prewarm

    order = [(PageKey(FULL, bytes([i]) * 16), 100) for i in range(10)]
    calls: list = []

    def fill(keys):
        calls.append(("fill", [k.page_hash[0] for k in keys]))
        return [], len(keys), 100 * len(keys), True

    def advise(keys, populate=False):
        calls.append(("map" if populate else "advise", [k.page_hash[0] for k in keys]))
        return 100 * len(keys)

    p = Prewarm(order, 300, fill, disk_budget_bytes=450, advise=advise)
    assert (p.target_pages, p.disk_pages) == (3, 4)
    p.start()
    end = time.monotonic() + 30
    while (p.state == "running" or p.bytes_mapped < 400) and time.monotonic() < end:
        time.sleep(0.01)
    # The same pages then faulted into the process's map, on a thread of their own.
    assert [c for c in calls if c[0] != "map"] == [("advise", [3, 4, 5, 6]), ("fill", [0, 1, 2])]
    assert [c for c in calls if c[0] == "map"] == [("map", [3, 4, 5, 6])]
    assert calls.index(("map", [3, 4, 5, 6])) > 0  # after the readahead
    assert p.stats()["bytes_advised"] == 400 and p.state == "done"
    assert p.stats()["bytes_mapped"] == 400
    assert Prewarm(order, 0, fill, disk_budget_bytes=450).disk_pages == 0  # nothing to advise


def test_the_prewarm_metrics_say_what_was_read_and_what_was_advised():
    from hicache.controller.sidecar.metrics import prewarm_families

    stats = {"state": "done", "target_bytes": 300, "bytes_read": 200, "bytes_advised": 450,
             "target_pages": 3, "pages_read": 2}  # fmt: skip
    got = {
        (f.name, s.labels.get("kind")): s.value for f in prewarm_families(stats) for s in f.samples
    }
    assert got[("hicache_prewarm_bytes", "advised")] == 450
    assert got[("hicache_prewarm_bytes", "read")] == 200
    assert got[("hicache_prewarm_pages", "target")] == 3
    assert got[("hicache_prewarm_running", None)] == 0
