"""Tree operation throughput on a shared-prefix chat workload, against the floor.

Workload: 64 system prompts; conversations that each reuse one and grow over 4 turns up to
the prompt length (1k or 8k tokens). Every request matches its prompt, then inserts it.
Afterwards the whole tree is evicted a leaf at a time.

The floor, measured in the same run on the same inputs, is the least any paged prefix
cache must do per request: cut the tokens into page keys. The table prints each operation's
mean cost, ops/s, and match_prefix's cost as a multiple of that floor. A second table
matches a prompt the device evicted and the host tier holds (the lookup of every page
through an in-process ``LocalController``), against the same match while it is on the
device.

    .venv/bin/python benchmarks/bench_tree.py [--quick]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from hicache import CacheConfig, DevicePools, ModelLayout, UnifiedRadixCache

TURNS = 4
SYSTEM_PROMPTS = 64


def make_workload(prompt_len: int, conversations: int, seed: int = 0) -> list[np.ndarray]:
    """Requests in arrival order: conversations interleaved, turn by turn."""
    rng = np.random.default_rng(seed)
    sys_len = prompt_len // 2
    systems = [rng.integers(1, 32000, sys_len) for _ in range(SYSTEM_PROMPTS)]
    convs = []
    for c in range(conversations):
        body = rng.integers(1, 32000, prompt_len - sys_len)
        convs.append(np.concatenate([systems[c % SYSTEM_PROMPTS], body]))
    step = (prompt_len - sys_len) // TURNS
    return [conv[: sys_len + step * (t + 1)] for t in range(TURNS) for conv in convs]


def floor_cost(requests: list[np.ndarray], page_size: int) -> float:
    """Seconds per request to cut its tokens into page keys (bytes of each page)."""
    step = page_size * 8
    start = time.perf_counter()
    for tokens in requests:
        b = tokens.tobytes()
        _ = [b[i : i + step] for i in range(0, len(b) - step + 1, step)]
    return (time.perf_counter() - start) / len(requests)


def run_case(prompt_len: int, page_size: int, conversations: int) -> dict:
    layout = ModelLayout(("full",), num_kv_heads=1, head_dim=1, dtype="float32")
    requests = make_workload(prompt_len, conversations)
    total_tokens = sum(r.size for r in requests)
    cfg = CacheConfig(page_size=page_size, full_slots=total_tokens + page_size)
    pools = DevicePools.allocate(layout, cfg)
    cache = UnifiedRadixCache(layout, cfg, pools)
    t_match = t_insert = 0.0
    hit = 0
    for tokens in requests:
        t0 = time.perf_counter()
        m = cache.match_prefix(tokens)
        t1 = time.perf_counter()
        aligned = tokens.size - tokens.size % page_size
        fresh = pools.full.pages_to_slots(
            pools.alloc_kv_pages((aligned - m.prefix_len) // page_size)
        )
        slots = np.concatenate([m.device_slots, fresh])
        t2 = time.perf_counter()
        cache.insert(tokens[:aligned], slots, prev_prefix_len=m.prefix_len)
        t3 = time.perf_counter()
        t_match += t1 - t0
        t_insert += t3 - t2
        hit += m.prefix_len
    # A second pass: every request now hits fully (the steady state of a warm cache).
    t0 = time.perf_counter()
    for tokens in requests:
        cache.match_prefix(tokens)
    t_match_warm = time.perf_counter() - t0
    floor = min(floor_cost(requests, page_size) for _ in range(3))
    leaves = 0
    t0 = time.perf_counter()
    while cache.evict(full_tokens=1).full_tokens:
        leaves += 1
    t_evict = time.perf_counter() - t0
    n = len(requests)
    return {
        "prompt": prompt_len,
        "page": page_size,
        "requests": n,
        "hit_ratio": hit / total_tokens,
        "match_us": t_match / n * 1e6,
        "match_warm_us": t_match_warm / n * 1e6,
        "insert_us": t_insert / n * 1e6,
        "evict_us": t_evict / max(leaves, 1) * 1e6,
        "floor_us": floor * 1e6,
    }


def run_host_case(prompt_len: int, page_size: int, kinds: tuple[str, ...]) -> dict:
    """match_prefix of a prompt the device evicted and the host tier (an in-process
    ``LocalController``) holds: the tree walk plus the controller lookup of every page,
    against a match of the same prompt while it is on the device."""
    from hicache.controller.config import ControllerConfig
    from hicache.controller.local import LocalController

    layout = ModelLayout(kinds, num_kv_heads=1, head_dim=1, dtype="float32")
    cfg = CacheConfig(page_size=page_size, full_slots=2 * prompt_len, sliding_window=1024)
    pools = DevicePools.allocate(layout, cfg)
    ctl = LocalController(ControllerConfig(host_pool_bytes=64 << 20))
    cache = UnifiedRadixCache(layout, cfg, pools, controller=ctl)
    tokens = make_workload(prompt_len, 1)[-1]
    tokens = tokens[: tokens.size - tokens.size % page_size]
    slots = pools.full.pages_to_slots(pools.alloc_kv_pages(tokens.size // page_size))
    cache.insert(tokens, slots)
    reps = 200

    def timed() -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            cache.match_prefix(tokens)
        return (time.perf_counter() - t0) / reps * 1e6

    device_us = timed()
    cache.flush_backups()
    cache.evict(full_tokens=10**9)
    m = cache.match_prefix(tokens)
    assert m.prefix_len == 0 and m.host_hit_len == tokens.size, "the prompt must be on host"
    host_us = timed()
    cache.check_invariants()
    ctl.close()
    return {"device_us": device_us, "host_us": host_us, "pages": tokens.size // page_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer conversations")
    args = parser.parse_args()
    conversations = 64 if args.quick else 256
    print(
        f"# tree benchmark, {platform.processor() or platform.machine()}, "
        f"python {platform.python_version()}, {conversations} conversations x {TURNS} turns"
    )
    header = (
        f"{'prompt':>6} {'page':>4} {'hit%':>5} {'match µs':>9} {'warm µs':>8} "
        f"{'match/s':>9} {'insert µs':>9} {'insert/s':>9} {'evict µs':>8} {'evict/s':>9} "
        f"{'floor µs':>8} {'warm/floor':>10}"
    )
    print(header)
    for prompt_len in (1024, 8192):
        for page_size in (1, 16, 64):
            r = run_case(prompt_len, page_size, conversations)
            print(
                f"{r['prompt']:>6} {r['page']:>4} {100 * r['hit_ratio']:>5.1f} "
                f"{r['match_us']:>9.1f} {r['match_warm_us']:>8.1f} "
                f"{1e6 / r['match_warm_us']:>9.0f} {r['insert_us']:>9.1f} "
                f"{1e6 / r['insert_us']:>9.0f} {r['evict_us']:>8.1f} "
                f"{1e6 / r['evict_us']:>9.0f} {r['floor_us']:>8.1f} "
                f"{r['match_warm_us'] / r['floor_us']:>10.2f}"
            )
    print("\n# match of a prompt on the host tier (LocalController), page 16")
    print(
        f"{'prompt':>6} {'layout':>9} {'pages':>5} {'host-hit µs':>11} {'device-hit µs':>13} "
        f"{'host/device':>11}"
    )
    for prompt_len in (1024, 8192):
        for kinds in (("full",), ("full", "swa")):
            r = run_host_case(prompt_len, 16, kinds)
            print(
                f"{prompt_len:>6} {'+'.join(kinds):>9} {r['pages']:>5} "
                f"{r['host_us']:>11.1f} {r['device_us']:>13.1f} "
                f"{r['host_us'] / r['device_us']:>11.1f}"
            )


if __name__ == "__main__":
    main()
