"""``hicache_layerwise`` on the real vLLM CPU engine: a hit is scheduled at once and loaded
inside the step that computes the rest of the prompt, each attention layer waiting for its
own blocks (``wait_for_layer_load``).

A (the default whole-block path) serves P, P again (vLLM's native hit), Q and R. B, with
``hicache_layerwise``, serves P from the host tier: its logprobs equal A's native hit bit
for bit. The host tier is then emptied (Q and R on disk only) and one of R's pages
corrupted on disk: B serves Q from disk (its pages read to host, then copied layer by
layer) and R, whose load fails inside the step: vLLM recomputes the failed blocks
(reported by ``get_block_ids_with_load_errors``) and R is right.
"""

from __future__ import annotations

import lmdb
import pytest
from conftest import Instance, sidecar_stats
from test_vllm_tiers import CACHED, max_diff, prompt, serve_first

from hicache.controller.store.page_codec import HEADER_BYTES
from hicache.controller.wire.protocol import Verb
from tests.support.sidecar import Sidecar

LAYERWISE = {"hicache_layerwise": True}


@pytest.mark.timeout(2400)  # two vLLM starts of 1-2 minutes each on a busy machine
def test_layer_wise_hits_equal_the_native_hit_and_a_failed_load_recomputes(
    tiny_model, sidecar_dir
) -> None:
    p, q, r = prompt(1), prompt(2), prompt(3)
    sidecar = Sidecar(sidecar_dir).start()
    instances: list[Instance] = []
    try:
        (a_cold_p, a_native_p, a_q, a_r), keys_r = serve_first(
            sidecar_dir, tiny_model, sidecar, instances, p, q, r
        )
        copied = sidecar_stats(sidecar).get("load.engine_copied", 0)

        b = Instance(
            sidecar_dir, "B", tiny_model, [[p], [q], [r]], sidecar.socket,
            pause_before=(1,), extra=LAYERWISE,
        )  # fmt: skip
        instances.append(b)
        b.wait_paused(1)
        # B's layer-wise load of P: copied by its worker from the mapped host pages.
        assert sidecar_stats(sidecar).get("load.engine_copied", 0) >= copied + 1
        admin = sidecar.admin()
        try:  # Q and R on disk only from now on
            admin.call(Verb.EVICT, {"tier": "host", "bytes": 1 << 40})
        finally:
            admin.close()
        env = lmdb.open(str(sidecar.disk), subdir=True, max_dbs=0)
        with env.begin(write=True) as txn:  # and one of R's pages rots there
            victim = sorted(keys_r)[0]
            value = bytearray(txn.get(victim))
            value[HEADER_BYTES + 7] ^= 0xFF
            txn.put(victim, bytes(value))
        env.close()
        b.resume(1)
        b_p, b_q, b_r = (rnd["results"][0] for rnd in b.result())
        # Connector hits, loaded layer by layer inside the step: a native hit's bits.
        assert b_p["num_cached_tokens"] == CACHED
        assert b_p["tokens"] == a_native_p["tokens"]
        assert b_p["logprobs"] == a_native_p["logprobs"]
        hit_vs_cold = max_diff(b_p["logprobs"], a_cold_p["logprobs"])
        print(f"layer-wise hit vs cold: max logprob difference {hit_vs_cold}")
        # From the disk tier (A served Q cold: no native hit to compare
        # bit for bit; a hit's reordered sums against a cold prefill stay under 1e-4).
        assert b_q["num_cached_tokens"] == CACHED
        assert b_q["tokens"] == a_q["tokens"]
        assert max_diff(b_q["logprobs"], a_q["logprobs"]) < 1e-4
        # R's load fails inside the step: vLLM recomputes the blocks, and R is right.
        assert b_r["tokens"] == a_r["tokens"]
        assert max_diff(b_r["logprobs"], a_r["logprobs"]) < 1e-4
        assert sidecar_stats(sidecar)["failures.checksum"] >= 1
    finally:
        for inst in instances:
            inst.stop()
        sidecar.stop()
        sidecar.kill()
