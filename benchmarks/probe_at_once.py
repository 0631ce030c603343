"""Where a vLLM-shaped store and load at once lose against two concurrent memcpys.

    python3 benchmarks/probe_at_once.py --device cuda|cpu [--sizes-mib 64,1024] [--repeat 9]
        [--staged-min-mib N] [--json OUT]

One sidecar and the blocks of ``bench_data_plane.py`` (16 per-layer byte tensors, 1 MiB
pages). For each size, each row's median seconds beside the memcpy it is compared with,
timed run by run (``bench_data_plane._beside``):

* ``copy_{to_host,to_device}``: the segment copy alone, one way;
* ``copies_both_1t``: both copies issued by one thread, then both waited;
* ``copies_both_2t``: each copy issued and waited by a thread of its own (two threads
  kept running, as vLLM's worker keeps its store and load threads);
* ``store`` / ``load`` / ``store_ahead`` / ``load_handed``: the vLLM paths alone;
* ``at_once_plain``: ``store`` and ``load`` at once on the two kept threads;
* ``at_once_default``: ``store_ahead`` and ``load_handed`` at once (vLLM's default paths);
* ``serial_default``: the same two, one after the other in one thread.

For the at-once rows, each thread's start and end (ms after the row began) and, for the
store and the load, the stages of the call (``StageClock``: round trips, copy issue,
copy wait), so the report shows whether the two ran side by side or queued. Diagnostic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_data_plane as bdp

from hicache import ModelLayout, PageRef
from hicache.integrations.engine_blocks import BlockSegment, EngineBlocks

MIB = bdp.MIB
#: ``--staged-min-mib``: the segment copies' ``staged_segments_min_bytes`` (empty: default)
STAGED_MIN_BYTES: list[int] = []


def _wait(done) -> None:
    if done is not None:  # None: a CPU copy, ended when started
        done.synchronize()


class Lanes:
    """Two kept threads (a store lane and a load lane) and when each job ran."""

    def __init__(self) -> None:
        self.pools = [ThreadPoolExecutor(1), ThreadPoolExecutor(1)]
        self.spans: list[list[tuple[float, float]]] = [[], []]

    def both(self, first, second) -> None:
        t0 = time.perf_counter()

        def timed(k, fn):
            s = time.perf_counter()
            fn()
            self.spans[k].append(((s - t0) * 1e3, (time.perf_counter() - t0) * 1e3))

        futs = [self.pools[0].submit(timed, 0, first), self.pools[1].submit(timed, 1, second)]
        for f in futs:
            f.result()

    def take_spans(self) -> dict[str, list[float]]:
        out = {}
        for k, name in enumerate(("store_lane", "load_lane")):
            spans = self.spans[k]
            out[name] = [
                round(statistics.median(s[0] for s in spans), 3),
                round(statistics.median(s[1] for s in spans), 3),
            ] if spans else []  # fmt: skip
        self.spans = [[], []]
        return out


def probe(work: Path, sizes: list[int], device: torch.device, repeat: int) -> dict:
    half = bdp.PAGE_BYTES // 2
    layout = ModelLayout(("full",), num_kv_heads=1, head_dim=half // 4, dtype="float32",
                         model_id="probe-at-once")  # fmt: skip
    blocks = max(sizes) // bdp.PAGE_BYTES
    sidecar = bdp.Sidecar(work, layout, 1, (repeat + 6) * max(sizes) + 64 * MIB)
    lanes = Lanes()
    report: dict = {}
    try:
        layers = [
            torch.randint(0, 256, (2 * blocks, bdp.LAYER_BLOCK_BYTES), dtype=torch.uint8).to(device)
            for _ in range(bdp.LAYERS)
        ]
        k = bdp.LAYER_BLOCK_BYTES // 2
        segments = [BlockSegment(t, 0, k, i * k) for i, t in enumerate(layers)]
        segments += [BlockSegment(t, k, k, half + i * k) for i, t in enumerate(layers)]
        client = bdp._client(sidecar.endpoint, "probe-store")
        client.attach(layout, 1)
        loader = bdp._client(sidecar.endpoint, "probe-load")  # a connection of its own too
        loader.attach(layout, 1)
        scheduler = bdp._client(sidecar.endpoint, "probe-scheduler")
        scheduler.attach(layout, 1)
        store_engine = EngineBlocks(client, [segments], device, bdp.FULL)
        load_engine = EngineBlocks(client, [segments], device, bdp.FULL)
        own_engine = EngineBlocks(loader, [segments], device, bdp.FULL)
        for e in (store_engine, load_engine, own_engine):
            assert e.available
            if STAGED_MIN_BYTES:  # the copies' threshold for the staging ring, as asked
                for c in e._copies_now():
                    c._tuning = dataclasses.replace(
                        c._tuning, staged_segments_min_bytes=STAGED_MIN_BYTES[0]
                    )
            e.warm()
        counter = iter(range(1 << 30))

        def refs(n: int) -> list[PageRef]:
            tag = next(counter)
            hs = [bdp.hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest()
                  for i in range(n)]  # fmt: skip
            return [PageRef(bdp.FULL, h, hs[i - 1] if i else b"\0" * 16, 0)
                    for i, h in enumerate(hs)]  # fmt: skip

        def one(size: int) -> dict:
            n = size // bdp.PAGE_BYTES
            ids = list(range(n))
            targets = [blocks + i for i in ids]
            fixed = refs(n)
            assert store_engine.store(fixed, [0] * n, ids, 600.0)[0] == n
            hashes = [r.page_hash for r in fixed]
            copy = store_engine._copies_now()[0]
            top = copy.pages.shape[0]
            scratch = list(range(top - 2 * n, top - n))
            scratch2 = list(range(top - n, top))

            def to_host(_=0):
                _wait(copy.start(ids, scratch, True))

            def to_device(_=0):
                _wait(copy.start(targets, scratch2, False))

            def both_1t(_=0):
                a = copy.start(ids, scratch, True)
                b = copy.start(targets, scratch2, False)
                _wait(a)
                _wait(b)

            def store(_=0, e=store_engine):
                w, d = e.store(refs(n), [0] * n, ids, 600.0)
                assert w == n and not d, (w, d)

            def load(_=0, e=load_engine):
                assert e.load(hashes, [0] * n, targets, 600.0, 600.0)

            pins = [bdp._handed(scheduler, hashes) for _ in range(6 * repeat + 8)]
            ahead: list = []

            def prebook(_=0):
                fresh = refs(n)
                booked = store_engine.prebook(fresh, 600.0)
                while not store_engine.prebook_answered(booked):
                    time.sleep(50e-6)
                ahead.append((fresh, booked))

            def store_ahead(_=0):
                fresh, booked = ahead.pop(0)
                w, d = store_engine.store(fresh, [0] * n, ids, 600.0, prebook=booked)
                assert w == n and not d, (w, d)

            def load_handed(_=0, e=load_engine):
                assert e.load_handed(hashes, [0] * n, targets, pins.pop(), 600.0, 600.0)

            def load_own(_=0):
                assert own_engine.load(hashes, [0] * n, targets, 600.0, 600.0)

            rows = {
                "copy_to_host": (to_host, "to_host", None),
                "copy_to_device": (to_device, "to_device", None),
                "copies_both_1t": (both_1t, "both", None),
                "copies_both_2t": (lambda _: lanes.both(to_host, to_device), "both", None),
                "store": (store, "to_host", None),
                "load": (load, "to_device", None),
                "store_ahead": (store_ahead, "to_host", prebook),
                "load_handed": (load_handed, "to_device", None),
                "at_once_plain": (lambda _: lanes.both(store, load), "both", None),
                "at_once_own_client": (lambda _: lanes.both(store, load_own), "both", None),
                "at_once_default": (
                    lambda _: lanes.both(store_ahead, load_handed),
                    "both",
                    prebook,
                ),
                "serial_default": (lambda _: (store_ahead(), load_handed()), "both", prebook),
            }
            memcpy = bdp.Memcpy(size, device)
            out: dict = {}
            for name, (fn, floor, first) in rows.items():
                bdp.FLOOR_OF["probe"] = floor
                t, m = bdp._beside(lambda i, fn=fn: fn(i), "probe", memcpy, repeat, device, first)
                row = {"ms": round(t * 1e3, 3), "memcpy_ms": round(m * 1e3, 3),
                       "ratio": round(m / t, 3)}  # fmt: skip
                if name.startswith(("at_once", "copies_both_2t")):
                    row["lanes_ms"] = lanes.take_spans()
                out[name] = row
                print(f"{size // MIB:5d} MiB {name:20s} {row}", flush=True)
            # the stages of each side of the at-once rows, the calls summed over repeat runs
            for name, (a, b, first) in {
                "at_once_plain": (store, load, None),
                "at_once_default": (store_ahead, load_handed, prebook),
            }.items():
                stage = {}
                with bdp.StageClock(client, store_engine) as clock:
                    for _ in range(repeat):
                        if first:
                            first()
                        bdp._sync(device)
                        lanes.both(a, b)
                        bdp._sync(device)
                stage = {k: round(v / repeat, 3) for k, v in clock.ms.items()}
                out[name]["stages_ms"] = stage
                lanes.take_spans()
                print(f"{size // MIB:5d} MiB {name} stages {stage}", flush=True)
            for f in ahead:
                store_engine.give_back(f[1])
            ahead.clear()
            for t in layers:
                assert torch.equal(t[targets], t[ids]), "a load did not restore the bytes"
            del memcpy
            return out

        for size in sizes:
            report[size // MIB] = one(size)
        for c in (client, loader, scheduler):
            c.close()
    finally:
        sidecar.stop()
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--sizes-mib", default="64,1024")
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument(
        "--staged-min-mib",
        type=int,
        help="copies of at least this many MiB go through the staging ring "
        "(TransferTuning.staged_segments_min_bytes; 0: never; default: the tuning's)",
    )
    p.add_argument("--json")
    a = p.parse_args()
    if a.staged_min_mib is not None:
        STAGED_MIN_BYTES.append(a.staged_min_mib * MIB)
    device = torch.device(a.device)
    sizes = [int(s) * MIB for s in a.sizes_mib.split(",")]
    work = Path(tempfile.mkdtemp(prefix="probe-at-once-"))
    try:
        report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                  else "cpu", "sizes": probe(work, sizes, device, a.repeat)}  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
