"""The KV events of a real ``hicache serve``, read with vLLM's own decoder: every batch
decodes as vLLM 0.32's ``KVEventBatch`` and re-encodes, with vLLM's encoder, to the very
bytes the sidecar sent; and a real vLLM engine's blocks, stored through the connector,
are published under vLLM's own block hashes (those of vLLM's own GPU events).

Runs in ``.venv-vllm`` (``make test-vllm``).
"""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
from conftest import Instance
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from hicache.controller.wire.protocol import Verb
from hicache.keys import page_hashes
from tests.controller.sidecar import test_kv_events as cpu_suite
from tests.controller.sidecar.test_kv_events import MIX, PAGE, Subscriber, replay
from tests.support.cache import make_layout
from tests.support.sidecar import Sidecar, wait_for

node = cpu_suite.node  # the same sidecar, subscriber and engine as the CPU suite's


def test_vllm_decodes_the_sidecar_stream_byte_for_byte(node):
    sc, sub, engine = node
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    encoder = msgspec.msgpack.Encoder()
    tokens = list(range(300, 332))
    want = page_hashes(np.array(tokens), make_layout(MIX).fingerprint(PAGE), PAGE)
    engine.call("run", tokens=tokens)

    def stored(medium: str) -> set[bytes]:
        sub.drain()
        return {
            h
            for _, payload in sub.batches
            for ev in decoder.decode(payload).events
            if isinstance(ev, BlockStored) and ev.medium == medium and ev.group_idx == 0
            for h in ev.block_hashes
        }

    wait_for(lambda: set(want) <= stored("CPU"), 30, "BlockStored on CPU")
    wait_for(lambda: set(want) <= stored("STORAGE"), 30, "BlockStored on STORAGE")
    admin = sc.admin()
    admin.call(Verb.CLEAR, {"tiers": ["host", "disk"], "all_namespaces": True})
    admin.close()

    def cleared() -> bool:
        sub.drain()
        return isinstance(decoder.decode(sub.batches[-1][1]).events[-1], AllBlocksCleared)

    wait_for(cleared, 30, "AllBlocksCleared")
    batches = [decoder.decode(p) for _, p in sub.batches]
    for (_, payload), batch in zip(sub.batches, batches, strict=True):
        assert encoder.encode(batch) == payload
    events = [ev for b in batches for ev in b.events]
    kinds = {(ev.group_idx, ev.kv_cache_spec_kind) for ev in events if isinstance(ev, BlockStored)}
    assert kinds == {(0, "full_attention"), (1, "sliding_window"), (2, "mamba")}
    removed = {h for ev in events if isinstance(ev, BlockRemoved) for h in ev.block_hashes}
    assert set(want) <= removed
    assert [decoder.decode(p) for _, p in replay(sc.info["kv_events_replay"], 0)] == batches


def _decoded(sub: Subscriber) -> list:
    """Every event a subscriber got so far, decoded by vLLM's own decoder."""
    sub.drain()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    return [ev for _, payload in sub.batches for ev in decoder.decode(payload).events]


def _stored_hashes(events: list, medium: str) -> set:
    return {
        h
        for ev in events
        if isinstance(ev, BlockStored) and ev.medium == medium
        for h in ev.block_hashes
    }


@pytest.mark.timeout(1200)  # a vLLM start takes 1-2 minutes on a busy machine
def test_a_real_vllm_engines_blocks_are_published_under_vllms_block_hashes(
    tiny_model, sidecar_dir
) -> None:
    """A vLLM engine with the connector serves a prompt; vLLM's own publisher says which
    blocks its GPU stored. The sidecar then publishes the same block hashes, in vLLM's
    group and kind, stored on CPU (host) and then STORAGE (disk); removed from CPU when
    the host tier evicts them; and every tier cleared by ``hicachectl clear``."""
    args = [
        "--kv-events-endpoint",
        f"ipc://{sidecar_dir}/ev.sock",
        "--kv-events-replay-endpoint",
        f"ipc://{sidecar_dir}/replay.sock",
    ]
    sidecar = Sidecar(sidecar_dir, args).start()
    ours = Subscriber(sidecar.info["kv_events"])
    theirs = Subscriber(f"ipc://{sidecar_dir}/vllm-ev.sock")  # connects before vLLM binds
    instance = None
    try:
        rng = random.Random(7)
        prompt = [rng.randrange(1, 500) for _ in range(100)]  # three blocks of 32, a tail
        instance = Instance(
            sidecar_dir, "A", tiny_model, [[prompt]], sidecar.socket,
            kv_events=f"ipc://{sidecar_dir}/vllm-ev.sock",
        )  # fmt: skip
        assert instance.result()[0]["results"][0]["tokens"]
        gpu = _stored_hashes(_decoded(theirs), "GPU")
        assert len(gpu) == 3, f"vLLM's GPU events name {len(gpu)} blocks"

        wait_for(lambda: gpu <= _stored_hashes(_decoded(ours), "CPU"), 60, "CPU events")
        wait_for(lambda: gpu <= _stored_hashes(_decoded(ours), "STORAGE"), 60, "disk events")
        named = [
            ev
            for ev in _decoded(ours)
            if isinstance(ev, BlockStored) and set(ev.block_hashes) & gpu
        ]
        assert {(ev.group_idx, ev.kv_cache_spec_kind, ev.block_size) for ev in named} == {
            (0, "full_attention", 32)
        }
        assert {ev.locality for ev in named} == {"LOCAL"}

        admin = sidecar.admin()
        admin.call(Verb.EVICT, {"tier": "host", "bytes": 1 << 40})

        def removed_from_host() -> bool:
            events = _decoded(ours)
            return gpu <= {
                h
                for ev in events
                if isinstance(ev, BlockRemoved) and ev.medium == "CPU"
                for h in ev.block_hashes
            }

        wait_for(removed_from_host, 60, "BlockRemoved on CPU after the host eviction")
        admin.call(Verb.CLEAR, {"tiers": ["host", "disk"], "all_namespaces": True})
        admin.close()
        wait_for(lambda: isinstance(_decoded(ours)[-1], AllBlocksCleared), 60, "AllBlocksCleared")
        removed = {
            h
            for ev in _decoded(ours)
            if isinstance(ev, BlockRemoved) and ev.medium == "STORAGE"
            for h in ev.block_hashes
        }
        assert gpu <= removed  # the clear took them off disk too
    finally:
        if instance is not None:
            instance.stop()
        ours.close()
        theirs.close()
        sidecar.stop()
