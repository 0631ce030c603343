"""A full + sliding-window model (a tiny random Gemma 3) on the real vLLM CPU engine.

vLLM's hybrid allocator gives the model two KV cache groups (full attention, and the
sliding window of 64 tokens); the connector stores every group's blocks and loads them
back under vLLM's own window rules, as the engine itself applies them:

* A serves a prompt longer than the window cold, then again (vLLM's native prefix hit);
* B, a second instance on the same sidecar, serves it with connector hits from the host
  tier: as many cached tokens as A's native hit, and the same logprobs bit for bit;
* B then serves a prompt that A served after P, sharing P's first four blocks: its blocks
  come from the sidecar (more than the shared four: A stored the rest), and B's output is
  A's.
"""

from __future__ import annotations

import json
import random

import pytest
from conftest import Instance, sidecar_stats
from vllm_instance import make_tiny_gemma3

from tests.support.sidecar import Sidecar

BLOCK_TOKENS = 32
PROMPT_TOKENS = 300  # nine whole blocks and a tail: far past the 64-token window
SHARED_TOKENS = 4 * BLOCK_TOKENS
# The hits are what is tested, not their latency: on a loaded machine a lookup answered
# after the default deadline would be a miss, so the deadline is long here.
PATIENT = {"hicache_lookup_deadline_ms": 60000}


def prompt(seed: int, tokens: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(tokens)]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.mark.timeout(2400)  # two vLLM starts of 1-2 minutes each on a busy machine
def test_a_sliding_window_model_hits_through_the_sidecar_bit_for_bit(
    tiny_gemma3, sidecar_dir
) -> None:
    p = prompt(11)
    branch = p[:SHARED_TOKENS] + prompt(12, PROMPT_TOKENS - SHARED_TOKENS)
    sidecar = Sidecar(sidecar_dir).start()
    instances: list[Instance] = []
    try:
        a = Instance(
            sidecar_dir, "A", tiny_gemma3, [[p], [p], [branch]], sidecar.socket, extra=PATIENT
        )
        instances.append(a)
        a_cold, a_native, a_branch = (rnd["results"][0] for rnd in a.result())
        assert a_cold["num_cached_tokens"] == 0
        native = a_native["num_cached_tokens"]
        assert native >= (PROMPT_TOKENS // BLOCK_TOKENS - 1) * BLOCK_TOKENS
        assert a_native["tokens"] == a_cold["tokens"]
        # vLLM's hybrid allocator runs with the connector: two KV cache groups
        engine = json.loads(a.out.with_suffix(".engine.json").read_text())
        assert engine["hybrid_kv_cache_manager"] is True
        stats = sidecar_stats(sidecar)
        assert stats["engine_stores.pages_committed"] > 0

        b = Instance(sidecar_dir, "B", tiny_gemma3, [[p], [branch]], sidecar.socket, extra=PATIENT)
        instances.append(b)
        b_p, b_branch = (rnd["results"][0] for rnd in b.result())
        # Connector hits of both groups, from the host tier: what vLLM's own prefix
        # cache would have given, bit for bit.
        assert b_p["num_cached_tokens"] == native
        assert b_p["tokens"] == a_native["tokens"]
        assert b_p["logprobs"] == a_native["logprobs"]
        # The branch: A stored its own blocks past the four it shares with p, so B hits
        # more than the shared part, and continues as A did.
        assert b_branch["num_cached_tokens"] > SHARED_TOKENS
        assert b_branch["tokens"] == a_branch["tokens"]
        assert max(abs(x - y) for x, y in zip(b_branch["logprobs"], a_branch["logprobs"])) < 1e-4
        stats = sidecar_stats(sidecar)
        assert stats["lookup.host.full"] > 0
        assert stats.get("load.engine_copied", 0) >= 1
    finally:
        for inst in instances:
            inst.stop()
        sidecar.stop()
        sidecar.kill()
