"""``hicache demo``: a sidecar, two engine workers, a multi-turn chat, a restart, exact logits.

Phase 1 starts a sidecar (``hicache serve`` on a Unix socket in the work folder, LMDB
there) and two engine worker processes, each with its own scheduler, shared-memory device
pools and a ``SidecarController``. It plays a multi-turn chat workload (shared system
prompts, conversations that grow, new conversations arriving each round) with each turn on
engine ``(conversation + (turn + 1) // 2) % 2``: a conversation moves to the other engine
every other turn, so engines hit each other's backups on the host tier, and hit their own
earlier turns and system prompts on the device.

Phase 2 stops the engines and the sidecar, starts them again on the same LMDB folder, and
replays the last two turns of every conversation: the first of them comes back from disk;
the second hits it on the device (the conversation stayed on its engine) or on the host
(it moved to the other engine).

For each phase, the same requests are then run again on the same engines with prefix
reuse off (the measured no-cache time), and every request is run through ``generate()``,
the cache-off baseline; the logits of every generated token of both runs must equal it
bit for bit (``torch.equal``). Any mismatch fails the demo with exit code 1, and so
does a generated token whose logits were never compared (``unchecked_tokens`` in
``demo.json``).

Writes ``demo.json`` and ``hits.png`` into the work folder (``./demo-out`` by default).
Exit codes: 0 all exact, 1 logit mismatch, 2 bad arguments, 3 a process failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hicache.apps.engine.cluster import EngineCluster, SidecarProcess, SidecarSettings
from hicache.apps.engine.config import DEFAULT_KINDS
from hicache.apps.engine.demo_report import (
    DIRECTIONS,
    PhaseReport,
    Progress,
    TimelinePoint,
    phase_table,
    write_plot,
)
from hicache.apps.engine.model import tiny_hybrid
from hicache.apps.engine.scheduler import RequestResult
from hicache.apps.engine.worker import WorkerError, WorkerSettings
from hicache.apps.engine.workload import ChatTurn, ChatWorkload, ChatWorkloadConfig
from hicache.types import ConfigError

ENGINES = 2
FULL_WORKLOAD = ChatWorkloadConfig(
    conversations=12,
    turns=4,
    system_prompts=3,
    system_prompt_tokens=512,
    user_tokens_min=32,
    user_tokens_max=96,
    new_tokens=16,
    arrivals_per_round=4,
)
QUICK_WORKLOAD = ChatWorkloadConfig(
    conversations=4,
    turns=2,
    system_prompts=2,
    system_prompt_tokens=96,
    user_tokens_min=16,
    user_tokens_max=32,
    new_tokens=4,
    arrivals_per_round=2,
)
# Files of a previous run that a new run replaces (the work folder may hold others).
_OUTPUTS = ("demo.json", "hits.png", "sidecar.log", "sidecar-ready.json")
_DISK_WAIT_S = 60.0


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``hicache demo``."""
    parser.add_argument(
        "--workdir",
        default="demo-out",
        help="folder for logs, demo.json, hits.png and the LMDB tier (its lmdb/ is replaced)",
    )
    parser.add_argument("--quick", action="store_true", help="a small workload (seconds)")
    parser.add_argument("--json", action="store_true", help="print one JSON document only")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-plot", action="store_true", help="do not write hits.png")
    parser.add_argument("--conversations", type=int, help="chat conversations")
    parser.add_argument("--turns", type=int, help="turns per conversation")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per turn")
    parser.add_argument(
        "--layers",
        default=",".join(DEFAULT_KINDS),
        help="layer kinds of the tiny model, e.g. full,swa,mamba,full",
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")


@dataclass
class DemoSettings:
    workdir: Path
    workload: ChatWorkloadConfig
    engine: WorkerSettings
    sidecar: SidecarSettings


def demo_settings(args: argparse.Namespace) -> DemoSettings:
    """Settings from the flags; raises ConfigError for values that cannot work."""
    workload = QUICK_WORKLOAD if args.quick else FULL_WORKLOAD
    for name in ("conversations", "turns", "new_tokens"):
        value = getattr(args, name, None)
        if value is not None:
            workload = replace(workload, **{name: value})
    workload.validate()
    kinds = tuple(k.strip() for k in args.layers.split(",") if k.strip())
    bad = sorted(set(kinds) - {"full", "swa", "mamba"})
    if bad or not kinds:
        raise ConfigError(f"--layers {args.layers!r}: use full, swa and mamba, comma separated")
    if args.page_size < 1:
        raise ConfigError(f"--page-size must be >= 1, got {args.page_size}")
    # The workers build exactly this; a layout that cannot work fails here, not in them.
    spec = tiny_hybrid(kinds, page_size=args.page_size)
    spec.model_config.validate(spec.layout)
    spec.cache_config.validate(spec.layout)
    chunk = max(64 // args.page_size, 1) * args.page_size
    # Room for every engine's share of the workload without device eviction, and more.
    full_slots = max(16384, 4 * workload.conversations * workload.max_sequence_tokens)
    engine = WorkerSettings(
        engine_id="",
        kinds=kinds,
        page_size=args.page_size,
        full_slots=full_slots,
        prefill_chunk_tokens=chunk,
        max_prefill_tokens_per_step=4 * chunk,
    )
    return DemoSettings(Path(args.workdir), workload, engine, SidecarSettings())


def engine_of(turn: ChatTurn) -> int:
    """Phase 1's engine for a turn: a conversation changes engines every other turn."""
    return (turn.conversation + (turn.turn + 1) // 2) % ENGINES


def restart_engine_of(turn: ChatTurn, moved: bool) -> int:
    """Phase 2's engine: conversation parity, and odd conversations move for the last turn."""
    return (turn.conversation + (turn.conversation % 2 if moved else 0)) % ENGINES


def _request_dict(turn: ChatTurn) -> dict[str, Any]:
    r = turn.request
    return {"rid": r.rid, "prompt": list(r.prompt_ids), "max_new_tokens": r.max_new_tokens}


class _Phase:
    """One phase on a freshly started sidecar and engines."""

    def __init__(
        self, settings: DemoSettings, report: PhaseReport, progress: Progress, clock: list[float]
    ) -> None:
        self.settings = settings
        self.report = report
        self.progress = progress
        self.clock = clock  # [cached serving seconds before this batch]
        self.sidecar = SidecarProcess(settings.workdir, settings.sidecar)
        self.cluster: EngineCluster | None = None
        self.batches: list[dict[int, list[ChatTurn]]] = []

    def __enter__(self) -> _Phase:
        self.progress.note(f"{self.report.name}: starting the sidecar and {ENGINES} engines")
        # All processes start at once (each spends seconds importing torch); the workers
        # wait for the sidecar's ready file before they register.
        self.sidecar.launch()
        workers = [
            replace(
                self.settings.engine,
                engine_id=chr(ord("A") + i),
                socket=self.sidecar.endpoint,
                sidecar_ready_file=str(self.sidecar.ready_file),
            )
            for i in range(ENGINES)
        ]
        try:
            self.cluster = EngineCluster(workers, self.settings.workdir)
            self.sidecar.wait_ready()
            self.cluster.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.cluster is not None:
                self.cluster.stop()
        finally:
            self.sidecar.stop()

    def serve(self, turns: list[ChatTurn], place: Callable[[ChatTurn], int]) -> list[dict]:
        """Serve one batch with the cache on; returns the results in ``turns`` order."""
        by_engine: dict[int, list[ChatTurn]] = {}
        for t in turns:
            by_engine.setdefault(place(t), []).append(t)
        if not self.batches:
            self.report.start_s = round(self.clock[0], 4)
        self.batches.append(by_engine)
        results: dict[str, dict] = {}
        began_wall, began = time.time(), time.perf_counter()

        def on_event(_index: int, event: dict) -> None:
            if event.get("event") != "finished":
                return
            r = event["result"]
            results[r["rid"]] = r
            self.report.add_result(r)
            self.report.timeline.append(
                TimelinePoint(
                    round(self.clock[0] + r["finished_at"] - began_wall, 4),
                    r["device_hit_tokens"],
                    r["host_hit_tokens"],
                    r["disk_hit_tokens"],
                    r["computed_tokens"],
                )
            )
            self.progress.step(f"{self.report.name}: serving with the cache")

        self.cluster.call(
            {
                i: {"op": "run", "mode": "cached", "requests": [_request_dict(t) for t in ts]}
                for i, ts in by_engine.items()
            },
            "ran",
            on_event,
        )
        elapsed = time.perf_counter() - began
        self.report.time_s += elapsed
        self.clock[0] += elapsed
        return [results[t.request.rid] for t in turns]

    def finish(self) -> None:
        """Bytes moved (once the disk writes are committed), the no-cache run of the same
        batches, and the exactness check of every request."""
        stats = self._settled_stats()
        transfer = stats.get("transfer", {})
        for d in DIRECTIONS:
            self.report.bytes_moved[d] = int(transfer.get(d, {}).get("bytes", 0))
        for by_engine in self.batches:
            began = time.perf_counter()

            def on_event(_index: int, event: dict) -> None:
                if event.get("event") == "finished":
                    self.report.no_cache_computed_tokens += event["result"]["computed_tokens"]
                    self.progress.step(f"{self.report.name}: the same without the cache")

            self.cluster.call(
                {
                    i: {"op": "run", "mode": "nocache", "requests": [_request_dict(t) for t in ts]}
                    for i, ts in by_engine.items()
                },
                "ran",
                on_event,
            )
            self.report.no_cache_time_s += time.perf_counter() - began
        rids: dict[int, list[str]] = {}
        for by_engine in self.batches:
            for i, ts in by_engine.items():
                rids.setdefault(i, []).extend(t.request.rid for t in ts)

        def on_verdict(index: int, event: dict) -> None:
            if event.get("event") != "verified":
                return
            self.report.checked_tokens += event["tokens"]
            for mode in ("cached", "nocache"):
                # None: the run recorded no logits for this request, so nothing was
                # compared; that is no proof of exactness either.
                if event.get(mode) is not True:
                    mismatch = {
                        "rid": event["rid"],
                        "run": mode,
                        "engine": self.cluster.workers[index].settings.engine_id,
                        "max_abs_diff": event.get(f"{mode}_max_abs_diff"),
                    }
                    if event.get(mode) is None:
                        mismatch["missing"] = True
                    self.report.mismatches.append(mismatch)
                    self.progress.note(f"LOGIT MISMATCH: {mismatch}", always=True)
            self.progress.step(f"{self.report.name}: comparing logits with generate()")

        self.cluster.call(
            {i: {"op": "verify", "rids": r} for i, r in rids.items()}, "verify_done", on_verdict
        )

    def _settled_stats(self) -> dict[str, Any]:
        """The sidecar's stats once its queued disk writes are committed; counts the
        lookups every engine answered as misses because the sidecar was unavailable."""
        deadline = time.monotonic() + _DISK_WAIT_S
        while True:
            answers = self.cluster.call({i: {"op": "stats"} for i in range(ENGINES)}, "stats")
            stats = answers[0]["sidecar"] or {}
            pending = stats.get("disk", {}).get("pending_writes", 0)
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for answer in answers.values():
            client = (answer.get("client") or {}).get("counters", {})
            self.report.sidecar_unavailable_lookups += int(
                client.get("lookup_misses_unavailable", 0)
            )
        return stats


def _prepare_workdir(workdir: Path) -> None:
    """A fresh LMDB folder and no outputs of a previous run; other files are left alone."""
    workdir.mkdir(parents=True, exist_ok=True)
    lmdb_dir = workdir / "lmdb"
    if lmdb_dir.exists():
        shutil.rmtree(lmdb_dir)
    for name in _OUTPUTS:
        (workdir / name).unlink(missing_ok=True)
    for log in workdir.glob("engine-*.log"):
        log.unlink()


def run_phases(settings: DemoSettings, progress: Progress) -> list[PhaseReport]:
    """Phase 1 (chat on a fresh sidecar) and phase 2 (last two turns after a restart)."""
    workload = ChatWorkload(settings.workload)
    cfg = settings.workload
    clock = [0.0]
    chat = PhaseReport("phase 1", "multi-turn chat on 2 engines, fresh sidecar")
    with _Phase(settings, chat, progress, clock) as phase:
        progress.start(f"{chat.name}: serving with the cache", 3 * cfg.conversations * cfg.turns)
        rounds = workload.play(
            lambda _round, turns: [RequestResult(**r) for r in phase.serve(turns, engine_of)]
        )
        phase.finish()
    progress.finish()
    by_conversation: dict[int, list[ChatTurn]] = {}
    for turns in rounds:
        for t in turns:
            by_conversation.setdefault(t.conversation, []).append(t)
    # The last two turns of every conversation: the first of them hits what phase 1 left
    # on disk; the second hits the first on the device (even conversations stay on their
    # engine) or on the host (odd ones move to the other engine).
    replay_rounds = [
        [turns[-2] for _, turns in sorted(by_conversation.items()) if len(turns) >= 2],
        [turns[-1] for _, turns in sorted(by_conversation.items())],
    ]
    replay_rounds = [r for r in replay_rounds if r]
    restart = PhaseReport(
        "phase 2", "the last two turns again, after restarting the engines and the sidecar"
    )
    with _Phase(settings, restart, progress, clock) as phase:
        total = sum(len(r) for r in replay_rounds)
        progress.start(f"{restart.name}: serving with the cache", 3 * total)
        for i, turns in enumerate(replay_rounds):
            phase.serve(turns, lambda t, i=i: restart_engine_of(t, moved=i > 0))
        phase.finish()
    progress.finish()
    return [chat, restart]


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo with parsed ``args``; returns the exit code (see the module doc)."""
    try:
        settings = demo_settings(args)
    except ConfigError as exc:
        print(f"hicache demo: {exc}", file=sys.stderr)
        return 2
    progress = Progress(enabled=not args.no_progress)
    _prepare_workdir(settings.workdir)
    began = time.perf_counter()
    try:
        phases = run_phases(settings, progress)
    except WorkerError as exc:
        progress.finish()
        print(f"hicache demo: a process failed: {exc}", file=sys.stderr)
        return 3
    total_s = time.perf_counter() - began
    return report_demo(phases, settings, total_s, as_json=args.json, plot=not args.no_plot)


def report_demo(
    phases: list[PhaseReport],
    settings: DemoSettings,
    total_s: float,
    *,
    as_json: bool = False,
    plot: bool = True,
) -> int:
    """Write demo.json (and the plot), print the tables or the JSON document, and fail
    loudly (exit code 1) when any logit differed or any request could not be served."""
    plot_path = settings.workdir / "hits.png"
    plot_note = write_plot(phases, plot_path) if plot else "not written (--no-plot)"
    mismatches = sum(len(p.mismatches) for p in phases)
    failed = sum(p.failed_requests for p in phases)
    # Every generated token's logits must have been compared: fewer is no proof.
    unchecked = sum(max(0, p.generated_tokens - p.checked_tokens) for p in phases)
    document = {
        "ok": mismatches == 0 and failed == 0 and unchecked == 0,
        "unchecked_tokens": unchecked,
        "mismatches": mismatches,
        "failed_requests": failed,
        "total_time_s": round(total_s, 3),
        "workdir": str(settings.workdir),
        "plot": None if plot_note else str(plot_path),
        "plot_note": plot_note,
        "workload": asdict(settings.workload),
        "engine": asdict(settings.engine) | {"engine_id": None, "socket": None},
        "engines": ENGINES,
        "phases": [p.to_dict() for p in phases],
    }
    (settings.workdir / "demo.json").write_text(json.dumps(document, indent=1))
    if as_json:
        print(json.dumps(document))
    else:
        for p in phases:
            print(phase_table(p))
            print()
        print(f"total {total_s:.1f} s; results in {settings.workdir / 'demo.json'}")
        print(f"plot: {plot_note or plot_path}")
    if mismatches:
        for p in phases:
            for m in p.mismatches:
                print(f"LOGIT MISMATCH in {p.name}: {m}", file=sys.stderr)
        print(
            f"hicache demo FAILED: {mismatches} requests whose logits differ from the "
            "cache-off run of generate(); the cache returned wrong data",
            file=sys.stderr,
        )
        return 1
    if failed:
        print(f"hicache demo FAILED: {failed} requests could not be served", file=sys.stderr)
        return 1
    if unchecked:
        print(
            f"hicache demo FAILED: the logits of {unchecked} generated tokens were never "
            "compared with the cache-off run",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hicache.apps.demo`` (the same as ``hicache demo``)."""
    parser = argparse.ArgumentParser(prog="hicache demo", description=__doc__.split("\n\n")[0])
    add_demo_arguments(parser)
    return run_demo(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
