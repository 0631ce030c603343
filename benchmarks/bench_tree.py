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

    .venv/bin/python benchmarks/bench_tree.py [--quick] [--compare-ref REF]

With ``--compare-ref REF`` (a git revision) the same cases also run on that revision's code,
in the same process: its library (``git archive`` of it) is imported as ``hicache_ref``,
and the two take turns case by case over several rounds, so that both see the same load
of a shared machine. Every turn makes the same calls on the same tree states, so each side
keeps each call's best time over the turns (what preemptions on a shared machine leave
alone); the table prints both sides' µs per call from those, this checkout's as a ratio of
the revision's (below 1: faster), and beside it the same ratio from each side's best turn.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import io
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np

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


def run_case(prompt_len: int, page_size: int, conversations: int, lib: str = "hicache") -> dict:
    """The tree workload on library ``lib`` (``hicache``, or ``hicache_ref``)."""
    api = importlib.import_module(lib)
    CacheConfig, DevicePools = api.CacheConfig, api.DevicePools
    ModelLayout, UnifiedRadixCache = api.ModelLayout, api.UnifiedRadixCache
    layout = ModelLayout(("full",), num_kv_heads=1, head_dim=1, dtype="float32")
    requests = make_workload(prompt_len, conversations)
    total_tokens = sum(r.size for r in requests)
    cfg = CacheConfig(page_size=page_size, full_slots=total_tokens + page_size)
    pools = DevicePools.allocate(layout, cfg)
    cache = UnifiedRadixCache(layout, cfg, pools)
    calls: dict[str, list[float]] = {op: [] for op in TREE_OPS}
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
        calls["match_us"].append(t1 - t0)
        calls["insert_us"].append(t3 - t2)
        hit += m.prefix_len
    # A second pass: every request now hits fully (the steady state of a warm cache).
    for tokens in requests:
        t0 = time.perf_counter()
        cache.match_prefix(tokens)
        calls["match_warm_us"].append(time.perf_counter() - t0)
    floor = min(floor_cost(requests, page_size) for _ in range(3))
    leaves = 0
    while True:
        t0 = time.perf_counter()
        freed = cache.evict(full_tokens=1).full_tokens
        calls["evict_us"].append(time.perf_counter() - t0)
        if not freed:
            break
        leaves += 1
    # evict is per leaf evicted (the last, empty call counted in the time)
    per = {"match_us": len(requests), "match_warm_us": len(requests), "insert_us": len(requests)}
    per["evict_us"] = max(leaves, 1)
    return {
        "prompt": prompt_len,
        "page": page_size,
        "requests": len(requests),
        "hit_ratio": hit / total_tokens,
        **{op: sum(calls[op]) / per[op] * 1e6 for op in TREE_OPS},
        "floor_us": floor * 1e6,
        "calls": {op: (np.array(calls[op]), per[op]) for op in TREE_OPS},
    }


def run_host_case(
    prompt_len: int, page_size: int, kinds: tuple[str, ...], lib: str = "hicache"
) -> dict:
    """match_prefix of a prompt the device evicted and the host tier (an in-process
    ``LocalController``) holds: the tree walk plus the controller lookup of every page,
    against a match of the same prompt while it is on the device."""
    api = importlib.import_module(lib)
    CacheConfig, DevicePools = api.CacheConfig, api.DevicePools
    ModelLayout, UnifiedRadixCache = api.ModelLayout, api.UnifiedRadixCache
    ControllerConfig = importlib.import_module(f"{lib}.controller.config").ControllerConfig
    LocalController = importlib.import_module(f"{lib}.controller").LocalController

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

    def timed() -> np.ndarray:
        out = np.empty(reps)
        for i in range(reps):
            t0 = time.perf_counter()
            cache.match_prefix(tokens)
            out[i] = time.perf_counter() - t0
        return out

    device = timed()
    cache.flush_backups()
    cache.evict(full_tokens=10**9)
    m = cache.match_prefix(tokens)
    assert m.prefix_len == 0 and m.host_hit_len == tokens.size, "the prompt must be on host"
    host = timed()
    cache.check_invariants()
    ctl.close()
    return {
        "device_us": device.mean() * 1e6,
        "host_us": host.mean() * 1e6,
        "pages": tokens.size // page_size,
        "calls": {"device_us": (device, reps), "host_us": (host, reps)},
    }


TREE_CASES = [(p, ps) for p in (1024, 8192) for ps in (1, 16, 64)]
HOST_CASES = [(p, kinds) for p in (1024, 8192) for kinds in (("full",), ("full", "swa"))]
TREE_OPS = ("match_us", "match_warm_us", "insert_us", "evict_us")
HOST_OPS = ("host_us", "device_us")


def cases(conversations: int) -> list[tuple[str, tuple[str, ...], object]]:
    """(name, operations, run(lib) -> results) of every case."""
    out = []
    for prompt_len, page_size in TREE_CASES:
        out.append(
            (
                f"tree {prompt_len} p{page_size}",
                TREE_OPS,
                lambda lib, p=prompt_len, ps=page_size: run_case(p, ps, conversations, lib),
            )
        )
    for prompt_len, kinds in HOST_CASES:
        out.append(
            (
                f"host {prompt_len} {'+'.join(kinds)}",
                HOST_OPS,
                lambda lib, p=prompt_len, k=kinds: run_host_case(p, 16, k, lib),
            )
        )
    return out


def import_revision(ref: str, into: Path) -> ModuleType:
    """The library of git revision ``ref`` as package ``hicache_ref`` (its controller and
    kernels folders as ``hicache_ref.controller`` and ``.kernels``), written under ``into``."""
    here = Path(__file__).resolve().parents[1]
    tar = subprocess.run(
        ["git", "-C", str(here), "archive", ref, "hicache", "controller", "kernels"],
        check=True,
        capture_output=True,
    ).stdout
    package = into / "hicache_ref"
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        for member in archive.getmembers():
            if not member.isfile() or not member.name.endswith(".py"):
                continue
            top, _, rest = member.name.partition("/")
            dest = package / rest if top == "hicache" else package / top / rest
            text = archive.extractfile(member).read().decode()
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(re.sub(r"\bhicache(?=[.\s])", "hicache_ref", text))
    sys.path.insert(0, str(into))
    return importlib.import_module("hicache_ref")


def compare(ref: str, conversations: int, rounds: int) -> None:
    """Both libraries over ``rounds`` turns per case. Per operation: µs from each call's
    best time over the turns (every turn makes the same calls on the same states), and
    from the best turn's total."""
    with tempfile.TemporaryDirectory(prefix="bench-tree-ref-") as tmp:
        import_revision(ref, Path(tmp))
        per_call: dict[str, dict[str, dict[str, np.ndarray]]] = {}
        totals: dict[str, dict[str, dict[str, float]]] = {}
        divisor: dict[tuple[str, str, str], int] = {}
        for name, ops, run in cases(conversations):
            calls = per_call.setdefault(name, {"hicache_ref": {}, "hicache": {}})
            best = totals.setdefault(name, {"hicache_ref": {}, "hicache": {}})
            for _ in range(rounds):
                for lib in ("hicache_ref", "hicache"):
                    gc.collect()
                    r = run(lib)
                    for op in ops:
                        seconds, divisor[name, lib, op] = r["calls"][op]
                        before = calls[lib].get(op)
                        calls[lib][op] = seconds if before is None else np.minimum(before, seconds)
                        best[lib][op] = min(r[op], best[lib].get(op, float("inf")))
    print(
        f"# this checkout against {ref}: {rounds} turns each, µs per call from each call's "
        "best; the best turn's total beside it"
    )
    print(
        f"{'case':>22} {'operation':>14} {'ref µs':>9} {'this µs':>9} {'this/ref':>8} {'totals':>8}"
    )
    worst = 0.0
    for name, sides in per_call.items():
        for op, ref_calls in sides["hicache_ref"].items():
            ref_us = ref_calls.sum() / divisor[name, "hicache_ref", op] * 1e6
            this_us = sides["hicache"][op].sum() / divisor[name, "hicache", op] * 1e6
            by_totals = totals[name]["hicache"][op] / totals[name]["hicache_ref"][op]
            worst = max(worst, this_us / ref_us)
            print(
                f"{name:>22} {op:>14} {ref_us:>9.1f} {this_us:>9.1f} {this_us / ref_us:>8.2f} "
                f"{by_totals:>8.2f}"
            )
    print(f"# slowest ratio (each call's best): {worst:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer conversations")
    parser.add_argument("--compare-ref", metavar="REF", help="a git revision to compare with")
    parser.add_argument("--rounds", type=int, default=5, help="turns per side and case")
    args = parser.parse_args()
    conversations = 64 if args.quick else 256
    if args.compare_ref:
        compare(args.compare_ref, conversations, args.rounds)
        return
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
    for prompt_len, page_size in TREE_CASES:
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
