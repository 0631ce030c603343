"""What the controller's answers promise: a pin protects pages only until its TTL (not
until the next pin or load sweeps it), a backup is acknowledged only when every page is
held afterwards (not when another copy into it has merely started), and the sidecar
answers a backup only once its copy can no longer read the engine's pages (past the
request's deadline too). Each test failed on the code before these rules."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from hicache.controller.sidecar.admin_verbs import Call
from hicache.controller.sidecar.config import BackupAck
from hicache.controller.sidecar.handlers import VerbHandlers
from hicache.controller.store.local import LocalController
from hicache.controller.wire.fields import encode_refs
from hicache.controller.wire.protocol import Request, Verb
from hicache.controller.wire.verbs import SPECS
from hicache.types import Tier
from tests.support.controller import (
    FULL,
    PAGE,
    Engine,
    assert_same_bytes,
    controller_config,
    hybrid_layout,
    load_into,
    registered_controller,
)


def test_a_lapsed_pin_stops_protecting_its_pages_without_another_pin_or_load(tmp_path):
    _, engine, ctl = registered_controller(tmp_path, host_pool_bytes=6000)
    try:
        cap = ctl.stats()["host"]["capacity_pages"]["full"]
        a = engine.write_chain(range(cap * PAGE))
        assert ctl.backup(a.refs([FULL])).wait(5.0)
        ctl.flush()
        assert ctl.pin(a.page_keys([FULL]), 0.05) is not None
        time.sleep(0.2)  # the pin's TTL is long over
        assert ctl.stats()["pins_active"] == 0, "a lapsed pin is still reported active"
        b = engine.write_chain(range(10_000, 10_000 + cap * PAGE))
        assert ctl.backup(b.refs([FULL])).wait(5.0), ctl.stats()["failures"]
        ctl.check_invariants(deep=True)
    finally:
        ctl.close()


def test_a_lapsed_pin_does_not_hold_the_disk_over_its_budget(tmp_path):
    _, engine, ctl = registered_controller(
        tmp_path, host_pool_bytes=1 << 20, disk_budget_bytes=6 * 600
    )
    try:
        a = engine.write_chain(range(6 * PAGE))
        assert ctl.backup(a.refs([FULL])).wait(5.0)
        ctl.flush()
        budget = ctl.config.disk_budget_bytes
        assert ctl.pin(a.page_keys([FULL]), 0.05) is not None
        time.sleep(0.2)
        b = engine.write_chain(range(10_000, 10_000 + 6 * PAGE))
        assert ctl.backup(b.refs([FULL])).wait(5.0)
        ctl.flush()
        live = ctl.stats()["disk"]["live_bytes"]
        ctl.check_invariants(deep=True)
        assert live <= budget, f"disk holds {live} bytes over its {budget}-byte budget"
    finally:
        ctl.close()


def test_a_backup_of_pages_another_copy_is_filling_waits_for_that_copy(tmp_path):
    layout = hybrid_layout()
    ea, eb = Engine(layout, seed=1), Engine(layout, seed=2)
    ctl = LocalController(controller_config(tmp_path))
    ctl.register(layout, PAGE, ea.pools, engine_id="a")
    ctl.register(layout, PAGE, eb.pools, engine_id="b")
    ca = ea.write_chain(range(3 * PAGE))
    cb = eb.write_chain(range(3 * PAGE))  # the same prefix: the same page hashes
    in_copy, go = threading.Event(), threading.Event()
    real_fault = ctl.store.fault

    def fault(what):
        if what == "copy_to_host" and threading.current_thread().name == "A":
            in_copy.set()
            go.wait(5.0)
            return True  # engine a's copy fails once b has asked for the same pages
        return real_fault(what)

    ctl.store.fault = fault
    out = {}
    ta = threading.Thread(
        target=lambda: out.update(a=ctl.backup(ca.refs([FULL]), engine_id="a").wait(5.0)),
        name="A",
    )
    try:
        ta.start()
        assert in_copy.wait(5.0)
        handle_b = ctl.backup(cb.refs([FULL]), engine_id="b")
        assert not handle_b.done(), "b's pages are not held until a's copy has ended"
        go.set()
        ok_b = handle_b.wait(5.0)
        ta.join(5.0)
        ctl.store.fault = real_fault
        held = [Tier.HOST in t or Tier.DISK in t for t in ctl.store.tiers_of(cb.page_keys([FULL]))]
        ctl.check_invariants(deep=True)
        assert out["a"] is False
        assert ok_b is all(held) and ok_b is False, "b was told its pages are held"
    finally:
        go.set()
        ctl.close()


class _LateCopy:
    """A CUDA-like event whose copy runs when the stream gets to it (0.3 s later)."""

    def __init__(self, run):
        self._run, self._done, self._at = run, False, time.monotonic() + 0.3

    def query(self):
        if not self._done and time.monotonic() >= self._at:
            self.synchronize()
        return self._done

    def synchronize(self):
        if not self._done:
            self._run()
            self._done = True


def test_the_backup_verb_answers_only_after_its_copy_past_the_deadline(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    real_to_host = ctl._copies.transfer.to_host
    late: list[_LateCopy] = []

    def to_host(comp, buffers, dev, host, ready_event=None):
        late.append(_LateCopy(lambda: real_to_host(comp, buffers, dev, host, None)))
        return late[-1]

    ctl._copies.transfer.to_host = to_host
    real_backup = ctl.backup

    def slow_backup(*a, **kw):  # the worker is descheduled past the request's deadline
        handle = real_backup(*a, **kw)
        time.sleep(0.1)
        return handle

    ctl.backup = slow_backup
    try:
        config = SimpleNamespace(backup_ack=BackupAck.HOST)
        verbs = VerbHandlers(None, ctl, config, None, [], lambda: None)
        conn = SimpleNamespace(engine_id="local", mapped=SimpleNamespace(device="cuda"))
        chain = engine.write_chain(range(3 * PAGE))
        snap = engine.snapshot(chain)
        spec = SPECS[Verb.BACKUP]
        req = Request(1, Verb.BACKUP, 1.0, {"refs": encode_refs(chain.refs([FULL]))})
        call = Call(conn, req, time.monotonic() + 0.05, lambda done, total: None)
        reply = verbs.backup(call, spec.decode_args(req.args))  # the deadline passes
        assert late and all(ev.query() for ev in late), "answered while the copy could read"
        assert spec.encode_reply(reply) == {"ok": False}
        engine.scribble(chain)  # the engine reuses its pages once answered
        ctl._copies.transfer.to_host = real_to_host
        ctl.flush()
        got = engine.snapshot(load_into(ctl, engine, chain, components=(FULL,)))
        assert_same_bytes({k: v for k, v in got.items() if k[0] is FULL}, snap)
        ctl.check_invariants(deep=True)
    finally:
        ctl._copies.transfer.to_host = real_to_host
        ctl.close()
