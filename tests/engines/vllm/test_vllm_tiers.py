"""hicache as vLLM's host and disk tier, on the real vLLM CPU engine.

One sidecar, three vLLM instances, each its own process:

* A serves prompts P, Q, R cold (its connector stores their blocks) and P again (a
  native prefix-cache hit inside A);
* B serves P with connector hits from the sidecar's host tier: its logprobs equal A's
  native hit bit for bit. Then the sidecar is killed and B serves Q: it recomputes and
  its output is A's;
* the sidecar restarts on its LMDB tier, one of R's pages corrupted on disk meanwhile; C
  serves P from disk (equal bits again) and R, whose load fails its checksum: C
  recomputes R and its output is right.
"""

from __future__ import annotations

import random

import lmdb
import pytest
from conftest import Instance, sidecar_stats, worker_counters

from hicache.controller.store.page_codec import HEADER_BYTES
from tests.support.sidecar import Sidecar, wait_for

PROMPT_TOKENS = 100  # three whole blocks of 32 tokens, and a tail
BLOCK_TOKENS = 32
CACHED = (PROMPT_TOKENS // BLOCK_TOKENS) * BLOCK_TOKENS


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(PROMPT_TOKENS)]


def disk_keys(sidecar: Sidecar) -> set[bytes]:
    """The page keys committed to the sidecar's LMDB (read-only, beside the sidecar)."""
    env = lmdb.open(str(sidecar.disk), readonly=True, lock=False, subdir=True, max_dbs=0)
    try:
        with env.begin() as txn:
            return {bytes(k) for k, _ in txn.cursor()}
    finally:
        env.close()


def wait_committed(sidecar: Sidecar, pages: int) -> None:
    wait_for(
        lambda: (
            sidecar_stats(sidecar).get("disk.pages.full", 0) >= pages
            and sidecar_stats(sidecar)["disk.pending_writes"] == 0
        ),
        120,
        f"{pages} pages on disk",
        every_s=0.2,
    )


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def serve_first(sidecar_dir, model, sidecar: Sidecar, instances: list, p, q, r):
    """Instance A serves P cold, P again (vLLM's native hit), Q and R, its connector storing
    them: A's four results, and the disk keys of R's pages."""
    pages_per_prompt = PROMPT_TOKENS // BLOCK_TOKENS
    a = Instance(sidecar_dir, "A", model, [[p], [p], [q], [r]], sidecar.socket, pause_before=(3,))
    instances.append(a)
    a.wait_paused(3)
    wait_committed(sidecar, 2 * pages_per_prompt)
    keys_pq = disk_keys(sidecar)
    a.resume(3)
    results = [rnd["results"][0] for rnd in a.result()]
    a_cold_p, a_native_p = results[:2]
    assert a_cold_p["num_cached_tokens"] == 0 and a_native_p["num_cached_tokens"] == CACHED
    assert a_native_p["tokens"] == a_cold_p["tokens"]
    wait_committed(sidecar, 3 * pages_per_prompt)
    # Its stores' host pages were asked for a step ahead (hicache_store_ahead, the default).
    counters = worker_counters(a.log)
    print(f"instance A's worker: {counters}")
    assert counters.get("store_prebooked_pages", 0) >= 3 * pages_per_prompt, counters
    keys_r = disk_keys(sidecar) - keys_pq
    assert len(keys_r) == pages_per_prompt
    return results, keys_r


@pytest.mark.timeout(2400)  # three vLLM starts of 1-2 minutes each on a busy machine
def test_instances_share_the_host_tier_then_the_disk_tier(tiny_model, sidecar_dir) -> None:
    p, q, r = prompt(1), prompt(2), prompt(3)
    pages_per_prompt = PROMPT_TOKENS // BLOCK_TOKENS
    sidecar = Sidecar(sidecar_dir).start()
    instances: list[Instance] = []
    try:
        (a_cold_p, a_native_p, a_q, a_r), keys_r = serve_first(
            sidecar_dir, tiny_model, sidecar, instances, p, q, r
        )

        b = Instance(sidecar_dir, "B", tiny_model, [[p], [q]], sidecar.socket, pause_before=(1,))
        instances.append(b)
        b.wait_paused(1)
        stats = sidecar_stats(sidecar)
        assert stats["lookup.host.full"] >= pages_per_prompt
        # B's load of P's host pages: copied once, by its worker, from the sidecar's host
        # pages mapped in it (integrations/engine_blocks.py); vLLM's stores likewise
        assert stats.get("load.engine_copied", 0) >= 1
        assert stats["engine_stores.pages_committed"] >= 3 * pages_per_prompt
        sidecar.kill()  # B is running: its next lookups and loads meet a dead sidecar
        b.resume(1)
        b_p, b_q = (rnd["results"][0] for rnd in b.result())
        # Connector hits: the host tier's pages, bit for bit those of a native hit.
        assert b_p["num_cached_tokens"] == CACHED
        assert b_p["tokens"] == a_native_p["tokens"]
        assert b_p["logprobs"] == a_native_p["logprobs"]
        hit_vs_cold = max_diff(b_p["logprobs"], a_cold_p["logprobs"])
        print(f"connector hit vs cold: max logprob difference {hit_vs_cold}")
        # The sidecar died: Q is recomputed, and right.
        assert b_q["num_cached_tokens"] == 0
        assert b_q["tokens"] == a_q["tokens"]
        recomputed = max_diff(b_q["logprobs"], a_q["logprobs"])
        print(f"recomputed after the sidecar's death vs cold: max difference {recomputed}")

        # One of R's pages rots on disk while the sidecar is down.
        env = lmdb.open(str(sidecar.disk), subdir=True, max_dbs=0)
        with env.begin(write=True) as txn:
            victim = sorted(keys_r)[0]
            value = bytearray(txn.get(victim))
            value[HEADER_BYTES + 7] ^= 0xFF
            txn.put(victim, bytes(value))
        env.close()
        sidecar.start()

        c = Instance(sidecar_dir, "C", tiny_model, [[p], [r]], sidecar.socket)
        instances.append(c)
        c_p, c_r = (rnd["results"][0] for rnd in c.result())
        # From the disk tier after the restart: the same bits again.
        assert c_p["num_cached_tokens"] == CACHED
        assert c_p["logprobs"] == a_native_p["logprobs"]
        # The corrupt page fails its checksum: C recomputes R, and R is right.
        assert c_r["tokens"] == a_r["tokens"]
        assert max_diff(c_r["logprobs"], a_r["logprobs"]) < 1e-4
        stats = sidecar_stats(sidecar)
        assert stats["lookup.disk.full"] >= 2 * pages_per_prompt
        assert stats["failures.checksum"] >= 1
        # Pages only on disk: the sidecar reads them to host, the worker copies them in.
        assert stats["prefetch.pages"] >= pages_per_prompt
        assert stats["load.engine_copied"] >= 1
    finally:
        for inst in instances:
            inst.stop()
        sidecar.stop()
        sidecar.kill()
