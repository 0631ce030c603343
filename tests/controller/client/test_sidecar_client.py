"""``SidecarController`` against an in-process sidecar: deadlines, the circuit breaker, a
sidecar that does not answer, reconnection after a restart, leases and heartbeats."""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time

import numpy as np
import pytest
import torch
import zmq

from hicache import CacheConfig, DevicePools
from hicache.controller.client.sidecar_client import (
    RemoteError,
    RemoteLayoutMismatch,
    SidecarClientConfig,
    SidecarController,
)
from hicache.controller.config import ControllerConfig
from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.local import LocalController
from hicache.controller_api import ControllerError, PageRef, Presence
from hicache.keys import namespace_hash, page_hashes
from hicache.types import ComponentType, Tier
from tests.support.cache import make_layout
from tests.support.sidecar import ServerThread, wait_for

MIX = "full"
PAGE = 4
FULL = ComponentType.FULL
FAST = SidecarClientConfig(
    request_timeout_s=2.0,
    lookup_timeout_s=2.0,
    connect_timeout_s=2.0,
    reconnect_interval_s=0.1,
    breaker_failures=2,
)


class InProcessSidecar:
    """A SidecarServer on a thread of this process, restartable on the same paths."""

    def __init__(self, workdir, **sidecar) -> None:
        self.workdir = workdir
        self.sidecar = sidecar
        self.served: ServerThread | None = None

    @property
    def endpoint(self) -> str:
        return "ipc://" + str(self.workdir / "s.sock")

    def start(self) -> InProcessSidecar:
        ctl_cfg = ControllerConfig(
            host_pool_bytes=4 << 20,
            disk_path=self.workdir / "lmdb",
            disk_budget_bytes=32 << 20,
            disk_sync=False,
        )
        self.controller = LocalController(ctl_cfg)
        self.served = ServerThread(self.controller, self.workdir / "s.sock", **self.sidecar)
        self.server = self.served.server
        return self

    def stop(self) -> None:
        self.served.stop()
        self.controller.close()


class Engine:
    def __init__(self, endpoint: str, config: SidecarClientConfig = FAST, mix: str = MIX):
        self.layout = make_layout(mix)
        window = 8 if self.layout.has_swa else None
        cfg = CacheConfig(
            page_size=PAGE, sliding_window=window, full_slots=64 * PAGE, shared_memory=True
        )
        self.pools = DevicePools.allocate(self.layout, cfg)
        self.client = SidecarController(endpoint, f"engine-{id(self)}", config)
        self.fp = self.layout.fingerprint(PAGE)

    def register(self) -> None:
        self.client.register(self.layout, PAGE, self.pools)

    def chain(self, n: int = 4) -> list[PageRef]:
        hashes = page_hashes(np.arange(n * PAGE) + 77, self.fp, PAGE)
        parents = [namespace_hash(self.fp, None), *hashes[:-1]]
        pages = self.pools.alloc_kv_pages(n)
        slots = torch.from_numpy(self.pools.full.pages_to_slots(pages))
        self.pools.full.buffer[:, :, slots] = torch.randn(self.pools.full.buffer[:, :, slots].shape)
        return [PageRef(FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, pages)]

    def presence(self, refs) -> list[int]:
        return self.client.lookup([r.page_hash for r in refs], [FULL]).presence[FULL].tolist()

    def close(self) -> None:
        self.client.close()
        self.pools.close()


def test_lookups_are_misses_while_the_sidecar_is_down_and_hits_after_it_returns(workdir):
    side = InProcessSidecar(workdir).start()
    engine = Engine(side.endpoint)
    try:
        engine.register()
        refs = engine.chain()
        assert engine.client.backup(refs).wait(10)
        assert engine.presence(refs) == [Presence.HOST] * 4
        side.stop()  # the controller drains its writes to LMDB

        wait_for(lambda: not engine.client.available, 30, "the breaker to open")
        assert engine.presence(refs) == [Presence.ABSENT] * 4  # a miss, not an error
        assert not engine.client.backup(refs).wait(1)
        assert engine.client.pin([r.key for r in refs], 5) is None
        assert engine.client.counters["lookup_skipped"] >= 1  # no request was sent

        side.start()  # a new sidecar process would do the same: no session, no pools
        wait_for(lambda: engine.client.available, 30, "the client to reconnect")
        assert engine.client.counters["connected"] == 2
        assert engine.presence(refs) == [Presence.DISK] * 4
        assert side.controller.engines == [engine.client.engine_id]  # registered again
    finally:
        engine.close()
        side.stop()


def test_a_sidecar_that_never_answers_costs_misses_not_errors(workdir):
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)  # accepts connections, answers nothing
    mute.bind("ipc://" + str(workdir / "mute.sock"))
    engine = Engine("ipc://" + str(workdir / "mute.sock"))
    try:
        engine.register()  # does not raise: the client retries in the background
        assert not engine.client.available
        refs = engine.chain()
        assert engine.presence(refs) == [Presence.ABSENT] * 4
        assert not engine.client.load(refs, _receipt(), 1.0)
    finally:
        engine.close()
        mute.close(linger=0)


def _receipt():
    from hicache.controller_api import PinReceipt

    return PinReceipt(1, [], 0.0, generation=-1)


def test_a_load_never_outlasts_its_deadline(workdir):
    side = InProcessSidecar(workdir).start()
    engine = Engine(side.endpoint)
    try:
        engine.register()
        refs = engine.chain()
        assert engine.client.backup(refs).wait(10)
        assert side.controller.flush(30)
        # Disk only, and every disk read now takes 2 s.
        side.controller.store.evict(Tier.HOST, 1 << 62)
        side.controller.faults = FaultPlan(disk_read_delay_s=2.0)
        pin = engine.client.pin([r.key for r in refs], 30)
        assert pin is not None
        assert not engine.client.load(refs, pin, 0.2)
        assert side.controller.stats()["failures"]["load_timeout"] == 1
        engine.client.unpin(pin)
    finally:
        engine.close()
        side.stop()


def test_another_layout_is_refused_at_register(workdir):
    side = InProcessSidecar(workdir).start()
    first, other = Engine(side.endpoint), Engine(side.endpoint, mix="full+swa")
    try:
        first.register()
        with pytest.raises(RemoteLayoutMismatch, match="run one sidecar per layout"):
            other.register()
        # Every lookup of the refused engine misses: counted once, per its component.
        refused = side.controller.stats()["miss_reasons"]["layout"]["none"]
        assert refused == {"full": 1, "swa": 1}
    finally:
        first.close()
        other.close()
        side.stop()


def test_heartbeats_keep_an_idle_engine_registered(workdir):
    side = InProcessSidecar(workdir, lease_s=0.6, heartbeat_interval_s=0.15).start()
    idle, silent = Engine(side.endpoint), Engine(side.endpoint)
    silent.client._start_heartbeats = False
    try:
        idle.register()
        silent.register()
        wait_for(
            lambda: silent.client.engine_id not in side.controller.engines,
            30,
            "the silent engine's lease to expire",
        )
        # By then the idle engine has been idle for a whole lease, and is still there.
        assert idle.client.engine_id in side.controller.engines
        assert side.server.metrics.lease_expiries._value.get() == 1
    finally:
        idle.close()
        silent.close()
        side.stop()


def test_register_of_private_pools_is_refused_before_any_request():
    layout = make_layout(MIX)
    pools = DevicePools.allocate(layout, CacheConfig(page_size=PAGE, full_slots=64))
    client = SidecarController("ipc:///tmp/hc-unused.sock", "x", FAST, start_heartbeats=False)
    with pytest.raises(ControllerError, match="shared_memory=True"):
        client.register(layout, PAGE, pools)
    client.close()


def test_close_releases_the_engines_pins(workdir):
    side = InProcessSidecar(workdir).start()
    engine = Engine(side.endpoint)
    try:
        engine.register()
        refs = engine.chain()
        assert engine.client.backup(refs).wait(10)
        assert engine.client.pin([r.key for r in refs], 60) is not None
        assert side.controller.stats()["pins_active"] == 1
        engine.client.close()
        wait_for(lambda: side.controller.stats()["pins_active"] == 0, 10, "pins released")
        assert side.controller.engines == []
    finally:
        engine.pools.close()
        side.stop()


def test_tcp_with_curve_keys_serves_only_authorized_clients(workdir):
    import zmq.auth

    keys = workdir / "keys"
    allowed = workdir / "allowed"
    keys.mkdir()
    allowed.mkdir()
    _, server_secret = zmq.auth.create_certificates(str(keys), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(keys), "client")
    _, stranger_secret = zmq.auth.create_certificates(str(keys), "stranger")
    shutil.copy(client_public, allowed)
    side = InProcessSidecar(
        workdir,
        tcp_endpoint="tcp://127.0.0.1:*",
        tcp_auth="curve",
        curve_secret_key_file=server_secret,
        curve_authorized_keys_dir=allowed,
    ).start()
    tcp = next(e for e in side.server.endpoints if e.startswith("tcp://"))
    server_public = keys / "server.key"
    known = SidecarClientConfig(
        connect_timeout_s=10,
        curve_server_public_key_file=server_public,
        curve_client_cert_file=client_secret,
    )
    unknown = SidecarClientConfig(
        connect_timeout_s=1,
        curve_server_public_key_file=server_public,
        curve_client_cert_file=stranger_secret,
    )
    good, bad = Engine(tcp, known), Engine(tcp, unknown)
    try:
        # Answered (the handshake passed CURVE), and refused: a TCP peer never names this
        # machine's memory; its pools would be registered over the Unix socket.
        with pytest.raises(RemoteError, match=r"registration_refused: .*Unix socket"):
            good.register()
        bad.register()  # not refused with an error: the sidecar answers nothing at all
        assert not bad.client.available
        assert side.controller.engines == []
        local = Engine(side.endpoint)
        try:
            local.register()
            refs = local.chain()
            assert local.client.backup(refs).wait(10)
            assert local.presence(refs) == [Presence.HOST] * 4
        finally:
            local.close()
    finally:
        good.close()
        bad.close()
        side.stop()


def test_an_unpin_does_not_wait_for_the_sidecar_and_is_applied_in_order(workdir):
    from hicache.controller.wire.protocol import Verb

    side = InProcessSidecar(workdir).start()
    engine = Engine(side.endpoint)
    release = threading.Event()
    handlers = side.server.verbs.handlers
    unpin = handlers[Verb.UNPIN]

    def held_unpin(call, args):  # the sidecar's I/O thread is busy for a while
        release.wait(10)
        return unpin(call, args)

    try:
        engine.register()
        refs = engine.chain()
        assert engine.client.backup(refs).wait(10)
        pin = engine.client.pin([r.key for r in refs], 30)
        assert pin is not None and side.controller.stats()["pins_active"] == 1
        handlers[Verb.UNPIN] = held_unpin
        t0 = time.monotonic()
        engine.client.unpin(pin)
        returned_s = time.monotonic() - t0
        assert side.controller.stats()["pins_active"] == 1  # not applied yet
        release.set()
        # The next request is answered after the unpin, which the sidecar applied first.
        assert engine.presence(refs) == [Presence.HOST] * 4
        assert side.controller.stats()["pins_active"] == 0
        assert returned_s < FAST.request_timeout_s / 2  # it never waited for a reply
        assert engine.client.available and engine.client._failures == 0
    finally:
        release.set()
        engine.close()
        side.stop()


def test_a_first_registration_may_take_longer_than_the_handshake_deadline(workdir):
    """The sidecar builds its tiers at the first registration (a host pool of many GiB
    takes seconds to page-lock): the client waits for it instead of timing out into a
    breaker that is open while the engine starts serving."""
    side = InProcessSidecar(workdir).start()
    real = side.controller.register_buffers

    def slow_first(*args, **kwargs):
        time.sleep(1.0)  # as the allocation of a large pool would
        return real(*args, **kwargs)

    side.controller.register_buffers = slow_first
    quick = dataclasses.replace(FAST, connect_timeout_s=0.3, register_timeout_s=5.0)
    engine = Engine(side.endpoint, quick)
    try:
        engine.register()
        assert engine.client.available, "registered within register_timeout_s"
        refs = engine.chain()
        assert engine.client.backup(refs).wait(10)
        assert engine.presence(refs) == [Presence.HOST] * len(refs)
        side.controller.check_invariants()
    finally:
        engine.close()
        side.stop()
