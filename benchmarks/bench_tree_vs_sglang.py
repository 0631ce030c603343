"""hicache's tree against SGLang 0.5.20's Python ``RadixCache``, in one process.

Both trees get the workload of ``benchmarks/bench_tree.py`` (64 system prompts,
conversations growing over 4 turns up to the prompt length), as the same page-aligned
token ids: numpy arrays for hicache, ``array("q")`` keys for SGLang (each side's native
input, converted before timing). Each request is ``match_prefix``, allocation of the
missed pages from the tree's own pool allocator, then ``insert``; a second pass matches
every request again (a warm cache, every request a full hit); then both trees are emptied
by ``evict`` calls asking for one prompt's worth of tokens each. Both must report the same
hit tokens for every request and free the same total; the run stops otherwise.

Printed per (prompt, page): µs per call of each operation for both, and SGLang's time
over hicache's (above 1: hicache faster). Each case runs ``--repeats`` times, the two
trees alternating; the minimum per operation is kept (the machine is shared).

Run it in the anchor environment (``scripts/sglang_anchor_env.sh`` builds it):

    .venv-sglang-anchor/bin/python benchmarks/bench_tree_vs_sglang.py [--quick]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from array import array
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tree import make_workload

from hicache import CacheConfig, DevicePools, ModelLayout, UnifiedRadixCache

GOALS = {"insert": 1.5, "match": 2.5, "match_warm": 2.5, "evict": 1.5}


def run_hicache(requests: list[np.ndarray], page: int, prompt: int) -> dict:
    layout = ModelLayout(("full",), num_kv_heads=1, head_dim=1, dtype="float32")
    total = sum(r.size for r in requests)
    cfg = CacheConfig(page_size=page, full_slots=total + page)
    pools = DevicePools.allocate(layout, cfg)
    cache = UnifiedRadixCache(layout, cfg, pools)
    t = {"match": 0.0, "insert": 0.0, "match_warm": 0.0, "evict": 0.0}
    hits = []
    for tokens in requests:
        t0 = time.perf_counter()
        m = cache.match_prefix(tokens)
        t1 = time.perf_counter()
        fresh = pools.full.pages_to_slots(
            pools.alloc_kv_pages((tokens.size - m.prefix_len) // page)
        )
        slots = np.concatenate([m.device_slots, fresh])
        t2 = time.perf_counter()
        cache.insert(tokens, slots, prev_prefix_len=m.prefix_len)
        t["insert"] += time.perf_counter() - t2
        t["match"] += t1 - t0
        hits.append(m.prefix_len)
    t0 = time.perf_counter()
    warm = [cache.match_prefix(tokens).prefix_len for tokens in requests]
    t["match_warm"] = time.perf_counter() - t0
    calls = freed = 0
    t0 = time.perf_counter()
    while True:
        got = cache.evict(full_tokens=prompt).full_tokens
        if not got:
            break
        calls += 1
        freed += got
    t["evict"] = time.perf_counter() - t0
    cache.check_invariants()
    pools.close()
    return {"t": t, "hits": hits, "warm": warm, "freed": freed, "evict_calls": calls}


def run_sglang(keys: list[array], page: int, prompt: int) -> dict:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    total = sum(len(k) for k in keys)
    if page == 1:
        alloc = TokenToKVPoolAllocator(total + page, torch.float32, "cpu", None, False)
    else:
        alloc = PagedTokenToKVPoolAllocator(total + page, page, torch.float32, "cpu", None, False)
    tree = RadixCache(
        CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page
        )
    )
    t = {"match": 0.0, "insert": 0.0, "match_warm": 0.0, "evict": 0.0}
    hits = []
    for key in keys:
        t0 = time.perf_counter()
        m = tree.match_prefix(MatchPrefixParams(key=RadixKey(key)))
        t1 = time.perf_counter()
        n_hit = len(m.device_indices)
        fresh = alloc.alloc(len(key) - n_hit)
        value = torch.cat([m.device_indices, fresh])
        t2 = time.perf_counter()
        tree.insert(InsertParams(key=RadixKey(key), value=value))
        t["insert"] += time.perf_counter() - t2
        t["match"] += t1 - t0
        hits.append(n_hit)
    t0 = time.perf_counter()
    warm = [len(tree.match_prefix(MatchPrefixParams(key=RadixKey(k))).device_indices) for k in keys]
    t["match_warm"] = time.perf_counter() - t0
    calls = freed = 0
    t0 = time.perf_counter()
    while True:
        got = tree.evict(EvictParams(num_tokens=prompt)).num_tokens_evicted
        if not got:
            break
        calls += 1
        freed += got
    t["evict"] = time.perf_counter() - t0
    return {"t": t, "hits": hits, "warm": warm, "freed": freed, "evict_calls": calls}


def run_case(prompt: int, page: int, conversations: int, repeats: int) -> dict:
    requests = [r[: r.size - r.size % page] for r in make_workload(prompt, conversations)]
    keys = [array("q", r.tolist()) for r in requests]
    best: dict[str, dict[str, float]] = {"hicache": {}, "sglang": {}}
    calls = {}
    for _ in range(repeats):
        ours = run_hicache(requests, page, prompt)
        theirs = run_sglang(keys, page, prompt)
        for what in ("hits", "warm", "freed"):
            if ours[what] != theirs[what]:
                raise SystemExit(f"prompt {prompt} page {page}: the trees disagree on {what}")
        for name, res in (("hicache", ours), ("sglang", theirs)):
            for op, seconds in res["t"].items():
                best[name][op] = min(best[name].get(op, seconds), seconds)
            calls[name] = res["evict_calls"]
    n = len(requests)
    per_call = {
        name: {
            op: best[name][op] / (calls[name] if op == "evict" else n) * 1e6 for op in best[name]
        }
        for name in best
    }
    return {
        "prompt": prompt,
        "page": page,
        "requests": n,
        "hit_tokens": sum(ours["hits"]),
        "evict_calls": calls,
        "us": per_call,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer conversations")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    conversations = 64 if args.quick else 256
    print(f"Python {platform.python_version()}, {platform.processor() or platform.machine()}")
    print(
        "| prompt | page | op | hicache µs | SGLang µs | SGLang / hicache | goal |\n"
        "|---|---|---|---|---|---|---|"
    )
    missed = []
    for prompt in (1024, 8192):
        for page in (1, 16):
            case = run_case(prompt, page, conversations, args.repeats)
            for op in ("insert", "match", "match_warm", "evict"):
                ours, theirs = case["us"]["hicache"][op], case["us"]["sglang"][op]
                ratio = theirs / ours
                print(
                    f"| {prompt:,} | {page} | {op} | {ours:.1f} | {theirs:.1f} | {ratio:.2f}x "
                    f"| {GOALS[op]}x |",
                    flush=True,
                )
                if ratio < GOALS[op]:
                    missed.append(f"prompt {prompt} page {page} {op}: {ratio:.2f}x")
    print("goals met" if not missed else "below the goal: " + "; ".join(missed))


if __name__ == "__main__":
    main()
