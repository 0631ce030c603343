"""Every device eviction policy on every workload family, against the same-run LRU row.

Reads the traces ``hicache bench workloads --out DIR`` wrote (DIR/manifest.json) and, per
family, replays each policy at each device capacity (percent of the family's distinct
blocks), with a 5 % device + 20 % host tier (write-back), and each quarter of the trace
(by requests) replayed alone from an empty cache. Prints one Markdown table per family
and part, each policy's row with the LRU row of the same run beside it (points above LRU,
requests/s as a multiple of LRU's), and ends with the cells that miss the goals of
docs/performance.md ("Which policy to pick"), as :mod:`hicache.apps.replay_goals` checks them.

    .venv/bin/python benchmarks/replay_families.py --workloads DIR
        [--policy lru,learned,adaptive] [--families chat,agent] [--device 1%,2%,5%,10%,20%]
        [--no-device] [--no-host] [--no-quarters] [--rate-rounds 3] [--max-blocks 512]

``--max-blocks`` keeps only the cells whose device holds no more than that many blocks
(512-token blocks, the adaptive policy's miniature units): where its miniatures sample
every unit and its cost is highest, for a rate check of best-of-three runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hicache.apps.replay import ReplaySettings, load_trace, unique_blocks
from hicache.apps.replay_bench import BenchRow, BoundsCache, parse_capacity, run_row
from hicache.apps.replay_goals import cell_misses, quarters
from hicache.config import EvictionPolicyKind, WritePolicy


def _rows(
    trace, policies, devices, host_spec, label, rounds, max_blocks=None
) -> list[tuple[str, BenchRow]]:
    """One row per capacity and policy. Each cell replays every policy in turn
    ``rounds`` times and keeps each policy's fastest run (the hit ratios are the same
    every time): on a shared machine one run's rate swings 2-3x."""
    unique = unique_blocks(trace)
    bounds = BoundsCache(trace, ReplaySettings(device_blocks=1).shape)
    longest = max(len(r.hash_ids) for r in trace)
    host = parse_capacity(host_spec, unique, allow_zero=True)
    out = []
    for spec in devices:
        cap = parse_capacity(spec, unique)
        if cap.blocks < longest:
            print(f"  {label} {spec}: below the longest request, skipped", file=sys.stderr)
            continue
        if max_blocks is not None and cap.blocks > max_blocks:
            continue
        best: dict[EvictionPolicyKind, BenchRow] = {}
        for _ in range(rounds):
            for policy in policies:
                settings = ReplaySettings(
                    device_blocks=cap.blocks,
                    host_blocks=host.blocks,
                    policy=policy,
                    write_policy=WritePolicy.WRITE_BACK,
                )
                row = run_row(trace, settings, bounds, cap.spec)
                print(f"  {label} {spec} {policy.value}: {row.seconds:.1f} s", file=sys.stderr)
                if policy not in best or row.requests_per_s > best[policy].requests_per_s:
                    best[policy] = row
        out += [(label, best[policy]) for policy in policies]
    return out


def _table(rows: list[tuple[str, BenchRow]], with_host: bool) -> tuple[str, list[str]]:
    lru = {(label, r.device_spec): r for label, r in rows if r.policy == "lru"}
    lines = [
        "| part | device | policy | dev hit | LRU dev hit | Δ points | total | LRU total "
        "| opt dev | dev/opt | req/s | LRU req/s | × LRU |",
        "|" + "---|" * 13,
    ]
    misses = []
    for label, r in rows:
        base = lru[(label, r.device_spec)]
        delta = 100 * (r.device_hit - base.device_hit)
        rate = r.requests_per_s / base.requests_per_s if base.requests_per_s else 0.0
        lines.append(
            f"| {label} | {r.device_spec} | {r.policy} | {100 * r.device_hit:.2f}% "
            f"| {100 * base.device_hit:.2f}% | {delta:+.2f} | {100 * r.total_hit:.2f}% "
            f"| {100 * base.total_hit:.2f}% | {100 * r.optimal_device:.2f}% "
            f"| {r.device_of_optimum:.3f} | {r.requests_per_s:,.0f} "
            f"| {base.requests_per_s:,.0f} | {rate:.2f} |"
        )
        if r.policy != "lru":
            misses += cell_misses(label, r, base, with_host)
    return "\n".join(lines), misses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", required=True, help="directory of `hicache bench workloads`")
    ap.add_argument("--families", help="comma-separated subset of the manifest's families")
    ap.add_argument("--policy", default="lru,learned,adaptive")
    ap.add_argument("--device", default="1%,2%,5%,10%,20%")
    ap.add_argument("--no-device", action="store_true", help="skip the device-only rows")
    ap.add_argument("--no-host", action="store_true", help="skip the 5%% + 20%% host rows")
    ap.add_argument("--no-quarters", action="store_true", help="skip the cold quarters")
    ap.add_argument("--rate-rounds", type=int, default=3, help="runs per cell; the fastest is kept")
    ap.add_argument("--max-blocks", type=int, help="only cells of at most this many device blocks")
    args = ap.parse_args(argv)
    root = Path(args.workloads)
    manifest = json.loads((root / "manifest.json").read_text())["families"]
    names = args.families.split(",") if args.families else list(manifest)
    policies = [EvictionPolicyKind(p) for p in args.policy.split(",")]
    if EvictionPolicyKind.LRU not in policies:
        policies.insert(0, EvictionPolicyKind.LRU)
    devices = args.device.split(",")
    all_misses = []
    rounds, cap = args.rate_rounds, args.max_blocks
    for name in names:
        trace = load_trace(root / manifest[name]["file"])
        print(f"\n### {name}: {len(trace):,} requests, {unique_blocks(trace):,} distinct blocks\n")
        parts = []
        if not args.no_device:
            parts.append(
                ("device", _rows(trace, policies, devices, "0", "whole", rounds, cap), False)
            )
        if not args.no_host:
            parts.append(
                (
                    "5% device + 20% host, write-back",
                    _rows(trace, policies, ["5%"], "20%", "whole", rounds, cap),
                    True,
                )
            )
        if not args.no_quarters:
            cold = []
            for k, part in enumerate(quarters(trace)):
                cold += _rows(part, policies, devices, "0", f"q{k + 1}", rounds, cap)
            title = "each quarter from empty (capacities of the quarter's blocks)"
            parts.append((title, cold, False))
        for title, rows, with_host in parts:
            table, misses = _table(rows, with_host)
            print(f"{title}:\n\n{table}\n", flush=True)
            all_misses += [f"{name}: {m}" for m in misses]
    print("\nCells that miss a goal:" if all_misses else "\nEvery cell meets the goals.")
    for m in all_misses:
        print(f"* {m}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
