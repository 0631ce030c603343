"""hicache's tree against SGLang 0.5.20's Python ``RadixCache``, in one process.

Both trees get the workload of ``benchmarks/bench_tree.py`` (64 system prompts,
conversations growing over 4 turns up to the prompt length), as the same page-aligned
token ids: numpy arrays for hicache, ``array("q")`` keys for SGLang (each side's native
input, converted before timing). Each request is ``match_prefix``, allocation of the
missed pages from the tree's own pool allocator, then ``insert``; a second pass matches
every request again (a warm cache, every request a full hit); then both trees are emptied
by ``evict`` calls asking for one prompt's worth of tokens each. Both must report the same
hit tokens for every request and free the same total; the run stops otherwise.

Each side gets its input as its own engine would hand it over, built before any timing:
hicache the token array, SGLang a ``RadixKey`` per request. Garbage is collected before
each side's run, so neither pays for the other's (or a previous run's) dead trees.

Printed per (prompt, page): µs per call of each operation for both, and SGLang's time
over hicache's (above 1: hicache faster). ``match`` is the first pass (misses, partial
hits and the splits they cause), ``match_warm`` the second; both trees are timed on both.
Each case runs ``--repeats`` times, the two trees alternating, and every repeat makes the
same calls on the same tree states: the µs columns keep each call's best time over the
repeats (what a shared machine's preemptions leave alone), and "best totals" is the same
ratio from each side's best repeat as a whole. A cell meets its goal when both do.

Run it in the anchor environment (``scripts/sglang_anchor_env.sh`` builds it):

    .venv-sglang-anchor/bin/python benchmarks/bench_tree_vs_sglang.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import gc
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
OPS = tuple(GOALS)


class Clock:
    """Seconds of every call of each operation, in call order."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {op: [] for op in OPS}

    def arrays(self) -> dict[str, np.ndarray]:
        return {op: np.array(v) for op, v in self.calls.items()}


def run_hicache(requests: list[np.ndarray], page: int, prompt: int) -> dict:
    layout = ModelLayout(("full",), num_kv_heads=1, head_dim=1, dtype="float32")
    total = sum(r.size for r in requests)
    cfg = CacheConfig(page_size=page, full_slots=total + page)
    pools = DevicePools.allocate(layout, cfg)
    cache = UnifiedRadixCache(layout, cfg, pools)
    clock = Clock()
    t_match, t_insert = clock.calls["match"], clock.calls["insert"]
    t_warm, t_evict = clock.calls["match_warm"], clock.calls["evict"]
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
        t_insert.append(time.perf_counter() - t2)
        t_match.append(t1 - t0)
        hits.append(m.prefix_len)
    warm = []
    for tokens in requests:
        t0 = time.perf_counter()
        m = cache.match_prefix(tokens)
        t_warm.append(time.perf_counter() - t0)
        warm.append(m.prefix_len)
    freed = 0
    while True:
        t0 = time.perf_counter()
        got = cache.evict(full_tokens=prompt).full_tokens
        t_evict.append(time.perf_counter() - t0)
        if not got:
            break
        freed += got
    cache.check_invariants()
    pools.close()
    return {"t": clock.arrays(), "hits": hits, "warm": warm, "freed": freed}


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
    radix_keys = [RadixKey(key) for key in keys]
    clock = Clock()
    t_match, t_insert = clock.calls["match"], clock.calls["insert"]
    t_warm, t_evict = clock.calls["match_warm"], clock.calls["evict"]
    hits = []
    for key in radix_keys:
        t0 = time.perf_counter()
        m = tree.match_prefix(MatchPrefixParams(key=key))
        t1 = time.perf_counter()
        n_hit = len(m.device_indices)
        fresh = alloc.alloc(len(key) - n_hit)
        value = torch.cat([m.device_indices, fresh])
        t2 = time.perf_counter()
        tree.insert(InsertParams(key=key, value=value))
        t_insert.append(time.perf_counter() - t2)
        t_match.append(t1 - t0)
        hits.append(n_hit)
    warm = []
    for key in radix_keys:
        t0 = time.perf_counter()
        m = tree.match_prefix(MatchPrefixParams(key=key))
        t_warm.append(time.perf_counter() - t0)
        warm.append(len(m.device_indices))
    freed = 0
    while True:
        t0 = time.perf_counter()
        got = tree.evict(EvictParams(num_tokens=prompt)).num_tokens_evicted
        t_evict.append(time.perf_counter() - t0)
        if not got:
            break
        freed += got
    return {"t": clock.arrays(), "hits": hits, "warm": warm, "freed": freed}


def run_case(prompt: int, page: int, conversations: int, repeats: int) -> dict:
    """Both trees ``repeats`` times, alternating. Per operation: µs per call from each
    call's best time over the repeats (every repeat makes the same calls on the same
    tree states), and from the best repeat's total."""
    requests = [r[: r.size - r.size % page] for r in make_workload(prompt, conversations)]
    keys = [array("q", r.tolist()) for r in requests]
    per_call: dict[str, dict[str, np.ndarray]] = {"hicache": {}, "sglang": {}}
    totals: dict[str, dict[str, float]] = {"hicache": {}, "sglang": {}}
    for _ in range(repeats):
        gc.collect()
        ours = run_hicache(requests, page, prompt)
        gc.collect()
        theirs = run_sglang(keys, page, prompt)
        for what in ("hits", "warm", "freed"):
            if ours[what] != theirs[what]:
                raise SystemExit(f"prompt {prompt} page {page}: the trees disagree on {what}")
        for name, res in (("hicache", ours), ("sglang", theirs)):
            for op, seconds in res["t"].items():
                best = per_call[name].get(op)
                per_call[name][op] = seconds if best is None else np.minimum(best, seconds)
                totals[name][op] = min(totals[name].get(op, np.inf), float(seconds.sum()))
    us = {
        name: {
            op: {
                "per_call": float(per_call[name][op].mean()) * 1e6,
                "total": totals[name][op] / per_call[name][op].size * 1e6,
            }
            for op in OPS
        }
        for name in per_call
    }
    return {
        "prompt": prompt,
        "page": page,
        "requests": len(requests),
        "hit_tokens": sum(ours["hits"]),
        "evict_calls": {name: int(per_call[name]["evict"].size) for name in per_call},
        "us": us,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer conversations")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    conversations = 64 if args.quick else 256
    print(
        f"Python {platform.python_version()}, {platform.processor() or platform.machine()}, "
        f"{conversations} conversations, best of {args.repeats} repeats"
    )
    print(
        "| prompt | page | op | hicache µs | SGLang µs | SGLang / hicache | best totals | goal |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    missed = []
    for prompt in args.prompts:
        for page in args.pages:
            case = run_case(prompt, page, conversations, args.repeats)
            for op in OPS:
                ours, theirs = case["us"]["hicache"][op], case["us"]["sglang"][op]
                ratio = theirs["per_call"] / ours["per_call"]
                ratio_totals = theirs["total"] / ours["total"]
                print(
                    f"| {prompt:,} | {page} | {op} | {ours['per_call']:.1f} | "
                    f"{theirs['per_call']:.1f} | {ratio:.2f}x | {ratio_totals:.2f}x "
                    f"| {GOALS[op]}x |",
                    flush=True,
                )
                if min(ratio, ratio_totals) < GOALS[op]:
                    missed.append(
                        f"prompt {prompt} page {page} {op}: {ratio:.2f}x ({ratio_totals:.2f}x)"
                    )
    print("goals met" if not missed else "below the goal: " + "; ".join(missed))


if __name__ == "__main__":
    main()
