"""The ``hicache`` command: ``serve`` (the sidecar), ``demo`` (the main job) and ``bench``.

Each subcommand is one entry of :data:`SUBCOMMANDS`: a name, a one-line help, and two
functions in its own module (imported only when that subcommand runs): one adds its
arguments to a parser, the other runs it and returns the exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    module: str
    add_arguments: str
    run: str


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand(
        "serve",
        "run the sidecar: host and disk tiers for the engines of this node",
        "hicache.controller.sidecar.process",
        "add_serve_arguments",
        "run_serve",
    ),
    Subcommand(
        "bench",
        "benchmarks: `bench replay` replays a Mooncake trace against the offline bounds",
        "hicache.apps.replay_bench",
        "add_bench_arguments",
        "run_bench",
    ),
    Subcommand(
        "demo",
        "run a sidecar and two engines on a chat workload; show hits per tier, prove exactness",
        "hicache.apps.demo",
        "add_demo_arguments",
        "run_demo",
    ),
    Subcommand(
        "run-hf",
        "serve a multi-turn chat on a transformers model (hybrid or not) with and without "
        "the cache",
        "hicache.integrations.transformers_demo",
        "add_run_hf_arguments",
        "run_run_hf",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for entry in SUBCOMMANDS:
        p = sub.add_parser(entry.name, help=entry.help, description=entry.help)
        p.set_defaults(_entry=entry)
        p.set_defaults(_parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    # Parse the subcommand first, then let its own module add its arguments: a subcommand's
    # dependencies (zmq, lmdb, matplotlib) load only when it runs.
    args, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    if args.version:
        from hicache import __version__

        print(__version__)
        return 0
    entry: Subcommand | None = getattr(args, "_entry", None)
    if entry is None:
        parser.print_help()
        return 0 if {"-h", "--help"} & set(argv) else 2
    module = importlib.import_module(entry.module)
    getattr(module, entry.add_arguments)(args._parser)
    args = parser.parse_args(argv)
    return int(getattr(module, entry.run)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
