"""An engine's own block tensors through a real ``hicache serve`` with one copy each way
(hicache/integrations/engine_blocks.py): stores land in host pages the worker writes
itself, loads come back bit for bit, from host and from disk, and a page that is gone is
a miss that touches no block."""

from __future__ import annotations

import hashlib

import pytest
import torch

from hicache import ModelLayout, PageRef, PinReceipt
from hicache.controller.client import SidecarController
from hicache.controller.wire.protocol import Verb
from hicache.controller_api import PageKey
from hicache.integrations.engine_blocks import BlockSegment, EngineBlocks, HandedPages
from hicache.types import ComponentType
from tests.support.sidecar import Sidecar, short_tmpdir, wait_for

FULL = ComponentType.FULL
HALF = 4096  # bytes of K (and of V) in one block of one layer group
BLOCKS = 64


def _layout() -> ModelLayout:
    # One block per page, its two layers' K and V as the page's two halves.
    return ModelLayout(("full",), num_kv_heads=1, head_dim=HALF // 4, dtype="float32",
                       model_id="engine-blocks-test")  # fmt: skip


def _layout_file(work) -> str:
    import json

    d = _layout().to_dict()
    d["page_size"] = 1
    path = work / "layout.json"
    path.write_text(json.dumps(d))
    return str(path)


def _hash(i: int) -> bytes:
    return hashlib.blake2b(f"block-{i}".encode(), digest_size=16).digest()


@pytest.fixture
def sidecar():
    work = short_tmpdir()
    with Sidecar(work, ["--layout-file", _layout_file(work)]) as s:
        yield s


def _engine(
    sidecar: Sidecar, seed: int, chunk_pages: int | None = 64
) -> tuple[EngineBlocks, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # Two layers, each its own allocation of byte rows (as vLLM's per-layer tensors are);
    # a layer's block row holds its K then V part.
    layers = [
        torch.randint(0, 256, (BLOCKS, HALF), dtype=torch.uint8, generator=g) for _ in range(2)
    ]
    half = HALF // 2
    segments = [
        BlockSegment(layers[0], 0, half, 0),  # layer 0 K -> page K half
        BlockSegment(layers[1], 0, half, half),
        BlockSegment(layers[0], half, half, HALF),  # layer 0 V -> page V half
        BlockSegment(layers[1], half, half, HALF + half),
    ]
    client = SidecarController(sidecar.endpoint, engine_id=f"blocks-{seed}")
    client.attach(_layout(), 1)
    chunk_bytes = None if chunk_pages is None else 2 * HALF * chunk_pages  # None: the default
    engine = EngineBlocks(client, [segments], torch.device("cpu"), FULL, chunk_bytes)
    return engine, layers


def sidecar_flushed(admin) -> bool:
    """Wait until the disk writer has committed every queued page."""
    wait_for(lambda: admin.call(Verb.STATS)["disk"]["pending_writes"] == 0, 30.0, "disk writes")
    return True


def _refs(ids: list[int]) -> list[PageRef]:
    return [PageRef(FULL, _hash(i), _hash(i - 1) if i else b"\0" * 16, 0) for i in ids]


@pytest.mark.parametrize("chunk_pages", [64, 3], ids=["one-chunk", "chunks-of-3"])
def test_blocks_stored_by_one_engine_load_into_another_bit_for_bit(sidecar, chunk_pages):
    writer, src = _engine(sidecar, 1, chunk_pages)
    reader, dst = _engine(sidecar, 2, chunk_pages)
    try:
        assert writer.available and reader.available
        ids = list(range(10))
        stored, dropped = writer.store(_refs(ids), [0] * 10, ids, ttl_s=30.0)
        assert (stored, dropped) == (10, 0)
        again, _ = writer.store(_refs(ids), [0] * 10, ids, ttl_s=30.0)
        assert again == 0  # held already: nothing written twice

        targets = [50, 40, 30, 20, 10, 11, 12, 13, 14, 15]
        assert reader.load([_hash(i) for i in ids], [0] * 10, targets, 30.0, 30.0)
        for s, d in zip(src, dst):
            assert torch.equal(d[targets], s[ids])
    finally:
        writer.client.close()
        reader.client.close()


@pytest.mark.parametrize("chunk_pages", [64, 3], ids=["one-chunk", "chunks-of-3"])
def test_a_store_waits_for_no_commit_and_its_pages_are_found_at_once(sidecar, chunk_pages):
    """No commit's answer is waited for (the last neither): the store returns once its
    commits are sent. The same engine's next lookup, on the same connection, finds every
    page at once; another client finds them too, and loads them bit for bit."""
    writer, src = _engine(sidecar, 11, chunk_pages)
    reader, dst = _engine(sidecar, 12, chunk_pages)
    waited: list[Verb] = []
    call = writer.client._call

    def counting_call(verb, *args, **kwargs):
        waited.append(verb)
        return call(verb, *args, **kwargs)

    writer.client._call = counting_call
    try:
        ids = list(range(300, 310))
        stored, dropped = writer.store(_refs(ids), [0] * 10, [i - 300 for i in ids], 30.0)
        assert (stored, dropped) == (10, 0)
        assert Verb.STORE_COMMIT not in waited, waited
        hits = writer.client.lookup([_hash(i) for i in ids], [FULL]).presence[FULL]
        assert all(int(p) != 0 for p in hits)  # ordered behind the commits it sent
        wait_for(
            lambda: all(
                int(p) != 0
                for p in reader.client.lookup([_hash(i) for i in ids], [FULL]).presence[FULL]
            ),
            5.0,
            "the other client to see the pages",
        )
        targets = [40 + i for i in range(10)]
        assert reader.load([_hash(i) for i in ids], [0] * 10, targets, 30.0, 30.0)
        for s, d in zip(src, dst):
            assert torch.equal(d[targets], s[:10])
    finally:
        writer.client.close()
        reader.client.close()


def test_on_a_cpu_a_store_and_a_load_go_whole_by_default(sidecar, monkeypatch):
    """A CPU engine's copy runs in its own thread: by default a store or a load of up to
    ``io_part_pages`` pages is one part (one copy, one reservation or pin), and the bytes
    arrive."""
    writer, src = _engine(sidecar, 10, chunk_pages=None)
    reader, dst = _engine(sidecar, 11, chunk_pages=None)
    starts = []

    def counted(real):
        def start(blocks, pages, to_host):
            starts.append(len(blocks))
            return real(blocks, pages, to_host)

        return start

    for engine in (writer, reader):
        copy = engine._copies_now()[0]
        monkeypatch.setattr(copy, "start", counted(copy.start))
    try:
        ids = list(range(400, 440))
        assert writer.store(_refs(ids), [0] * 40, list(range(40)), 30.0) == (40, 0)
        assert reader.load([_hash(i) for i in ids], [0] * 40, list(range(40)), 30.0, 30.0)
        assert starts == [40, 40]
        for s, d in zip(src, dst):
            assert torch.equal(d[:40], s[:40])
    finally:
        writer.client.close()
        reader.client.close()


def test_a_load_of_pages_only_on_disk_reads_them_to_host_first(sidecar):
    writer, src = _engine(sidecar, 3)
    reader, dst = _engine(sidecar, 4)
    admin = sidecar.admin()
    try:
        ids = list(range(100, 108))
        assert writer.store(_refs(ids), [0] * 8, [i - 100 for i in ids], 30.0)[0] == 8
        sidecar_flushed(admin)
        admin.call(Verb.EVICT, {"tier": "host", "bytes": 1 << 30})  # disk copies stay
        assert admin.call(Verb.STATS)["host"]["used_pages"]["full"] == 0

        assert reader.load([_hash(i) for i in ids], [0] * 8, list(range(8)), 30.0, 30.0)
        for s, d in zip(src, dst):
            assert torch.equal(d[:8], s[:8])
    finally:
        admin.close()
        writer.client.close()
        reader.client.close()


def test_a_load_of_a_page_nobody_stored_is_a_miss_that_touches_no_block(sidecar):
    reader, dst = _engine(sidecar, 5)
    before = [t.clone() for t in dst]
    try:
        assert not reader.load([_hash(900), _hash(901)], [0, 0], [0, 1], 5.0, 5.0)
        assert all(torch.equal(a, b) for a, b in zip(dst, before))
    finally:
        reader.client.close()


def third_copy_fails(writer: EngineBlocks, monkeypatch) -> list[int]:
    """The writer's third part copy raises; the blocks of each copy started, listed."""
    copy = writer._copies_now()[0]
    started = []
    real_start = copy.start

    def start(blocks, pages, to_host):
        started.append(len(blocks))
        if len(started) == 3:
            raise RuntimeError("the copy failed")
        return real_start(blocks, pages, to_host)

    monkeypatch.setattr(copy, "start", start)
    return started


def test_a_copy_that_fails_mid_store_publishes_only_the_parts_before_it(sidecar, monkeypatch):
    """A store in parts (the first one page, then three): the third part's copy fails.
    The two parts copied before it are published whole; the failed part and the part
    already asked for behind it are given back: none of their pages is visible, none is
    lost."""
    writer, _ = _engine(sidecar, 6, chunk_pages=3)
    reader, dst = _engine(sidecar, 7)
    admin = sidecar.admin()
    ids = list(range(200, 210))  # parts of 1, 3, 3, 3 pages
    started = third_copy_fails(writer, monkeypatch)
    try:
        with pytest.raises(RuntimeError, match="the copy failed"):
            writer.store(_refs(ids), [0] * 10, [i - 200 for i in ids], ttl_s=30.0)
        assert started == [1, 3, 3]
        stats = admin.call(Verb.STATS)
        # the first two parts (4 pages) are on host; the other six were handed back
        assert stats["host"]["used_pages"]["full"] == 4
        hits = reader.client.lookup([_hash(i) for i in ids], [FULL]).presence[FULL]
        assert [int(p) != 0 for p in hits] == [True] * 4 + [False] * 6
        assert reader.load([_hash(i) for i in ids[:4]], [0] * 4, [20, 21, 22, 23], 30.0, 30.0)
        for s, d in zip(writer.groups[0][:2], dst):  # the bytes of the published parts
            assert torch.equal(d[20:24], s.tensor[:4])
    finally:
        admin.close()
        writer.client.close()
        reader.client.close()


def test_a_store_of_one_part_whose_copy_fails_gives_every_page_back(sidecar, monkeypatch):
    """A store small enough for one part (no pipelining): its copy fails, the error
    reaches the caller, the engine's blocks are released, and no page is visible or
    lost; the next store of the same pages succeeds."""
    writer, _ = _engine(sidecar, 8)
    reader, _ = _engine(sidecar, 9)
    admin = sidecar.admin()
    ids = [300, 301]
    copy = writer._copies_now()[0]
    real_start = copy.start
    released = []

    def failing(blocks, pages, to_host):
        raise RuntimeError("the copy failed")

    monkeypatch.setattr(copy, "start", failing)
    try:
        with pytest.raises(RuntimeError, match="the copy failed"):
            writer.store(_refs(ids), [0, 0], [0, 1], 30.0, lambda: released.append(1))
        assert released == [1]
        assert admin.call(Verb.STATS)["host"]["used_pages"]["full"] == 0
        hits = reader.client.lookup([_hash(i) for i in ids], [FULL]).presence[FULL]
        assert [int(p) for p in hits] == [0, 0]
        monkeypatch.setattr(copy, "start", real_start)
        assert writer.store(_refs(ids), [0, 0], [0, 1], 30.0) == (2, 0)
        assert admin.call(Verb.STATS)["host"]["used_pages"]["full"] == 2
    finally:
        admin.close()
        writer.client.close()
        reader.client.close()


def _stored_and_pinned(
    sidecar: Sidecar, writer: EngineBlocks, ids: list[int]
) -> tuple[SidecarController, PinReceipt, HandedPages]:
    """``writer`` stores blocks 0.. as ``ids``; then another session of the engine (vLLM's
    scheduler) pins them and names their host pages, as a worker receives them."""
    assert writer.store(_refs(ids), [0] * len(ids), list(range(len(ids))), 30.0)[0] == len(ids)
    scheduler = SidecarController(sidecar.endpoint, engine_id="blocks-scheduler")
    scheduler.attach(_layout(), 1)
    pin = scheduler.receive_pin(
        scheduler.send_pin([PageKey(FULL, _hash(i)) for i in ids], 30.0, host_pages=True)
    )
    assert pin is not None and min(pin.host_pages) >= 0
    instance = scheduler.sidecar_instance(pin.generation)
    assert instance is not None
    return scheduler, pin, HandedPages(pin.pin_id, instance, pin.deadline, tuple(pin.host_pages))


def test_a_load_under_the_schedulers_pin_copies_at_once_and_holds_its_own_pin(sidecar):
    writer, src = _engine(sidecar, 12)
    reader, dst = _engine(sidecar, 13)
    admin = sidecar.admin()
    try:
        ids = list(range(500, 506))
        scheduler, pin, handed = _stored_and_pinned(sidecar, writer, ids)
        targets = [9, 7, 5, 3, 1, 0]
        hashes = [_hash(i) for i in ids]
        assert reader.load_handed(hashes, [0] * 6, targets, handed, 30.0, 30.0)
        assert reader.handed_voided == 0
        for s, d in zip(src, dst):
            assert torch.equal(d[targets], s[:6])
        scheduler.unpin(pin)
        scheduler.close()
        # the reader's own pin went with its unpin, the scheduler's with its own
        wait_for(lambda: admin.call(Verb.STATS)["pins_active"] == 0, 10.0, "pins released")
    finally:
        admin.close()
        writer.client.close()
        reader.client.close()


def test_a_load_under_a_pin_that_let_go_never_keeps_the_bytes_it_copied(sidecar):
    """The scheduler's pin is released and the pages it named are handed to a store of
    other blocks before the worker copies: the sidecar refuses the worker's pin under it,
    the copy is void, and the load is made again from where the pages are now (disk):
    the right bytes, never the ones the named pages hold now."""
    writer, src = _engine(sidecar, 14)
    other, _ = _engine(sidecar, 15)
    reader, dst = _engine(sidecar, 16)
    admin = sidecar.admin()
    try:
        ids = list(range(600, 604))
        scheduler, _, handed = _stored_and_pinned(sidecar, writer, ids)
        scheduler.close()  # its session goes, and its pin with it
        keys = [PageKey(FULL, _hash(i)) for i in ids]
        refused = reader.client.send_pin(keys, 30.0, under=handed.pin_id)
        assert reader.client.receive_pin(refused) is None  # and nothing stays pinned
        assert admin.call(Verb.STATS)["pins_active"] == 0
        sidecar_flushed(admin)
        admin.call(Verb.EVICT, {"tier": "host", "bytes": 1 << 30})  # disk copies stay
        # Other blocks into the freed host pages (handed out last-freed first).
        assert other.store(_refs(list(range(700, 764))), [0] * 64, list(range(64)), 30.0)[0]
        hashes = [_hash(i) for i in ids]
        assert reader.load_handed(hashes, [0] * 4, [20, 21, 22, 23], handed, 30.0, 30.0)
        assert reader.handed_voided == 1
        for s, d in zip(src, dst):
            assert torch.equal(d[20:24], s[:4])
        assert admin.call(Verb.STATS)["pins_active"] == 0
    finally:
        admin.close()
        writer.client.close()
        other.client.close()
        reader.client.close()


# Each layer's segments of a block of group 0 (see _engine): layer 0's K and V halves, then
# layer 1's, in the order the engine computes them.
LAYERS = {"layer.0": (0, [0, 2]), "layer.1": (0, [1, 3])}


def test_a_layer_wise_load_brings_each_layer_once_waited_for(sidecar):
    writer, src = _engine(sidecar, 6)
    reader, dst = _engine(sidecar, 7)
    try:
        ids = list(range(200, 206))
        assert writer.store(_refs(ids), [0] * 6, [i - 200 for i in ids], 30.0)[0] == 6
        targets = [60, 50, 40, 30, 20, 10]
        load = reader.start_layer_load(
            [_hash(i) for i in ids], [0] * 6, targets, LAYERS, 30.0, 30.0
        )
        for j, name in enumerate(LAYERS):
            assert load.wait(name)
            assert torch.equal(dst[j][targets], src[j][:6])  # this layer is in
        assert load.finish() and load.finish()
    finally:
        writer.client.close()
        reader.client.close()


def test_a_layer_wise_load_of_a_page_nobody_stored_fails_every_layer_and_touches_nothing(sidecar):
    reader, dst = _engine(sidecar, 8)
    before = [t.clone() for t in dst]
    try:
        load = reader.start_layer_load([_hash(990), _hash(991)], [0, 0], [0, 1], LAYERS, 5.0, 5.0)
        assert not load.wait("layer.0") and not load.wait("layer.1")
        assert load.finish() is False
        assert all(torch.equal(a, b) for a, b in zip(dst, before))
    finally:
        reader.client.close()
