"""KV events of a real ``hicache serve``: what an engine stores shows up as ``BlockStored``
on host (CPU) and disk (STORAGE), a clear as ``BlockRemoved`` and ``AllBlocksCleared``, and
a late subscriber gets every batch again from the replay endpoint.

The payloads are decoded here with plain msgpack; tests/engines/vllm/test_vllm_kv_events.py
decodes the same stream with vLLM's own decoder.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from hicache.controller.wire.protocol import Verb
from hicache.keys import namespace_hash, page_hashes
from tests.support.cache import make_layout
from tests.support.sidecar import EngineProc, Sidecar, layout_file, short_tmpdir, wait_for

MIX = "full+swa+mamba"
PAGE = 4
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def events_args(workdir: Path) -> list[str]:
    return [
        "--layout-file",
        str(layout_file(workdir, MIX, PAGE)),
        "--kv-events-endpoint",
        f"ipc://{workdir}/ev.sock",
        "--kv-events-replay-endpoint",
        f"ipc://{workdir}/replay.sock",
    ]


class Subscriber:
    """A SUB socket on a sidecar's events; batches kept as (seq, payload) in order."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.batches: list[tuple[int, bytes]] = []

    def drain(self) -> list[dict]:
        while self.sub.poll(50):
            topic, seq, payload = self.sub.recv_multipart()
            self.batches.append((int.from_bytes(seq, "big"), payload))
        return self.events()

    def events(self) -> list[dict]:
        return [ev for _, p in self.batches for ev in msgpack.unpackb(p)[1]]

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Every buffered batch from ``start`` on, as vLLM's replay protocol answers it."""
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def node():
    workdir = short_tmpdir("ke")
    with Sidecar(workdir, events_args(workdir)) as sc:
        sub = Subscriber(sc.info["kv_events"])
        time.sleep(0.2)  # a SUB socket misses what is sent before it is connected
        engine = EngineProc(sc.endpoint, "A", MIX)
        try:
            engine.receive()
            yield sc, sub, engine
        finally:
            engine.close()
            sub.close()


def stored(events: list[dict], medium: str, group: int) -> list[bytes]:
    return [
        h
        for ev in events
        if ev["type"] == "BlockStored" and ev["medium"] == medium and ev["group_idx"] == group
        for h in ev["block_hashes"]
    ]


def test_stored_pages_are_published_per_tier_and_component(node):
    sc, sub, engine = node
    tokens = list(range(100, 132))  # 8 pages
    engine.call("run", tokens=tokens)
    fp = make_layout(MIX).fingerprint(PAGE)
    want = page_hashes(np.array(tokens), fp, PAGE)

    wait_for(lambda: set(want) <= set(stored(sub.drain(), "CPU", 0)), 30, "host FULL events")
    wait_for(lambda: set(want) <= set(stored(sub.drain(), "STORAGE", 0)), 30, "disk events")
    events = sub.events()
    full = [e for e in events if e["type"] == "BlockStored" and e["group_idx"] == 0]
    assert {e["kv_cache_spec_kind"] for e in full} == {"full_attention"}
    assert all(e["block_size"] == PAGE and e["locality"] == "LOCAL" for e in full)
    first = next(e for e in full if e["block_hashes"][0] == want[0] and e["medium"] == "CPU")
    assert first["parent_block_hash"] == namespace_hash(fp, None)
    mamba = [e for e in events if e["type"] == "BlockStored" and e["group_idx"] == 2]
    assert mamba and {e["kv_cache_spec_kind"] for e in mamba} == {"mamba"}
    assert set(stored(events, "CPU", 2)) <= set(want)  # a state at a page's end
    seqs = [s for s, _ in sub.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_clear_publishes_removals_then_all_cleared_and_replay_repeats_the_stream(node):
    sc, sub, engine = node
    engine.call("run", tokens=list(range(7, 39)))
    wait_for(lambda: stored(sub.drain(), "STORAGE", 0), 30, "disk events")
    admin = sc.admin()
    admin.call(Verb.CLEAR, {"tiers": ["host", "disk"], "all_namespaces": True})
    admin.close()
    events = wait_for(
        lambda: (ev := sub.drain()) and ev[-1]["type"] == "AllBlocksCleared" and ev, 30, "clear"
    )
    removed = {
        (e["medium"], h) for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]
    }
    for medium in ("CPU", "STORAGE"):
        assert {(medium, h) for h in stored(events, medium, 0)} <= removed

    assert replay(sc.info["kv_events_replay"], 0) == sub.batches
    assert replay(sc.info["kv_events_replay"], sub.batches[-1][0]) == sub.batches[-1:]
