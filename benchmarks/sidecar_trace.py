"""Timestamps on both sides of the sidecar's socket, for the benchmarks that ask where a
request's time goes (``hf_ttft_gpu.py --trace-dir``, ``bench_sidecar.py --fixed``).

:func:`install_server` wraps the stages of a request inside ``hicache serve`` (the I/O
thread's receive, the hand-off to a worker, the controller's load and its copy, the reply
through the inproc socket and out); :func:`install_client` wraps the engine side (the
send, the wait for the reply). Every stage appends ``(stage, monotonic seconds, thread
name)``; CLOCK_MONOTONIC is one clock for every process of a host, so the two sides'
events line up. :func:`dump` writes them as JSON; :func:`load_breakdown` turns the two
files into the median time between consecutive stages of each load. Nothing here is
imported by the package: it patches methods of a process that opted in.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import os
import statistics
import threading
import time
from typing import Any

EVENTS: list[tuple[str, float, str]] = []


def _mark(stage: str) -> None:
    EVENTS.append((stage, time.monotonic(), threading.current_thread().name))


def _wrap(owner: Any, name: str, before: str, after: str | None = None) -> None:
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def traced(*args: Any, **kwargs: Any) -> Any:
        _mark(before)
        try:
            return inner(*args, **kwargs)
        finally:
            if after is not None:
                _mark(after)

    setattr(owner, name, traced)


def install_controller() -> None:
    """Trace the controller's load and its copy (in a sidecar, or in-process)."""
    from hicache.controller.store.fills import FillTracker
    from hicache.controller.store.local import LocalController
    from hicache.controller.store.transfer_engine import TransferEngine
    from hicache.kernels.prepared import PreparedTransfer

    _wrap(LocalController, "load", "ctl_load", "ctl_load_end")
    _wrap(TransferEngine, "to_device", "to_device", "to_device_end")
    _wrap(PreparedTransfer, "__call__", "launch", "launched")
    _wrap(LocalController, "backup", "ctl_backup", "ctl_backup_end")
    _wrap(TransferEngine, "to_host", "to_host", "to_host_end")
    _wrap(FillTracker, "wait", "fills_wait", "fills_waited")
    _wrap(LocalController, "acknowledged", "acknowledged", "acknowledged_end")


def install_server(path: str) -> None:
    """Trace this process's sidecar; the events go to ``path`` when it exits."""
    from hicache.controller.sidecar import handlers, server
    from hicache.controller.tiers.lmdb_writer import LmdbWriter

    install_controller()
    _wrap(LmdbWriter, "_store", "lmdb_store", "lmdb_store_end")  # the disk writer's work
    _wrap(server.SidecarServer, "_on_message", "io_recv", "io_handled")
    _wrap(server.SidecarServer, "_run_job", "job_start", "job_end")
    _wrap(server.SidecarServer, "_push", "push")
    _wrap(server.SidecarServer, "_read_replies", "io_reply")
    _wrap(server.SidecarServer, "_send", "io_send")
    _wrap(handlers.VerbHandlers, "load", "handler_load")
    _wrap(handlers.VerbHandlers, "pin", "handler_pin")
    _wrap(handlers.VerbHandlers, "backup", "handler_backup", "handler_backup_end")
    atexit.register(dump, path)


def install_client(path: str | None = None) -> None:
    """Trace this process's sidecar client (the engine side); dumped to ``path`` at exit
    when given."""
    from hicache.controller.client.channel import Channel
    from hicache.controller.client.inflight import RemoteTransfer
    from hicache.controller.client.sidecar_client import SidecarController

    _wrap(SidecarController, "load", "client_load", "client_load_end")
    _wrap(SidecarController, "pin", "client_pin", "client_pin_end")
    _wrap(SidecarController, "unpin", "client_unpin", "client_unpin_end")
    _wrap(SidecarController, "lookup", "client_lookup", "client_lookup_end")
    _wrap(SidecarController, "backup", "client_backup", "client_backup_sent")
    _wrap(RemoteTransfer, "wait", "client_backup_wait", "client_backup_end")
    _wrap(Channel, "send", "client_send", "client_sent")
    _wrap(Channel, "wait", "client_wait", "client_replied")
    if path is not None:
        atexit.register(dump, path)


def dump(path: str) -> None:
    with open(path, "w") as f:
        json.dump(EVENTS, f)


def breakdown(
    client: list, server: list, start: str = "client_load", end: str = "client_load_end"
) -> dict[str, float]:
    """Median µs between consecutive stages of each request that ran from ``start`` to
    ``end`` on the client, with the server's stages that fell inside it merged in by time
    (requests are taken to run one at a time, as the benchmarks send them)."""
    spans = []
    open_at = None
    for stage, t, _ in client:
        if stage == start:
            open_at = t
        elif stage == end and open_at is not None:
            spans.append((open_at, t))
            open_at = None
    server = sorted(server, key=lambda e: e[1])
    client_sorted = sorted(client, key=lambda e: e[1])
    gaps: dict[str, list[float]] = {}
    for t0, t1 in spans:
        inside = [e for e in client_sorted if t0 <= e[1] <= t1]
        inside += [e for e in server if t0 <= e[1] <= t1]
        inside.sort(key=lambda e: e[1])
        seen: dict[str, int] = {}
        for (a, ta, _), (b, tb, _) in itertools.pairwise(inside):
            key = f"{a} -> {b}"
            n = seen.get(key, 0)
            seen[key] = n + 1
            gaps.setdefault(key if not n else f"{key} #{n + 1}", []).append((tb - ta) * 1e6)
    return {k: round(statistics.median(v), 1) for k, v in gaps.items() if len(v) * 2 >= len(spans)}


def load_events(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [tuple(e) for e in json.load(f)]


def _within(events: list, window: list[float]) -> list:
    return [e for e in events if window[0] <= e[1] <= window[1]]


def report(result_json: str, trace_dir: str) -> None:
    """Print, for each traced window of an ``hf_ttft_gpu.py --trace-dir`` run, the median
    time between consecutive stages of its loads (both sides of the socket)."""
    with open(result_json) as f:
        out = json.load(f)
    engine = load_events(os.path.join(trace_dir, "engine.json"))
    loadback = load_events(os.path.join(trace_dir, "sidecar-loadback-default.json"))
    for row in out.get("loadback", []):
        for name, window in row.get("windows", {}).items():
            server = _within(loadback, window) if name != "in_process" else []
            stages = breakdown(_within(engine, window), server, "client_load", "client_load_end")
            if name == "in_process":
                stages = breakdown(_within(engine, window), [], "ctl_load", "ctl_load_end")
            print(f"== load-back {row.get('MiB', 'one page')} MiB, {name}")
            for k, v in stages.items():
                print(f"  {k:40} {v:9.1f} µs")
    for row in out.get("ttft", []):
        family = row["model"]
        side = load_events(os.path.join(trace_dir, f"sidecar-ttft-{family}.json"))
        for window in row.get("host_hit_windows", [])[-1:]:
            print(f"== host hit {family} {row['prompt']}: the engine's calls (ms from the start)")
            ev = sorted(_within(engine, window) + _within(side, window), key=lambda e: e[1])
            for stage, t, thread in ev:
                if stage in ("launch", "launched"):
                    continue
                print(f"  {(t - window[0]) * 1e3:9.3f}  {stage:18} {thread}")


if __name__ == "__main__":
    import sys

    report(sys.argv[1], sys.argv[2])
