"""Load-backs the engine copies itself from the sidecar's shared host pages
(controller/client/host_share.py): the right bytes with no load request, the sidecar told of
them at the unpin, every case the engine cannot copy (a page on disk only, a pin about
to lapse, a sidecar that shares nothing) loaded by the sidecar as before, and a restarted
sidecar's new pages mapped again."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from hicache.controller.client import host_share
from hicache.controller.client.sidecar_client import SidecarClientConfig
from hicache.controller.config import ControllerConfig
from hicache.controller.sidecar import host_share as sidecar_host_share
from hicache.controller.store.layer_copies import LayerCopies
from hicache.controller.store.local import LocalController
from hicache.controller.wire.protocol import Verb
from hicache.controller_api import LayerGroups, WholeLayerLoad
from hicache.types import ComponentType, Tier
from tests.support.sidecar import FullEngine, ServerThread, wait_for

PAGE = 4
FULL = ComponentType.FULL
CLIENT = SidecarClientConfig(
    request_timeout_s=10.0, lookup_timeout_s=10.0, reconnect_interval_s=0.1
)


class Sidecar:
    """A sidecar server in a thread whose load requests are counted."""

    def __init__(self, workdir, shared: bool = True) -> None:
        cfg = ControllerConfig(
            host_pool_bytes=4 << 20,
            disk_path=workdir / "lmdb",
            disk_budget_bytes=32 << 20,
            host_shared=shared,
        )
        self.controller = LocalController(cfg)
        self.served = ServerThread(self.controller, workdir / "s.sock", start=False)
        self.server = self.served.server
        self.load_requests = 0
        handlers = self.server.verbs.handlers
        on_worker = handlers[Verb.LOAD]

        def counted(call, args):
            self.load_requests += 1
            return on_worker(call, args)

        handlers[Verb.LOAD] = counted
        inline = self.server._inline
        real_start = inline.start

        def counted_inline(conn, spec, *a, **kw):
            started = real_start(conn, spec, *a, **kw)
            self.load_requests += int(started and spec.verb is Verb.LOAD)
            return started

        inline.start = counted_inline
        self.served.start()

    def counter(self, *key: str) -> float:
        return self.controller.counters._values.get(key, 0)

    def stop(self) -> None:
        self.served.stop()
        self.controller.close()


def _engine(workdir, config: SidecarClientConfig = CLIENT) -> FullEngine:
    """The engine of these tests, registered with the sidecar in ``workdir``."""
    return FullEngine("ipc://" + str(workdir / "s.sock"), PAGE, config)


@pytest.fixture
def pair(workdir):
    side = Sidecar(workdir)
    engine = _engine(workdir)
    yield side, engine
    engine.close()
    side.stop()


def test_a_load_of_pages_on_host_is_copied_by_the_engine_with_the_right_bytes(pair):
    side, engine = pair
    assert engine.client._share is not None, "the engine mapped the shared host pages"
    src = engine.chain()
    assert engine.client.backup(src).wait(10)
    dst = engine.retarget(src)
    pin = engine.client.pin([r.key for r in dst], 30)
    assert pin is not None and all(p >= 0 for p in pin.host_pages)
    assert engine.client.load(dst, pin, 10)
    assert engine.same_bytes(src, dst)
    assert side.load_requests == 0, "no load request reached the sidecar"
    assert engine.client.counters["load_engine_copied"] == 1
    engine.client.unpin(pin)
    # The unpin tells the sidecar: it counts the load and the pages' bytes.
    wait_for(lambda: side.counter("load", "engine_copied") == 1, 10, "the unpin told of the load")
    page_bytes = engine.layout.page_bytes(FULL, PAGE)
    assert side.counter("transfer", "host_to_device", "pages") == len(src)
    assert side.counter("transfer", "host_to_device", "bytes") == len(src) * page_bytes
    assert side.controller.stats()["pins_active"] == 0
    side.controller.check_invariants()


def test_a_page_only_on_disk_is_loaded_by_the_sidecar(pair):
    side, engine = pair
    src = engine.chain()
    assert engine.client.backup(src).wait(10)
    assert side.controller.flush(10)
    side.controller.store.evict(Tier.HOST, 1 << 30, FULL)  # now on disk only
    dst = engine.retarget(src)
    pin = engine.client.pin([r.key for r in dst], 30)
    assert pin is not None and all(p == -1 for p in pin.host_pages)
    # A sidecar of this same process: the engine never opens its LMDB file a second time.
    assert engine.client._share.disk is None
    assert engine.client.load(dst, pin, 10)
    assert engine.same_bytes(src, dst)
    assert side.load_requests == 1 and engine.client.counters["load_engine_copied"] == 0
    engine.client.unpin(pin)
    side.controller.check_invariants()


def test_a_pin_close_to_its_deadline_is_loaded_by_the_sidecar(pair):
    side, engine = pair
    src = engine.chain()
    assert engine.client.backup(src).wait(10)
    dst = engine.retarget(src)
    pin = engine.client.pin([r.key for r in dst], host_share.TTL_MARGIN_S / 2 + 5)
    pin.deadline -= 5  # as if the engine had waited: under the margin now
    assert engine.client.load(dst, pin, 10)
    assert engine.same_bytes(src, dst)
    assert side.load_requests == 1 and engine.client.counters["load_engine_copied"] == 0
    engine.client.unpin(pin)
    side.controller.check_invariants()


def test_a_sidecar_that_shares_nothing_and_a_client_that_asks_nothing_load_as_before(workdir):
    side = Sidecar(workdir, shared=False)
    plain = _engine(workdir)
    own = SidecarClientConfig(request_timeout_s=10.0, lookup_timeout_s=10.0, engine_copies=False)
    try:
        assert plain.client._share is None
        src = plain.chain()
        assert plain.client.backup(src).wait(10)
        dst = plain.retarget(src)
        pin = plain.client.pin([r.key for r in dst], 30)
        assert pin.host_pages is None
        assert plain.client.load(dst, pin, 10) and plain.same_bytes(src, dst)
        assert side.load_requests == 1
        plain.client.unpin(pin)
    finally:
        plain.close()
        side.stop()
    side = Sidecar(workdir, shared=True)
    other = _engine(workdir, own)
    try:
        assert other.client._share is None  # engine_copies=False: it never maps them
    finally:
        other.close()
        side.stop()


def test_a_restarted_sidecars_pages_are_mapped_again(workdir):
    side = Sidecar(workdir)
    engine = _engine(workdir)
    try:
        first = engine.client._share
        side.stop()
        side = Sidecar(workdir)
        src = engine.chain(seed=50)
        # The client notices the restart, reconnects, registers and maps the new pages.
        wait_for(lambda: engine.client.backup(src).wait(10), 20, "a backup to the new sidecar")
        share = engine.client._share
        assert share is not None and share is not first
        assert share.generation == engine.client._channel.generation
        dst = engine.retarget(src)
        pin = engine.client.pin([r.key for r in dst], 30)
        assert engine.client.load(dst, pin, 10) and engine.same_bytes(src, dst)
        assert side.load_requests == 0 and engine.client.counters["load_engine_copied"] == 1
        engine.client.unpin(pin)
        side.controller.check_invariants()
    finally:
        engine.close()
        side.stop()


def test_a_description_that_does_not_fit_the_layout_is_refused(pair):
    side, engine = pair
    header, fds = sidecar_host_share.describe(side.controller)  # the sidecar's own fds
    layout = engine.layout
    assert set(host_share._map(header, fds, layout, PAGE)) == {FULL}
    desc = msgpack.unpackb(header)
    wrong_rows = dict(desc, components=[dict(desc["components"][0], row_bytes=128)])
    wrong_layout = dict(desc, fingerprint=b"\0" * 16)
    too_many = dict(desc, components=[dict(desc["components"][0], pages=1 << 30)])
    for bad, says in (
        (wrong_rows, "bytes, not this layout's"),
        (wrong_layout, "another layout's"),
        (dict(desc, version=99), "another version"),
        (too_many, "smaller than"),
    ):
        with pytest.raises(ValueError, match=says):
            host_share._map(msgpack.packb(bad), fds, layout, PAGE)


def test_refs_outside_the_engines_pools_fail_the_load_as_the_sidecar_would(pair):
    side, engine = pair
    src = engine.chain()
    assert engine.client.backup(src).wait(10)
    capacity = engine.pools.full.buffer.shape[2] // PAGE
    bad = [dataclasses.replace(r, device_index=capacity + i) for i, r in enumerate(src)]
    pin = engine.client.pin([r.key for r in bad], 30)
    assert not engine.client.load(bad, pin, 10)
    assert side.load_requests == 0 and engine.client.counters["load_engine_copy_failed"] == 1
    engine.client.unpin(pin)  # no copy happened: nothing reported
    wait_for(lambda: side.controller.stats()["pins_active"] == 0, 10, "the unpin")
    assert side.counter("load", "engine_copied") == 0
    side.controller.check_invariants()


def test_a_layer_wise_load_is_copied_here_group_by_group_and_told_at_the_unpin(pair):
    side, engine = pair
    src = engine.chain()
    assert engine.client.backup(src).wait(10)
    dst = engine.retarget(src)
    pin = engine.client.pin([r.key for r in dst], 30)
    groups = LayerGroups.of_layout(engine.layout)
    assert len(groups) == 2
    load = engine.client.start_layer_load(dst, pin, groups, 10)
    assert isinstance(load, LayerCopies)  # copied here, not by the sidecar
    assert load.wait_group(0) and load.wait_group(1)
    assert load.finish() and engine.same_bytes(src, dst)
    assert side.load_requests == 0
    engine.client.unpin(pin)
    wait_for(lambda: side.counter("load", "engine_copied") == 1, 10, "the unpin told of the load")
    assert side.controller.stats()["pins_active"] == 0
    side.controller.check_invariants()


def test_a_layer_wise_load_of_pages_on_disk_is_loaded_whole_by_the_sidecar(pair):
    side, engine = pair
    src = engine.chain()
    assert engine.client.backup(src).wait(10)
    assert side.controller.flush(10)
    side.controller.store.evict(Tier.HOST, 1 << 30, FULL)  # now on disk only
    dst = engine.retarget(src)
    pin = engine.client.pin([r.key for r in dst], 30)
    load = engine.client.start_layer_load(dst, pin, LayerGroups.of_layout(engine.layout), 10)
    assert isinstance(load, WholeLayerLoad) and load.wait_group(0) and load.finish()
    assert engine.same_bytes(src, dst) and side.load_requests == 1
    engine.client.unpin(pin)
    side.controller.check_invariants()
