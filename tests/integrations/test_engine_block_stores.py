"""Stores whose host pages were asked for ahead (hicache/integrations/engine_block_stores.py)
through a sidecar on a thread of this process (its page store checked after each step):
a prebooked store arrives bit for bit with no ``store_begin`` of its own, a prebook never
stored is given back whole, and one made before the sidecar restarted, or too long ago,
is asked for again and still stores."""

from __future__ import annotations

import pytest
import torch

from hicache.controller.config import ControllerConfig
from hicache.controller.store.local import LocalController
from hicache.integrations.engine_block_stores import StorePrebook
from tests.integrations.test_engine_blocks import (
    FULL,
    _engine,
    _hash,
    _layout,
    _refs,
    third_copy_fails,
)
from tests.support.sidecar import ServerThread, short_tmpdir, wait_for


class ThreadSidecar:
    """``hicache serve`` with shared host pages, on a thread; restartable on its socket."""

    def __init__(self) -> None:
        self.workdir = short_tmpdir()
        self.endpoint = "ipc://" + str(self.workdir / "s.sock")
        self.runs = 0

    def start(self) -> ThreadSidecar:
        self.runs += 1
        cfg = ControllerConfig(
            host_pool_bytes=8 << 20,
            disk_path=self.workdir / f"lmdb{self.runs}",
            disk_budget_bytes=64 << 20,
            host_shared=True,
        )
        layout = (_layout(), 1)  # the served layout, as `hicache serve --layout-file` has it
        self.controller = LocalController(cfg, *layout)
        self.served = ServerThread(self.controller, self.workdir / "s.sock", layout)
        return self

    def stop(self) -> None:
        self.served.stop()
        self.controller.close()

    def host_pages_used(self) -> int:
        return self.controller.stats()["host"]["used_pages"]["full"]


@pytest.fixture
def sidecar():
    s = ThreadSidecar().start()
    yield s
    s.stop()


def _stored_exact(sidecar, writer, src, ids: list[int], seed: int) -> None:
    """Another engine loads ``ids`` and finds the writer's blocks 0.. bit for bit."""
    reader, dst = _engine(sidecar, seed)
    try:
        targets = list(range(40, 40 + len(ids)))
        assert reader.load([_hash(i) for i in ids], [0] * len(ids), targets, 30.0, 30.0)
        for s, d in zip(src, dst):
            assert torch.equal(d[targets], s[: len(ids)])
    finally:
        reader.client.close()


@pytest.mark.parametrize("chunk_pages", [64, 3], ids=["one-part", "parts-of-3"])
def test_a_prebooked_store_arrives_exact_with_no_store_begin_of_its_own(sidecar, chunk_pages):
    writer, src = _engine(sidecar, 21, chunk_pages)
    try:
        ids = list(range(10))
        prebook = writer.prebook(_refs(ids), 30.0)
        assert prebook is not None and prebook.pages == 10
        assert sum(p is not None for p in prebook.sent) == len(writer._parts(10))
        released = []
        stored = writer.store(_refs(ids), [0] * 10, ids, 30.0, lambda: released.append(1),
                              prebook=prebook)  # fmt: skip
        assert stored == (10, 0) and released == [1]
        assert (writer.begins_on_path, writer.prebook_missed) == (0, 0)
        sidecar.controller.check_invariants()
        assert sidecar.host_pages_used() == 10
        _stored_exact(sidecar, writer, src, ids, 22)
        # Without a prebook the same store asks for its pages itself (held: none written).
        assert writer.store(_refs(ids), [0] * 10, ids, 30.0)[0] == 0
        assert writer.begins_on_path >= 1
    finally:
        writer.client.close()


def test_a_prebook_never_stored_is_given_back_whole(sidecar):
    writer, _ = _engine(sidecar, 23, chunk_pages=3)
    try:
        ids = list(range(100, 110))
        prebook = writer.prebook(_refs(ids), 30.0)
        assert prebook is not None
        # The sidecar handed the pages out (filling: held, invisible) ...
        wait_for(lambda: sidecar.host_pages_used() == 10, 30, "the pages handed out")
        sidecar.controller.check_invariants()
        hits = writer.client.lookup([_hash(i) for i in ids], [FULL]).presence[FULL]
        assert [int(p) for p in hits] == [0] * 10
        writer.give_back(prebook)
        # ... and takes them back at once, not at the reservation's deadline.
        assert sidecar.host_pages_used() == 0
        sidecar.controller.check_invariants()
        assert writer.store(_refs(ids), [0] * 10, list(range(10)), 30.0) == (10, 0)
        sidecar.controller.check_invariants()
    finally:
        writer.client.close()


def test_a_store_whose_copy_fails_gives_back_every_prebooked_part_after_it(sidecar, monkeypatch):
    writer, _ = _engine(sidecar, 24, chunk_pages=3)
    ids = list(range(200, 210))  # parts of 1, 3, 3, 3 pages, all asked for ahead
    started = third_copy_fails(writer, monkeypatch)
    # Answers still on their way when the store runs: it copies part by part.
    monkeypatch.setattr(writer.client, "begin_answered", lambda pending: False)
    try:
        prebook = writer.prebook(_refs(ids), 30.0)
        with pytest.raises(RuntimeError, match="the copy failed"):
            writer.store(_refs(ids), [0] * 10, list(range(10)), 30.0, prebook=prebook)
        assert started == [1, 3, 3]
        assert sidecar.host_pages_used() == 4  # the two parts copied before it, published
        sidecar.controller.check_invariants()
        hits = writer.client.lookup([_hash(i) for i in ids], [FULL]).presence[FULL]
        assert [int(p) != 0 for p in hits] == [True] * 4 + [False] * 6
    finally:
        writer.client.close()


@pytest.mark.parametrize("fails", [False, True], ids=["copied", "copy-fails"])
def test_a_prebook_whose_answers_are_all_in_is_copied_as_one(sidecar, monkeypatch, fails):
    """Every part's pages handed out before the store runs: one copy for all the parts,
    each part committed; a copy that fails gives every page back (none visible, none
    held)."""
    writer, src = _engine(sidecar, 27, chunk_pages=3)
    copy = writer._copies_now()[0]
    started, real_start = [], copy.start

    def start(blocks, pages, to_host):
        started.append(len(blocks))
        if fails:
            raise RuntimeError("the copy failed")
        return real_start(blocks, pages, to_host)

    monkeypatch.setattr(copy, "start", start)
    try:
        ids = list(range(400, 410))  # parts of 1, 3, 3, 3 pages
        prebook = writer.prebook(_refs(ids), 30.0)
        wait_for(lambda: writer.prebook_answered(prebook), 30, "the prebook's answers")
        if fails:
            with pytest.raises(RuntimeError, match="the copy failed"):
                writer.store(_refs(ids), [0] * 10, list(range(10)), 30.0, prebook=prebook)
        else:
            stored = writer.store(_refs(ids), [0] * 10, list(range(10)), 30.0, prebook=prebook)
            assert stored == (10, 0)
        assert started == [10]  # one copy, not one a part
        assert (writer.begins_on_path, writer.prebook_missed) == (0, 0)
        sidecar.controller.check_invariants()
        hits = writer.client.lookup([_hash(i) for i in ids], [FULL]).presence[FULL]
        assert [int(p) != 0 for p in hits] == [not fails] * 10
        assert sidecar.host_pages_used() == (0 if fails else 10)
        if not fails:
            _stored_exact(sidecar, writer, src, ids, 28)
    finally:
        writer.client.close()


def test_a_prebook_from_before_a_sidecar_restart_is_asked_again_and_stores(sidecar):
    writer, src = _engine(sidecar, 25, chunk_pages=3)
    try:
        ids = list(range(300, 310))
        prebook = writer.prebook(_refs(ids), 30.0)
        assert prebook is not None
        gen = writer.client.mapped_session()[0]
        sidecar.stop()
        sidecar.start()
        wait_for(
            lambda: writer.available and writer.client.mapped_session()[0] != gen,
            60,
            "the writer's new session",
        )
        assert writer.store(_refs(ids), [0] * 10, list(range(10)), 30.0, prebook=prebook) == (
            10,
            0,
        )
        assert writer.prebook_missed == len(prebook.sent)
        sidecar.controller.check_invariants()
        assert sidecar.host_pages_used() == 10
        _stored_exact(sidecar, writer, src, ids, 26)
    finally:
        writer.client.close()


def test_a_prebook_past_its_use_by_is_given_back_and_asked_again(sidecar):
    writer, src = _engine(sidecar, 27)
    try:
        ids = list(range(400, 404))
        prebook = writer.prebook(_refs(ids), 30.0)
        late = StorePrebook(prebook.sent, prebook.pages, use_by=0.0)
        assert writer.store(_refs(ids), [0] * 4, list(range(4)), 30.0, prebook=late) == (4, 0)
        assert writer.prebook_missed == 1 and writer.begins_on_path == 1
        assert sidecar.host_pages_used() == 4  # the late reservation went back
        sidecar.controller.check_invariants()
        _stored_exact(sidecar, writer, src, ids, 28)
    finally:
        writer.client.close()
