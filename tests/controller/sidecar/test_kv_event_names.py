"""Pages stored with the engine's own name (``PageRef.engine_key``) are published under
that name: a controller's backup of such pages, heard by the KV event publisher, gives
``BlockStored`` / ``BlockRemoved`` with the engine's block hashes, group, kind, block
size and window; pages without one keep their page hashes. The name travels the wire
with the refs, and a malformed one is refused."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from hicache.controller.sidecar.config import SidecarConfig
from hicache.controller.sidecar.kv_events import KvEventPublisher
from hicache.controller.wire.fields import decode_refs, encode_refs
from hicache.controller.wire.protocol import ProtocolError
from hicache.controller_api import PageRef
from hicache.engine_keys import EngineKey, pack_engine_key, unpack_engine_key
from hicache.types import Tier
from tests.support.controller import FULL, PAGE, registered_controller
from tests.support.sidecar import short_tmpdir, wait_for


def _name(i: int) -> EngineKey:
    return EngineKey(0xABC000 + i, 1, "sliding_window", 16, 64)


def test_engine_keys_round_trip_and_bad_ones_are_refused():
    for key in (_name(3), EngineKey(b"\x07" * 32, 0, "full_attention", 16)):
        assert unpack_engine_key(pack_engine_key(key)) == key
    refs = [
        PageRef(FULL, bytes([i]) * 16, bytes(16), i, pack_engine_key(_name(i))) for i in range(3)
    ]
    refs.append(PageRef(FULL, b"\x09" * 16, bytes(16), 3))  # no name: its page hash
    assert decode_refs(encode_refs(refs)) == refs
    assert "e" not in encode_refs(refs[3:])  # not sent when no ref has one
    wire = encode_refs(refs)
    wire["e"][0] = b"\x01\x02"
    with pytest.raises(ProtocolError, match=r"'refs\.e'"):
        decode_refs(wire)


def test_pages_stored_under_the_engines_names_are_published_under_them(tmp_path):
    workdir = short_tmpdir("kn")
    config = SidecarConfig(kv_events_endpoint=f"ipc://{workdir}/ev.sock")
    publisher = KvEventPublisher(config, lambda: PAGE)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    time.sleep(0.2)  # a SUB socket misses what is sent before it is connected
    _, engine, ctl = registered_controller(tmp_path, disk_path=None)
    events: list[dict] = []

    def drain() -> list[dict]:
        while sub.poll(50):
            _, _, payload = sub.recv_multipart()
            events.extend(msgpack.unpackb(payload)[1])
        return events

    try:
        ctl.store.listen(publisher)
        named = engine.write_chain(range(4 * PAGE))
        plain = engine.write_chain(range(100, 100 + 2 * PAGE))
        refs = [
            PageRef(
                r.component, r.page_hash, r.parent_hash, r.device_index, pack_engine_key(_name(i))
            )
            for i, r in enumerate(named.refs([FULL]))
        ]
        assert ctl.backup(refs + plain.refs([FULL])).wait(5.0)
        stored = lambda: [e for e in drain() if e["type"] == "BlockStored"]  # noqa: E731
        wait_for(lambda: sum(len(e["block_hashes"]) for e in stored()) == 6, 10, "6 stored")
        by_group = {e["group_idx"]: e for e in stored()}
        assert by_group[1]["block_hashes"] == [0xABC000 + i for i in range(4)]  # one chain
        assert by_group[1]["kv_cache_spec_kind"] == "sliding_window"
        assert by_group[1]["kv_cache_spec_sliding_window"] == 64
        assert by_group[1]["block_size"] == 16 and by_group[1]["parent_block_hash"] is None
        assert by_group[1]["medium"] == "CPU"
        assert by_group[0]["block_hashes"] == plain.hashes  # no name: the page hashes
        assert by_group[0]["block_size"] == PAGE
        ctl.store.evict(Tier.HOST, 1 << 30)
        removed = lambda: [e for e in drain() if e["type"] == "BlockRemoved"]  # noqa: E731
        wait_for(lambda: sum(len(e["block_hashes"]) for e in removed()) == 6, 10, "6 removed")
        gone = {h for e in removed() if e["group_idx"] == 1 for h in e["block_hashes"]}
        assert gone == {0xABC000 + i for i in range(4)}
        ctl.check_invariants()
    finally:
        ctl.close()
        publisher.close()
        ctx.destroy(linger=0)
