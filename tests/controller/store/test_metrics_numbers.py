"""The numbers operators read: transfer seconds and served loads, as the sidecar exports them.

* ``hicache_transfer_seconds_total`` is the union of the intervals of one direction's
  transfers, also when a long transfer is reported after shorter ones that began later
  (a slow disk read among quick ones on the other reader threads).
* ``hicache_loads_served_total`` moves for a load that copied its pages and for nothing
  else: HicacheLoadBackFailureRate counts a failed load as a load request not served, so
  every way ``load`` can return False must leave it unmoved.

The alert rules themselves are tested by promtool (deploy/prometheus/hicache-alerts.test.yml,
run by tests/project/test_deploy.py).
"""

from __future__ import annotations

import inspect
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import hicache.controller.store.counters as counters_mod
from hicache.controller.admin import ops as admin_ops
from hicache.controller.sidecar.metrics import SidecarMetrics
from hicache.controller.store.counters import BusyTime, Counters, Failure
from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.local import LocalController
from hicache.controller.store.page_copies import DeviceLoad
from hicache.controller.store.page_store import PageStore
from hicache.controller.tiers.disk_tier import _READ_FAILURES, DiskTier
from hicache.controller.tiers.lmdb_tier import ReadStatus
from hicache.controller_api import LoadResult, PageRef, PinReceipt
from hicache.types import Tier
from tests.support.cache import make_layout
from tests.support.controller import PAGE, Chain, Engine, controller_config, load_into

# -- transfer seconds -----------------------------------------------------------------------


class FakeClock:
    """``time.perf_counter`` of the counters module, set by the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        monkeypatch.setattr(counters_mod.time, "perf_counter", lambda: self.now)


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _report(c: Counters, clock: FakeClock, start: float, end: float) -> None:
    clock.now = end
    c.transfer("disk_to_host", 1, 100, end - start)


def test_a_long_transfer_reported_after_a_shorter_one_inside_it_counts_whole(monkeypatch):
    clock = FakeClock(monkeypatch)
    c = Counters()
    _report(c, clock, 2.0, 5.0)  # reader B, reported first
    _report(c, clock, 0.0, 10.0)  # reader A, began before B and ended after it
    assert c.get("transfer", "disk_to_host", "seconds") == 10.0


def test_a_long_transfer_over_several_busy_periods_counts_only_the_gaps_between_them(
    monkeypatch,
):
    clock = FakeClock(monkeypatch)
    c = Counters()
    for start in (1.0, 3.0, 5.0):
        _report(c, clock, start, start + 1.0)  # busy 1-2, 3-4, 5-6
    _report(c, clock, 0.5, 7.0)
    assert c.get("transfer", "disk_to_host", "seconds") == 6.5
    _report(c, clock, 8.0, 9.0)  # after a gap: all of it
    assert c.get("transfer", "disk_to_host", "seconds") == 7.5
    assert c.snapshot()["transfer"]["disk_to_host"]["pages"] == 5


@pytest.mark.parametrize("in_order", [True, False], ids=["ends-in-order", "ends-out-of-order"])
def test_transfer_seconds_are_the_union_of_any_intervals(monkeypatch, in_order):
    """Random transfers of several reader threads, short and long; reported at their end
    (``in_order``), or with ends out of order as a thread preempted between reading the
    clock and taking the counters' lock would report them."""
    rng = random.Random(7)
    intervals = []
    for _ in range(400):
        start = rng.uniform(0.0, 100.0)
        length = rng.choice((rng.uniform(0.0, 0.2), rng.uniform(0.0, 5.0), rng.uniform(0, 40)))
        intervals.append((start, start + length))
    if in_order:
        intervals.sort(key=lambda iv: iv[1])
    clock = FakeClock(monkeypatch)
    c = Counters()
    for start, end in intervals:
        _report(c, clock, start, end)
    assert c.get("transfer", "disk_to_host", "seconds") == pytest.approx(
        _union_seconds(intervals), abs=1e-9
    )


def test_busy_time_keeps_a_bounded_number_of_periods_and_never_counts_past_wall_time():
    """Past ``max_periods`` disjoint periods the oldest are forgotten; a transfer reaching
    back over them counts that part as busy already (an under-count, never more seconds
    than passed)."""
    busy = BusyTime(max_periods=4)
    added = sum(busy.add(float(t), t + 0.5) for t in range(10))  # busy t to t+0.5
    assert added == 5.0
    assert len(busy._starts) == 4
    added += busy.add(0.0, 10.0)
    assert added <= 10.0
    # From the end of the newest forgotten period (5.5) on, the count is exact: the gaps
    # around the four periods kept, 6.5-7, 7.5-8, 8.5-9, 5.5-6 and 9.5-10.
    assert added == 5.0 + 2.5


def test_transfer_seconds_from_many_threads_stay_within_wall_time():
    c = Counters()
    t_begin = time.perf_counter()

    def reader() -> None:
        for _ in range(300):
            t0 = time.perf_counter()
            time.sleep(0)
            c.transfer("disk_to_host", 1, 1, time.perf_counter() - t0)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_begin
    assert 0.0 < c.get("transfer", "disk_to_host", "seconds") <= wall
    assert c.get("transfer", "disk_to_host", "pages") == 1200


# -- served loads -------------------------------------------------------------------------------


def _served(ctl: LocalController) -> float:
    """``hicache_loads_served_total`` as the sidecar's collector exports it."""
    text = generate_latest(SidecarMetrics(ctl.stats).registry).decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == "hicache_loads_served":
            return next(s.value for s in fam.samples if s.name.endswith("_total"))
    raise AssertionError("hicache_loads_served_total is not exported")


@dataclass
class Store:
    """A controller whose LMDB tier holds ``chain`` while its host pool does not."""

    engine: Engine
    ctl: LocalController
    chain: Chain
    pins: list = field(default_factory=list)

    def close(self) -> None:
        for pin in self.pins:
            self.ctl.unpin(pin)
        self.ctl.flush(10.0)
        self.ctl.check_invariants()
        self.ctl.close()


def _disk_only(tmp_path, **overrides) -> Store:
    layout = make_layout("full")
    engine = Engine(layout, full_slots=4096)
    ctl = LocalController(controller_config(tmp_path, **overrides))
    ctl.register(layout, PAGE, engine.pools)
    chain = engine.write_chain(range(4 * PAGE))
    assert ctl.backup(chain.refs()).wait(10.0) and ctl.flush(10.0)
    assert admin_ops.evict(ctl, Tier.HOST, 1 << 30)["pages"] == 4
    ctl.faults = FaultPlan()
    return Store(engine, ctl, chain)


def _pin(store: Store, ttl_s: float = 30.0) -> tuple[list[PageRef], PinReceipt]:
    """Fresh device places for ``store.chain``, and a pin of its pages."""
    refs = store.engine.place(store.chain.hashes, store.chain.parents).refs()
    pin = store.ctl.pin([r.key for r in refs], ttl_s)
    assert pin is not None
    store.pins.append(pin)
    return refs, pin


def _load(store: Store, timeout_s: float = 5.0) -> bool:
    refs, pin = _pin(store)
    return store.ctl.load(refs, pin, timeout_s)


def _pin_expired(store: Store) -> bool:
    refs, pin = _pin(store, ttl_s=0.01)
    time.sleep(0.05)
    return store.ctl.load(refs, pin, 5.0)


def _page_absent(store: Store) -> bool:
    store.ctl.faults.evict_before_load = 1
    return _load(store)


def _host_full(store: Store) -> bool:
    """The host pool full of pinned pages: the disk pages find no host page to read into."""
    cap = store.ctl.stats()["host"]["capacity_pages"]["full"]
    other = store.engine.write_chain(range(10**6, 10**6 + cap * PAGE))
    assert store.ctl.backup(other.refs()).wait(10.0)
    pin = store.ctl.pin(other.page_keys(), 60.0)
    assert pin is not None
    store.pins.append(pin)
    return _load(store)


def _load_timeout(store: Store) -> bool:
    store.ctl.faults.disk_read_delay_s = 0.3
    ok = _load(store, timeout_s=0.02)
    assert store.ctl.prefetch(store.chain.page_keys()).wait(10.0)  # the reads end
    return ok


def _copy_error(store: Store) -> bool:
    store.ctl.faults.copy_to_device = 1
    return _load(store)


def _read_fails(status: ReadStatus) -> Callable[[Store], bool]:
    def scenario(store: Store) -> bool:
        lmdb = store.ctl.store._disk.lmdb
        lmdb.read_many = lambda skeys, dsts: [status] * len(skeys)  # into host pages
        lmdb.read_pieces = lambda skeys, nbytes, pieces, stop: [status] * len(skeys)  # slots
        return _load(store)

    return scenario


# Every way a load fails, and the one reason each counts (besides not being served).
LOAD_FAILURES: dict[str, tuple[Callable[[Store], bool], Failure, dict]] = {
    "pin_expired": (_pin_expired, Failure.PIN_EXPIRED, {}),
    "page_absent": (_page_absent, Failure.PAGE_ABSENT, {}),
    # Only a load that reads into host pages needs one (not one read into CPU slots).
    "host_full": (
        _host_full,
        Failure.HOST_FULL,
        {"host_pool_bytes": 32 << 10, "disk_load_direct": False},
    ),
    "load_timeout": (_load_timeout, Failure.LOAD_TIMEOUT, {}),
    "copy_error": (_copy_error, Failure.COPY_ERROR, {}),
    # Read straight into the engine's CPU slots (the default), or into host pages.
    **{
        f"read_{status.value}{way}": (_read_fails(status), reason, {"disk_load_direct": direct})
        for status, reason in _READ_FAILURES.items()
        for way, direct in (("", True), ("_to_host", False))
    },
}


def _reasons_a_load_can_count() -> set[Failure]:
    """Read from the code: what ``load`` counts, what its copy counts, what the disk read
    it starts counts when it cannot start and when it fails."""
    paths = (
        LocalController.load,
        PageStore.claim,
        PageStore.reads_done,
        PageStore.hold_for_copy,
        DeviceLoad.failed,
        DeviceLoad.done,
        DiskTier.fill_locked,
    )
    named = {m for f in paths for m in re.findall(r"Failure\.([A-Z_]+)", inspect.getsource(f))}
    return {Failure[n] for n in named} | set(_READ_FAILURES.values())


def test_the_scenarios_cover_every_reason_a_failed_load_can_count():
    assert {reason for _, reason, _ in LOAD_FAILURES.values()} == _reasons_a_load_can_count()


@pytest.mark.parametrize("name", sorted(LOAD_FAILURES))
def test_a_failed_load_is_not_served(tmp_path, name):
    scenario, reason, overrides = LOAD_FAILURES[name]
    store = _disk_only(tmp_path, **overrides)
    served = _served(store.ctl)
    failures = store.ctl.stats()["failures"]

    assert scenario(store) == LoadResult.FAILED  # failed, nothing left writing

    after = store.ctl.stats()["failures"]
    assert {r for r in after if after[r] > failures[r]} == {reason.value}
    assert _served(store.ctl) == served
    store.close()


def test_a_load_read_straight_into_cpu_slots_takes_no_host_page(tmp_path):
    """``host_full`` with the default ``disk_load_direct``: with the host pool full of
    pinned pages, a load of pages held only on disk still arrives, exact, failing nothing."""
    store = _disk_only(tmp_path, host_pool_bytes=32 << 10)
    want = store.engine.snapshot(store.chain)
    failures = store.ctl.stats()["failures"]
    assert _host_full(store) == LoadResult.LOADED
    assert store.engine.snapshot(load_into(store.ctl, store.engine, store.chain)) == want
    assert store.ctl.stats()["failures"] == failures
    store.close()


def test_a_load_that_copies_its_pages_is_served_once(tmp_path):
    store = _disk_only(tmp_path)
    served = _served(store.ctl)

    load_into(store.ctl, store.engine, store.chain)  # from disk
    load_into(store.ctl, store.engine, store.chain)  # from host

    assert _served(store.ctl) == served + 2
    assert store.ctl.stats()["load"]["ok"] == served + 2
    store.close()


def test_the_sidecar_exports_its_process_start_time():
    """HicacheChecksumFailures compares values dropped when LMDB opened with the start."""
    text = generate_latest(SidecarMetrics().registry).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    start = fams["process_start_time_seconds"].samples
    assert [s.labels for s in start] == [{}]
    assert 0 < time.time() - start[0].value < 24 * 3600
