"""The KV events of a real ``hicache serve``, read with vLLM's own decoder: every batch
decodes as vLLM 0.32's ``KVEventBatch`` and re-encodes, with vLLM's encoder, to the very
bytes the sidecar sent.

Runs in ``.venv-vllm`` (``make test-vllm``).
"""

from __future__ import annotations

import msgspec
import numpy as np
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from hicache.controller.wire.protocol import Verb
from hicache.keys import page_hashes
from tests.controller.sidecar import test_kv_events as cpu_suite
from tests.controller.sidecar.test_kv_events import MIX, PAGE, replay
from tests.support.cache import make_layout
from tests.support.sidecar import wait_for

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
