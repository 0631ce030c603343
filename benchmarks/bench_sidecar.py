"""Sidecar benchmark: lookup round trips against a bare ZeroMQ echo, and load-back MB/s
through the sidecar against the in-process controller, all measured in the same run.

    python benchmarks/bench_sidecar.py [--lookups N] [--pages P] [--repeat R]

* Lookup: ``SidecarController.lookup`` of a chain of 16 page hashes (FULL) through a real
  sidecar process, against a bare pyzmq + msgpack echo server process on the same socket
  type (ROUTER over a Unix socket, DEALER client) whose request and reply have the same
  sizes as the lookup's. Goal: the sidecar's p99 within 2x of the echo's.
* Load-back: pin + load of P pages (K and V of every full-attention layer) into the
  engine's shared-memory pools through the sidecar, against ``LocalController.load`` of
  the same pages in this process.
* Backup: P pages the controller does not hold yet, from those pools into the host pool,
  until the handle reports them held: through the sidecar against ``LocalController``.
* Fixed cost: a one-page load-back and a one-page lookup, each ``--fixed-calls`` times
  (median), through the sidecar and in-process: what a call costs beyond its bytes, and
  how much a load-back through the sidecar pays beyond a lookup round trip.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import torch
import zmq

from hicache import CacheConfig, DevicePools, ModelLayout
from hicache.controller.client.sidecar_client import SidecarClientConfig, SidecarController
from hicache.controller.config import ControllerConfig
from hicache.controller.store.local import LocalController
from hicache.controller.wire.protocol import Verb, encode_request
from hicache.controller_api import PageRef
from hicache.keys import namespace_hash, page_hashes
from hicache.types import ComponentType

PAGE = 16
CHAIN = 16
FULL = ComponentType.FULL

# The echo server: what the sidecar's I/O thread does minus the cache (receive, decode,
# encode a reply of the lookup reply's size, send).
_ECHO = r"""
import sys, msgpack, zmq
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind(sys.argv[1])
reply_size = int(sys.argv[2])
print("ready", flush=True)
while True:
    rid, data = sock.recv_multipart()
    msg = msgpack.unpackb(data, raw=False)
    if msg.get("verb") == "stop":
        break
    out = {"id": msg["id"], "ok": True, "result": {"presence": [b"\x01" * reply_size]}}
    sock.send_multipart([rid, msgpack.packb(out, use_bin_type=True)])
"""


def layout() -> ModelLayout:
    return ModelLayout(
        ("full", "full", "full", "full"),
        num_kv_heads=8,
        head_dim=128,
        dtype="float16",
        model_id="bench-sidecar",
    )


def _refs(pools: DevicePools, tokens: np.ndarray, pages: np.ndarray) -> list[PageRef]:
    fp = pools.layout.fingerprint(PAGE)
    hashes = page_hashes(tokens, fp, PAGE)
    parents = [namespace_hash(fp, None), *hashes[:-1]]
    return [PageRef(FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, pages)]


def _percentiles(samples_ns: list[int]) -> tuple[float, float]:
    s = sorted(samples_ns)
    return s[len(s) // 2] / 1e3, s[min(len(s) - 1, int(len(s) * 0.99))] / 1e3


def bench_echo(workdir: Path, n: int) -> tuple[float, float]:
    endpoint = "ipc://" + str(workdir / "echo.sock")
    proc = subprocess.Popen(
        [sys.executable, "-c", _ECHO, endpoint, str(CHAIN)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    args = {"hashes": b"\x07" * 16 * CHAIN, "components": [0]}
    samples = []
    for i in range(n + n // 10):
        t0 = time.perf_counter_ns()
        sock.send(encode_request(i, Verb.LOOKUP, args, 0.25))
        sock.poll(5000)
        reply = msgpack.unpackb(sock.recv(), raw=False)
        np.frombuffer(reply["result"]["presence"][0], dtype=np.int8)
        if i >= n // 10:  # warm-up excluded
            samples.append(time.perf_counter_ns() - t0)
    sock.send(msgpack.packb({"verb": "stop", "id": 0}))
    proc.wait(30)
    sock.close()
    return _percentiles(samples)


def bench_lookup(client: SidecarController, hashes: list[bytes], n: int) -> tuple[float, float]:
    samples = []
    for i in range(n + n // 10):
        t0 = time.perf_counter_ns()
        res = client.lookup(hashes, [FULL])
        if i >= n // 10:
            samples.append(time.perf_counter_ns() - t0)
    assert res.leading(FULL) == len(hashes), "the benchmark chain must be a hit"
    return _percentiles(samples)


def _time_loads(load, repeat: int) -> float:
    seconds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        assert load()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def _fixed_costs(ctl, refs: list[PageRef], calls: int) -> dict[str, float]:
    """Median µs of a load-back and of a lookup of the one page of ``refs``."""
    pin = ctl.pin([r.key for r in refs], 600)
    assert pin is not None
    hashes = [r.page_hash for r in refs]
    out = {}
    for what, call in (
        ("load", lambda: ctl.load(refs, pin, 60)),
        ("lookup", lambda: ctl.lookup(hashes, [FULL])),
    ):
        samples = []
        for _ in range(calls + calls // 10):
            t0 = time.perf_counter_ns()
            assert call()
            samples.append(time.perf_counter_ns() - t0)
        out[what] = statistics.median(samples[calls // 10 :]) / 1e3
    ctl.unpin(pin)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lookups", type=int, default=5000)
    p.add_argument("--pages", type=int, default=128)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--fixed-calls", type=int, default=400)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hcbench", dir="/tmp"))
    lay = layout()
    page_bytes = lay.page_bytes(FULL, PAGE)
    host_bytes = 4 * (args.pages + CHAIN) * page_bytes + (64 << 20)
    layout_file = work / "layout.json"
    layout_file.write_text(json.dumps({**lay.to_dict(), "page_size": PAGE}))
    ready = work / "ready.json"
    sidecar = subprocess.Popen(
        [
            sys.executable, "-m", "hicache.controller.sidecar.process",
            "--socket", str(work / "s.sock"),
            "--no-disk",
            "--metrics-port", "0",
            "--host-pool-bytes", str(host_bytes),
            "--layout-file", str(layout_file),
            "--ready-file", str(ready),
            "--log-level", "warning",
        ],
    )  # fmt: skip
    pools = None
    try:
        while not ready.exists():
            if sidecar.poll() is not None:
                raise SystemExit("the sidecar did not start")
            time.sleep(0.05)
        cfg = CacheConfig(
            page_size=PAGE, full_slots=(2 * args.pages + 2 * CHAIN + 8) * PAGE, shared_memory=True
        )
        pools = DevicePools.allocate(lay, cfg)
        pools.full.buffer.copy_(torch.randn(pools.full.buffer.shape).half())
        client = SidecarController(
            "ipc://" + str(work / "s.sock"),
            "bench",
            SidecarClientConfig(lookup_timeout_s=5.0, request_timeout_s=60.0),
        )
        client.register(lay, PAGE, pools)

        # -- lookups -----------------------------------------------------------------------
        chain = _refs(pools, np.arange(CHAIN * PAGE), pools.alloc_kv_pages(CHAIN))
        assert client.backup(chain).wait(60)
        hashes = [r.page_hash for r in chain]
        echo_p50, echo_p99 = bench_echo(work, args.lookups)
        side_p50, side_p99 = bench_lookup(client, hashes, args.lookups)

        # -- backup: new pages each time (a backup of held pages is a no-op) --------------
        src_slots = pools.alloc_kv_pages(args.pages)

        def fresh_backup(ctl, round_: int) -> bool:
            tokens = np.arange(args.pages * PAGE) + (20 + round_) * 10_000_000
            return ctl.backup(_refs(pools, tokens, src_slots)).wait(120)

        rounds = iter(range(10_000))
        side_backup_s = _time_loads(lambda: fresh_backup(client, next(rounds)), args.repeat)

        # -- load-back throughput ----------------------------------------------------------
        tokens = np.arange(args.pages * PAGE) + 10_000_000
        src = _refs(pools, tokens, src_slots)
        assert client.backup(src).wait(120)
        dst = _refs(pools, tokens, pools.alloc_kv_pages(args.pages))
        pin = client.pin([r.key for r in dst], 600)
        assert pin is not None
        side_s = _time_loads(lambda: client.load(dst, pin, 60), args.repeat)
        client.unpin(pin)
        fixed = {"sidecar": _fixed_costs(client, dst[:1], args.fixed_calls)}
        client.close()

        local = LocalController(ControllerConfig(host_pool_bytes=host_bytes, disk_path=None))
        local.register(lay, PAGE, pools)
        local_backup_s = _time_loads(lambda: fresh_backup(local, next(rounds)), args.repeat)
        assert local.backup(src).wait(120)
        lpin = local.pin([r.key for r in dst], 600)
        local_s = _time_loads(lambda: local.load(dst, lpin, 60), args.repeat)
        local.unpin(lpin)
        fixed["in_process"] = _fixed_costs(local, dst[:1], args.fixed_calls)
        local.close()
    finally:
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(60)
        if pools is not None:
            pools.close()
        shutil.rmtree(work, ignore_errors=True)

    mb = args.pages * page_bytes / 1e6
    figures = {
        "lookup_chain_pages": CHAIN,
        "lookups": args.lookups,
        "echo_p50_us": echo_p50,
        "echo_p99_us": echo_p99,
        "sidecar_lookup_p50_us": side_p50,
        "sidecar_lookup_p99_us": side_p99,
        "p99_ratio": side_p99 / echo_p99,
        "load_pages": args.pages,
        "load_MB": mb,
        "sidecar_load_MBps": mb / side_s,
        "in_process_load_MBps": mb / local_s,
        "load_ratio": local_s / side_s,
        "sidecar_backup_MBps": mb / side_backup_s,
        "in_process_backup_MBps": mb / local_backup_s,
        "backup_ratio": local_backup_s / side_backup_s,
        **{f"{where}_{what}_us": us for where, f in fixed.items() for what, us in f.items()},
    }
    figures["fixed_load_ratio"] = figures["in_process_load_us"] / figures["sidecar_load_us"]
    figures["sidecar_load_beyond_lookup_us"] = (
        figures["sidecar_load_us"] - figures["sidecar_lookup_us"]
    )
    print(f"lookup round trip, {CHAIN}-page chain, {args.lookups} calls (after warm-up)")
    print(f"  {'':28} {'p50 us':>9} {'p99 us':>9}")
    print(f"  {'bare pyzmq+msgpack echo':28} {echo_p50:9.1f} {echo_p99:9.1f}")
    print(f"  {'sidecar lookup':28} {side_p50:9.1f} {side_p99:9.1f}")
    print(f"  p99 ratio sidecar/echo: {figures['p99_ratio']:.2f} (goal <= 2)")
    print(f"load-back of {args.pages} pages ({mb:.1f} MB), median of {args.repeat}")
    print(f"  through the sidecar: {figures['sidecar_load_MBps']:9.1f} MB/s")
    print(f"  in-process:          {figures['in_process_load_MBps']:9.1f} MB/s")
    print(f"  sidecar / in-process: {figures['load_ratio']:.2f}")
    print(f"backup of {args.pages} new pages ({mb:.1f} MB), median of {args.repeat}")
    print(f"  through the sidecar: {figures['sidecar_backup_MBps']:9.1f} MB/s")
    print(f"  in-process:          {figures['in_process_backup_MBps']:9.1f} MB/s")
    print(f"  sidecar / in-process: {figures['backup_ratio']:.2f}")
    print(f"fixed cost of one call, one page, median of {args.fixed_calls} (us)")
    print(f"  {'':12} {'load-back':>10} {'lookup':>10}")
    for where in ("sidecar", "in_process"):
        load_us, lookup_us = figures[where + "_load_us"], figures[where + "_lookup_us"]
        print(f"  {where:12} {load_us:10.1f} {lookup_us:10.1f}")
    print(f"  load-back in-process / sidecar: {figures['fixed_load_ratio']:.2f}")
    print(
        f"  sidecar load-back beyond its lookup: {figures['sidecar_load_beyond_lookup_us']:.1f} us"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
