"""Copies begun on the sidecar's I/O thread (controller/sidecar/inline_copies.py): a small
load of pages on host and a small backup are answered there without a worker, the I/O
thread keeps answering while their copies are in flight and answers only once a copy has
ended, a load that must read from disk, a backup whose acknowledgement waits on the disk
writer and a large backup still run on a worker, and every one of them moves the right
bytes."""

from __future__ import annotations

import threading
import time

import pytest

from hicache.controller.client.sidecar_client import SidecarClientConfig, SidecarController
from hicache.controller.config import ControllerConfig
from hicache.controller.store.local import LocalController
from hicache.controller.wire.protocol import Verb
from hicache.controller_api import Presence
from hicache.types import ComponentType, Tier
from tests.support.sidecar import FullEngine, GatedCopy, ServerThread, wait_for

PAGE = 4
FULL = ComponentType.FULL
# The engine's client spins for its replies (reply_spin_s), as one whose thread blocks on
# every call would; the other connections of these tests sleep (the default).
CLIENT = SidecarClientConfig(request_timeout_s=10.0, lookup_timeout_s=10.0, reply_spin_s=0.02)
SLEEPING = SidecarClientConfig(request_timeout_s=10.0, lookup_timeout_s=10.0)


class Setup(FullEngine):
    def __init__(self, workdir, **options) -> None:
        ctl_cfg = ControllerConfig(
            host_pool_bytes=4 << 20, disk_path=workdir / "lmdb", disk_budget_bytes=32 << 20
        )
        self.controller = LocalController(ctl_cfg)
        self.served = ServerThread(self.controller, workdir / "s.sock", **options)
        self.server = self.served.server
        self.worker_loads = self.worker_backups = 0
        handlers = self.server.verbs.handlers
        on_worker, backup_on_worker = handlers[Verb.LOAD], handlers[Verb.BACKUP]

        def counted(call, args):
            self.worker_loads += 1
            return on_worker(call, args)

        def counted_backup(call, args):
            self.worker_backups += 1
            return backup_on_worker(call, args)

        handlers[Verb.LOAD] = counted
        handlers[Verb.BACKUP] = counted_backup
        super().__init__("ipc://" + str(workdir / "s.sock"), PAGE, CLIENT)

    def close(self) -> None:
        self.client.close()
        self.served.stop()
        self.controller.close()
        self.pools.close()


@pytest.fixture
def setup(workdir):
    s = Setup(workdir)
    yield s
    s.close()


def test_a_small_load_on_host_is_answered_by_the_io_thread_with_the_right_bytes(setup):
    src = setup.chain()
    assert setup.client.backup(src).wait(10)
    dst = setup.retarget(src)
    pin = setup.client.pin([r.key for r in dst], 30)
    assert setup.client.load(dst, pin, 10)
    assert setup.same_bytes(src, dst)
    assert setup.worker_loads == 0
    assert setup.controller.stats()["pins_active"] == 1  # the load leaves the pin as it was
    setup.client.unpin(pin)
    setup.controller.check_invariants()


def test_the_io_thread_answers_while_an_inline_copy_is_in_flight(setup):
    src = setup.chain()
    assert setup.client.backup(src).wait(10)
    dst = setup.retarget(src)
    pin = setup.client.pin([r.key for r in dst], 30)
    gate = threading.Event()
    real_start = setup.controller.start_load
    started = []

    def held(*a, **kw):
        load = real_start(*a, **kw)
        started.append(load)
        return GatedCopy(load, gate)  # its copy has not ended until the gate opens

    setup.controller.start_load = held
    result = []
    loader = threading.Thread(target=lambda: result.append(setup.client.load(dst, pin, 10)))
    loader.start()
    try:
        wait_for(lambda: started, 10, "the load to start on the I/O thread")
        # A second connection: the engine's own socket is busy waiting for the load.
        other = SidecarController(setup.client.endpoint, "other", SLEEPING)
        other.attach(setup.layout, PAGE)
        presence = other.lookup([r.page_hash for r in src], [FULL]).presence[FULL]
        assert presence.tolist() == [Presence.HOST] * len(src)
        other.close()
        assert not result, "answered before its copy ended"
    finally:
        gate.set()
        loader.join(30)
    assert result and result[0]
    assert setup.same_bytes(src, dst) and setup.worker_loads == 0
    setup.controller.check_invariants()


def test_a_load_that_reads_from_disk_runs_on_a_worker(setup):
    src = setup.chain()
    assert setup.client.backup(src).wait(10)
    assert setup.controller.flush(30)
    setup.controller.store.evict(Tier.HOST, 1 << 62)
    dst = setup.retarget(src)
    pin = setup.client.pin([r.key for r in dst], 30)
    assert setup.client.load(dst, pin, 10)
    assert setup.same_bytes(src, dst)
    assert setup.worker_loads == 1
    setup.controller.check_invariants()


def _own_pins_client(setup: Setup) -> SidecarController:
    cfg = SidecarClientConfig(request_timeout_s=10.0, lookup_timeout_s=10.0, pin_at_load=True)
    client = SidecarController(setup.client.endpoint, "engine-own-pins", cfg)
    client.register(setup.layout, PAGE, setup.pools)
    return client


@pytest.mark.parametrize("where", ["host", "disk"])
def test_a_load_that_pins_its_own_pages_loads_them_and_releases_its_pin(setup, where):
    src = setup.chain()
    assert setup.client.backup(src).wait(10)
    if where == "disk":  # the load reads its pages on a worker, under its own pin too
        assert setup.controller.flush(30)
        setup.controller.store.evict(Tier.HOST, 1 << 62)
    client = _own_pins_client(setup)
    try:
        dst = setup.retarget(src)
        pin = client.pin([r.key for r in dst], 30)
        assert pin is not None
        assert setup.controller.stats()["pins_active"] == 0  # nothing sent yet
        assert client.load(dst, pin, 10)
        assert setup.same_bytes(src, dst)
        assert setup.worker_loads == (1 if where == "disk" else 0)
        assert setup.controller.stats()["pins_active"] == 0  # released when the load ended
        client.unpin(pin)  # sends nothing: the load released it
        setup.controller.check_invariants()
    finally:
        client.close()


def test_a_load_that_pins_its_own_pages_fails_when_one_is_gone_and_pins_nothing(setup):
    src = setup.chain()
    assert setup.client.backup(src).wait(10)
    client = _own_pins_client(setup)
    try:
        pin = client.pin([r.key for r in src], 30)
        assert setup.controller.flush(30)  # a page being written to disk is never dropped
        with setup.controller.store._lock:
            setup.controller.store._drop_locked(src[2].key, False)  # evicted after the match
        dst = setup.retarget(src)
        assert not client.load(dst, pin, 10)
        assert setup.controller.stats()["pins_active"] == 0
        assert client.available  # a miss, not a fault of the sidecar
        setup.controller.check_invariants()
    finally:
        client.close()


@pytest.mark.parametrize("pin_args", [{}, {"pin_id": 1, "pin_ttl_s": 5.0}])
def test_a_load_names_exactly_one_pin(setup, pin_args):
    from hicache.controller.client.channel import RemoteError
    from hicache.controller.wire.fields import encode_refs
    from hicache.controller.wire.verbs import SPECS

    src = setup.chain()
    assert setup.client.backup(src).wait(10)
    args = {"refs": encode_refs(setup.retarget(src)), "timeout_s": 5.0, **pin_args}
    with pytest.raises(RemoteError, match="exactly one of pin_id and pin_ttl_s"):
        setup.client._channel.call(Verb.LOAD, args, 5.0)
    assert SPECS[Verb.LOAD].decode_args(args).refs  # the arguments are well-formed otherwise
    assert setup.controller.stats()["pins_active"] == 0
    setup.controller.check_invariants()


# -- backups ------------------------------------------------------------------------------


def _loaded_back(setup: Setup, src) -> bool:
    """Whether ``src``'s pages, loaded back into other slots, carry ``src``'s bytes."""
    dst = setup.retarget(src)
    pin = setup.client.pin([r.key for r in dst], 30)
    try:
        return pin is not None and setup.client.load(dst, pin, 10) and setup.same_bytes(src, dst)
    finally:
        if pin is not None:
            setup.client.unpin(pin)


def test_a_small_backup_is_answered_by_the_io_thread_and_holds_the_right_bytes(setup):
    src = setup.chain()
    assert setup.client.backup(src).wait(10)
    assert setup.worker_backups == 0
    presence = setup.client.lookup([r.page_hash for r in src], [FULL]).presence[FULL]
    assert presence.tolist() == [Presence.HOST] * len(src)
    assert _loaded_back(setup, src)
    assert setup.server.inflight == 0
    setup.controller.check_invariants()


def test_a_backup_is_answered_only_once_its_copy_has_ended_and_lookups_go_on(setup):
    gate = threading.Event()
    real_backup = setup.controller.backup
    started = []

    def held(*a, **kw):
        handle = real_backup(*a, **kw)
        started.append(handle)
        return GatedCopy(handle, gate)  # its copy has not ended until the gate opens

    setup.controller.backup = held
    src = setup.chain()
    result = []
    backer = threading.Thread(target=lambda: result.append(setup.client.backup(src).wait(10)))
    backer.start()
    try:
        wait_for(lambda: started, 10, "the backup to start on the I/O thread")
        other = SidecarController(setup.client.endpoint, "other", SLEEPING)
        other.attach(setup.layout, PAGE)
        answered = other.lookup([r.page_hash for r in src], [FULL])  # while the copy is held
        assert len(answered.presence[FULL]) == len(src)
        other.close()
        time.sleep(0.1)
        assert not result, "answered before its copy ended"
        assert setup.server.inflight == 1
    finally:
        gate.set()
        backer.join(30)
    assert result == [True] and setup.worker_backups == 0
    assert _loaded_back(setup, src)
    setup.controller.check_invariants()


def test_a_backup_past_its_deadline_is_answered_false_once_its_copy_has_ended():
    from hicache.controller.sidecar.inline_copies import _Backup

    class Ended:  # a backup whose every page is held
        def done(self) -> bool:
            return True

        def wait(self, timeout_s=None) -> bool:
            return True

    assert _Backup(Ended(), time.monotonic() + 60).finish()
    assert not _Backup(Ended(), time.monotonic() - 1).finish()  # as a worker answers it


def test_a_backup_whose_copy_fails_is_answered_with_an_error_and_the_io_thread_serves_on(setup):
    real_backup = setup.controller.backup

    class Broken:  # the device reports an error when asked whether the copy ended
        def __init__(self, inner) -> None:
            self.inner = inner

        def done(self) -> bool:
            self.inner.wait(10)  # the real copy has ended: nothing reads the pages on
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def wait(self, timeout_s=None) -> bool:
            return self.inner.wait(timeout_s)

    setup.controller.backup = lambda *a, **kw: Broken(real_backup(*a, **kw))
    src = setup.chain()
    assert not setup.client.backup(src).wait(10)
    assert setup.worker_backups == 0 and setup.server.inflight == 0
    setup.controller.backup = real_backup
    other = SidecarController(setup.client.endpoint, "other", SLEEPING)
    try:
        other.attach(setup.layout, PAGE)
        answered = other.lookup([r.page_hash for r in src], [FULL])
        assert len(answered.presence[FULL]) == len(src)
    finally:
        other.close()
    setup.controller.check_invariants()


def test_a_large_backup_runs_on_a_worker(setup, monkeypatch):
    from hicache.controller.sidecar import inline_copies

    monkeypatch.setattr(inline_copies, "BACKUP_MAX_PAGES", 2)
    src = setup.chain()
    assert len(src) > 2
    assert setup.client.backup(src).wait(10)
    assert setup.worker_backups == 1
    assert _loaded_back(setup, src)
    setup.controller.check_invariants()


def test_a_backup_acknowledged_on_disk_runs_on_a_worker_and_is_on_disk(workdir):
    setup = Setup(workdir, backup_ack="disk")
    try:
        src = setup.chain()
        assert setup.client.backup(src).wait(10)
        assert setup.worker_backups == 1
        tiers = setup.controller.store.tiers_of([r.key for r in src])
        assert all(Tier.DISK in t for t in tiers)
        setup.controller.check_invariants()
    finally:
        setup.close()


def test_a_backup_naming_a_ready_event_for_cpu_pools_is_refused_and_stores_nothing(setup):
    from hicache.controller.client.channel import RemoteError
    from hicache.controller.wire.fields import encode_refs

    src = setup.chain()
    args = {"refs": encode_refs(src), "ready_event": b"\0" * 64}
    with pytest.raises(RemoteError, match="ready_event is for CUDA pools only"):
        setup.client._channel.call(Verb.BACKUP, args, 5.0)
    presence = setup.client.lookup([r.page_hash for r in src], [FULL]).presence[FULL]
    assert Presence.HOST not in presence.tolist()
    assert setup.server.inflight == 0
    setup.controller.check_invariants()
