"""``hicache bench replay``: trace replay through the cache, against the offline bounds.

For every device capacity (and the host capacity), every listed eviction policy replays
the trace through a fresh cache (:mod:`hicache.apps.replay`), and the table puts its hit
ratios next to two bounds computed on the same trace (:mod:`hicache.apps.replay_bounds`): the
infinite cache, and the offline optimum for the device capacity and for device + host as
one cache (an upper bound of any two-tier policy). Capacities are in trace blocks, given
as a count or as a percentage of the trace's distinct blocks (``5%``).

    hicache bench replay --trace trace.jsonl --device 1%,5%,20% --policy lru,learned
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TextIO

from hicache.apps.replay import (
    BlockShape,
    OutputTokens,
    ReplayError,
    ReplayResult,
    ReplaySettings,
    TraceError,
    TraceRequest,
    load_trace,
    page_chains,
    replay,
    unique_blocks,
)
from hicache.apps.replay_bounds import infinite_hits, optimal_hits
from hicache.apps.workloads import add_workload_arguments, run_workloads
from hicache.config import EvictionPolicyKind, WritePolicy
from hicache.types import ConfigError


@dataclass(frozen=True)
class Capacity:
    """A tier capacity in blocks, and how it was asked for (``5%`` or ``2196``)."""

    blocks: int
    spec: str


def parse_capacity(spec: str, unique: int, allow_zero: bool = False) -> Capacity:
    """``N%`` of ``unique`` blocks (rounded) or a block count; ConfigError when neither."""
    text = spec.strip()
    try:
        if text.endswith("%"):
            pct = float(text[:-1])
            if not 0 <= pct <= 1000:
                raise ValueError
            blocks = round(unique * pct / 100.0)
        else:
            blocks = int(text)
    except ValueError:
        raise ConfigError(
            f"capacity {spec!r} is neither a block count nor a percentage such as 5%"
        ) from None
    if blocks < (0 if allow_zero else 1):
        raise ConfigError(f"capacity {spec!r} is {blocks} blocks; give at least one block")
    return Capacity(blocks, text)


@dataclass
class BenchRow:
    """One replay and its bounds; ratios are fractions of the requested input blocks."""

    device_blocks: int
    device_spec: str
    host_blocks: int
    policy: str
    write_policy: str
    host_retention: float | None  # host_hit_retention_turnovers (None: no host tier)
    device_hit: float
    host_hit: float
    total_hit: float
    infinite: float
    optimal_device: float
    optimal_total: float
    requests: int
    requests_per_s: float
    ops_per_s: float
    seconds: float
    load_back_failures: int

    @property
    def device_of_optimum(self) -> float:
        return self.device_hit / self.optimal_device if self.optimal_device else 0.0

    @property
    def total_of_optimum(self) -> float:
        return self.total_hit / self.optimal_total if self.optimal_total else 0.0


class BoundsCache:
    """The offline bounds of one trace, each capacity computed once."""

    def __init__(self, trace: Sequence[TraceRequest], shape: BlockShape) -> None:
        self.shape = shape
        self.chains = page_chains(trace, shape)
        self.requested_pages = sum(len(r.hash_ids) for r in trace) * shape.pages_per_block
        self.longest_pages = max(len(c) for c in self.chains)
        self.infinite = infinite_hits(self.chains) / self.requested_pages
        self._optimal: dict[int, float] = {}

    def optimal(self, blocks: int) -> float:
        """The optimum's hit ratio with room for ``blocks`` blocks."""
        if blocks not in self._optimal:
            pages = blocks * self.shape.pages_per_block
            self._optimal[blocks] = optimal_hits(self.chains, pages) / self.requested_pages
        return self._optimal[blocks]


def run_row(
    trace: Sequence[TraceRequest], settings: ReplaySettings, bounds: BoundsCache, spec: str
) -> BenchRow:
    """Replay once and attach the bounds for the same capacities."""
    began = time.perf_counter()
    result: ReplayResult = replay(trace, settings)
    seconds = time.perf_counter() - began
    total_blocks = settings.device_blocks + settings.host_blocks
    return BenchRow(
        device_blocks=settings.device_blocks,
        device_spec=spec,
        host_blocks=settings.host_blocks,
        policy=settings.policy.value,
        write_policy=settings.write_policy.value if settings.host_blocks else "-",
        host_retention=settings.host_hit_retention if settings.host_blocks else None,
        device_hit=result.device_hit_ratio,
        host_hit=result.host_hit_ratio,
        total_hit=result.total_hit_ratio,
        infinite=bounds.infinite,
        optimal_device=bounds.optimal(settings.device_blocks),
        optimal_total=bounds.optimal(total_blocks),
        requests=result.requests,
        requests_per_s=result.requests_per_s,
        ops_per_s=result.ops_per_s,
        seconds=seconds,
        load_back_failures=result.load_back_failures,
    )


# -- output ------------------------------------------------------------------------------

_COLUMNS = (
    ("device", lambda r: f"{r.device_blocks} ({r.device_spec})"),
    ("host", lambda r: str(r.host_blocks) if r.host_blocks else "-"),
    ("policy", lambda r: r.policy),
    ("write", lambda r: r.write_policy),
    ("retain", lambda r: f"{r.host_retention:g}" if r.host_retention is not None else "-"),
    ("dev hit", lambda r: f"{100 * r.device_hit:.2f}%"),
    ("host hit", lambda r: f"{100 * r.host_hit:.2f}%" if r.host_blocks else "-"),
    ("total", lambda r: f"{100 * r.total_hit:.2f}%"),
    ("infinite", lambda r: f"{100 * r.infinite:.2f}%"),
    ("opt dev", lambda r: f"{100 * r.optimal_device:.2f}%"),
    ("dev/opt", lambda r: f"{r.device_of_optimum:.3f}"),
    ("opt dev+host", lambda r: f"{100 * r.optimal_total:.2f}%" if r.host_blocks else "-"),
    ("total/opt", lambda r: f"{r.total_of_optimum:.3f}" if r.host_blocks else "-"),
    ("req/s", lambda r: f"{r.requests_per_s:,.0f}"),
    ("ops/s", lambda r: f"{r.ops_per_s:,.0f}"),
)


def format_table(rows: Sequence[BenchRow], markdown: bool = False) -> str:
    """The rows as an aligned text table, or a Markdown table."""
    cells = [[name for name, _ in _COLUMNS]] + [[f(r) for _, f in _COLUMNS] for r in rows]
    if markdown:
        out = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(_COLUMNS)]
        out += ["| " + " | ".join(c) + " |" for c in cells[1:]]
        return "\n".join(out)
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- the subcommand ----------------------------------------------------------------------


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``hicache bench``: one sub-subcommand per benchmark."""
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    p = sub.add_parser(
        "replay",
        help="replay a Mooncake trace through the cache; hit ratios against the bounds",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("--trace", required=True, help="Mooncake FAST'25 JSONL trace file")
    p.add_argument(
        "--device",
        default="5%",
        help="device capacities, comma-separated: blocks, or %% of the trace's distinct blocks",
    )
    p.add_argument("--host", default="0", help="host tier capacity (0: no host tier)")
    p.add_argument(
        "--policy", default="lru,learned", help="device eviction policies: lru,learned,adaptive"
    )
    p.add_argument(
        "--write-policy",
        default=WritePolicy.WRITE_THROUGH.value,
        help="when device pages are backed up to the host tier: "
        + ", ".join(w.value for w in WritePolicy),
    )
    p.add_argument(
        "--host-retention",
        default="1",
        help="host_hit_retention_turnovers values, comma-separated (0: plain LRU host tier); "
        "one row each when there is a host tier",
    )
    p.add_argument("--sample-size", type=int, default=64, help="leaves the learned policy samples")
    p.add_argument("--seed", type=int, default=0, help="seed of the learned policy's sampling")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per trace block")
    p.add_argument(
        "--page-tokens", type=int, help="tokens per cache page (divides a block; default: a block)"
    )
    p.add_argument(
        "--outputs",
        default=OutputTokens.DROP.value,
        help="output tokens: drop (default) or insert (cached as blocks no request asks for)",
    )
    p.add_argument(
        "--window", help="START:END in trace seconds; only requests arriving then are replayed"
    )
    p.add_argument("--max-requests", type=int, help="replay only the first N requests")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="divide arrival times by this (2: twice the request rate; matters with decode)",
    )
    p.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=0.0,
        help="hold each request this long per output token (0: one request at a time)",
    )
    p.add_argument(
        "--check-invariants-every",
        type=int,
        default=0,
        help="check the cache's invariants every N requests (slow; 0: never)",
    )
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    add_workload_arguments(sub)


def _parse_window(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        lo, hi = (float(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--window {text!r}: give START:END in seconds, e.g. 0:600") from None
    if not hi > lo:
        raise ConfigError(f"--window {text!r}: END must be after START")
    return lo, hi


def _enum_list(text: str, cls: type, what: str) -> list:
    out = []
    for item in text.split(","):
        try:
            out.append(cls(item.strip()))
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ConfigError(f"{what} {item.strip()!r} is not one of: {choices}") from None
    return out


def _float_list(text: str, what: str) -> list[float]:
    out = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise ConfigError(f"{what} {item.strip()!r} is not a number") from None
        if not (value >= 0 and math.isfinite(value)):
            raise ConfigError(f"{what} {item.strip()!r} must be a finite number >= 0")
        out.append(value)
    return out


def bench_replay(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``hicache bench replay`` with parsed ``args``; prints to ``out`` (stdout) and
    returns the exit status."""
    out = out or sys.stdout
    trace = load_trace(args.trace, _parse_window(args.window), args.max_requests)
    unique = unique_blocks(trace)
    shape = BlockShape(
        args.block_tokens,
        args.page_tokens or args.block_tokens,
        _enum_list(args.outputs, OutputTokens, "--outputs")[0],
    )
    devices = [parse_capacity(s, unique) for s in args.device.split(",")]
    host = parse_capacity(args.host, unique, allow_zero=True)
    policies = _enum_list(args.policy, EvictionPolicyKind, "--policy")
    write_policy = _enum_list(args.write_policy, WritePolicy, "--write-policy")[0]
    retentions = _float_list(args.host_retention, "--host-retention") if host.blocks else [0.0]
    bounds = BoundsCache(trace, shape)
    # What the replay allocates for the longest request: its blocks and, when outputs are
    # inserted, every output token (the last page partly used).
    longest = max(
        -(-(len(r.hash_ids) * shape.block_tokens + shape.output_tokens(r)) // shape.block_tokens)
        for r in trace
    )
    for cap in devices:
        if cap.blocks < longest:
            raise ConfigError(
                f"device capacity {cap.spec} = {cap.blocks} blocks is below the longest "
                f"request ({longest} blocks); raise --device"
            )
    rows = []
    for cap in devices:
        for policy in policies:
            for retention in retentions:
                settings = ReplaySettings(
                    device_blocks=cap.blocks,
                    host_blocks=host.blocks,
                    shape=shape,
                    policy=policy,
                    eviction_sample_size=args.sample_size,
                    seed=args.seed,
                    write_policy=write_policy,
                    host_hit_retention=retention,
                    time_scale=args.time_scale,
                    decode_ms_per_token=args.decode_ms_per_token,
                    check_invariants_every=args.check_invariants_every,
                )
                rows.append(run_row(trace, settings, bounds, cap.spec))
                if args.format == "text":
                    what = f"{cap.spec} {policy.value}"
                    if host.blocks:
                        what += f" retain {retention:g}"
                    print(f"  {what}: {rows[-1].seconds:.1f} s", file=sys.stderr)
    header = (
        f"trace {args.trace}: {len(trace)} requests, {unique} distinct blocks of "
        f"{shape.block_tokens} tokens, {shape.pages_per_block} page(s) per block, "
        f"outputs {shape.outputs.value}"
    )
    if args.format == "json":
        doc = {
            "trace": str(args.trace),
            "requests": len(trace),
            "unique_blocks": unique,
            "shape": {
                "block_tokens": shape.block_tokens,
                "page_tokens": shape.page_tokens,
                "outputs": shape.outputs.value,
            },
            "rows": [asdict(r) for r in rows],
        }
        print(json.dumps(doc, indent=2), file=out)
    else:
        print(header, file=out)
        print(format_table(rows, markdown=args.format == "markdown"), file=out)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """Entry point of ``hicache bench``: runs the chosen benchmark; exit status 2 with a
    one-line message on bad input."""
    try:
        if args.bench == "replay":
            return bench_replay(args)
        if args.bench == "workloads":
            return run_workloads(args)
    except (ConfigError, TraceError, ReplayError) as exc:
        print(f"hicache bench {args.bench}: {exc}", file=sys.stderr)
        return 2
    raise AssertionError(f"unknown benchmark {args.bench!r}")
