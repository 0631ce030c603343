"""Where a staged segment copy's time goes on a GPU, beside a pinned memcpy of its bytes.

    python3 benchmarks/probe_staged.py [--sizes-mib 64,1024] [--repeat 20] [--json OUT]

A vLLM-shaped segment copy (16 per-layer byte tensors, 64 KiB of each a block, a 1 MiB
payload per host page in rows of 1 MiB + the pool's 128-byte frame, blocks and pages in a
shuffled order) is timed each way three ways (medians of ``--repeat``):

* ``gpu``: device µs with the stream held (``torch.cuda._sleep``) while the host issues,
  so that only the GPU's own work counts;
* ``issue``: host µs of the call that issues it;
* ``wall``: µs from the call to its end, synchronised (what an engine waits).

First, the host µs of each step of issuing a direct copy (``issue_parts_us``: the
index arrays and their checks, the caller's stream, the events that order the copy after
it, the index slots, the arguments, the launch of the kept compiled variant, the event
made for the caller, and the whole ``start``), each step alone, the device synchronised
after each (untimed). ``kernel_triton_launch`` is the direct kernel launched through
Triton's own launch each time, beside ``kernel_to_pinned``, which launches the compiled
variant it kept.

Beside it, in the same run: one contiguous pinned memcpy of the same bytes (the
baseline), the DMAs alone (one 1-D DMA per page into shuffled rows, batched; one 2-D DMA
over consecutive rows), the gather or scatter kernel alone (device to device staging), the
kernel straight to host memory, and the staged copy with several staging chunk sizes and
ring depths. Diagnostic, for :class:`hicache.kernels.TransferTuning`; one CUDA GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from hicache.kernels.copy_engine import Copies1D, _cudart
from hicache.kernels.segments import Segment, SegmentCopy
from hicache.kernels.staged import release_rings
from hicache.kernels.tuning import TransferTuning

MIB = 1 << 20
LAYERS, SEG, FRAME = 16, 64 << 10, 128
PAGE = LAYERS * SEG
#: (staging chunk MiB, chunks in the ring) of the staged rows; the default first
STAGINGS = [(64, 2), (32, 2), (16, 2), (8, 2), (8, 4), (4, 4)]


class Clock:
    """Times a call on ``stream`` (the current stream while it runs) three ways."""

    def __init__(self, stream: torch.cuda.Stream, repeat: int) -> None:
        self.stream = stream
        self.repeat = repeat
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(10_000_000)
        torch.cuda.synchronize()
        self.cycles_per_us = 10_000_000 / ((time.perf_counter() - t0) * 1e6)

    def __call__(self, fn: Callable[[], object]) -> dict[str, float]:
        gpu, issue, wall = [], [], []
        hold_us = 3000.0  # longer where the host takes longer to issue (after the warm-up)
        with torch.cuda.stream(self.stream):
            for i in range(self.repeat + 1):
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(int(self.cycles_per_us * hold_us))
                start.record()
                t0 = time.perf_counter()
                done = fn()
                t1 = time.perf_counter()
                if done is not None:
                    self.stream.wait_event(done)
                end.record()
                end.synchronize()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                done = fn()
                if done is not None:
                    done.synchronize()
                torch.cuda.synchronize()
                t3 = time.perf_counter()
                # longer holds where issuing takes longer, but bounded: a copy of more chunks
                # than its index slots waits for its first launches to run, so its issue
                # time includes the hold itself
                hold_us = min(max(hold_us, 2 * (t1 - t0) * 1e6 + 500), 20_000.0)
                if i:
                    gpu.append(start.elapsed_time(end) * 1e3)
                    issue.append((t1 - t0) * 1e6)
                    wall.append((t3 - t2) * 1e6)
        return {
            "gpu": statistics.median(gpu),
            "issue": statistics.median(issue),
            "wall": statistics.median(wall),
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", default="64,1024")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--watchdog-s", type=float, default=0, help="dump the stacks and exit")
    args = ap.parse_args()
    if args.watchdog_s:
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    dev = torch.device("cuda")
    n_max = max(sizes)
    rng = np.random.default_rng(0)
    stream = torch.cuda.Stream(dev)
    clock = Clock(stream, args.repeat)
    row = PAGE + FRAME
    tensors = [torch.zeros(n_max, SEG, dtype=torch.uint8, device=dev) for _ in range(LAYERS)]
    pages = torch.zeros(n_max, row, dtype=torch.uint8).pin_memory()
    segs = [Segment(t, 0, SEG, i * SEG) for i, t in enumerate(tensors)]
    flat_h = torch.zeros(n_max * MIB, dtype=torch.uint8).pin_memory()
    flat_d = torch.zeros(n_max * MIB, dtype=torch.uint8, device=dev)
    stage_d = torch.zeros(n_max * PAGE, dtype=torch.uint8, device=dev)
    t_start = time.monotonic()
    out: dict = {"device": torch.cuda.get_device_name(0), "rows": []}

    def add(n: int, what: str, way: str, t: dict[str, float], base: dict[str, float]) -> None:
        """A row: ``t`` beside ``base`` (the memcpy's times), gpu to gpu, wall to wall."""
        t = {**t, "ratio_gpu": base["gpu"] / t["gpu"], "ratio_wall": base["wall"] / t["wall"]}
        out["rows"].append({"MiB": n, "what": what, "way": way, **t})
        print(
            f"{time.monotonic() - t_start:6.1f}s {n:5d} MiB {way:9s} {what:24s} "
            f"gpu {t['gpu']:8.1f} µs ({t['ratio_gpu']:.3f})  "
            f"issue {t['issue']:7.1f}  wall {t['wall']:8.1f} ({t['ratio_wall']:.3f})",
            flush=True,
        )

    out["issue_parts_us"] = issue_parts(segs, pages, min(sizes))
    for n in sizes:
        for way in ("to_host", "to_device"):
            ways(n, way, clock, add, rng, tensors, pages, segs, flat_h, flat_d, stage_d)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def issue_parts(segs, pages, n: int, repeat: int = 300) -> dict[str, float]:
    """Host µs of each step a direct segment copy of ``n`` pages takes to issue (medians
    of ``repeat``, each step alone, to host, the device synchronised after each call,
    untimed): where a launch's host time goes."""
    from hicache.kernels.copy_engine import CopyDone

    copy = SegmentCopy(segs, pages, FRAME, TransferTuning(staged_segments_min_bytes=0))
    copy.warm()
    blocks = np.arange(n, dtype=np.int64)
    hosts = np.arange(n, dtype=np.int64)[::-1].copy()
    dev = copy.device
    stream = copy._stream_handle(True)
    caller = torch.cuda.current_stream(dev).cuda_stream

    def order() -> None:
        copy._order.order(1, stream, caller)

    def slots() -> None:
        with copy._slots.pair(blocks, hosts, stream):
            pass

    with copy._slots.pair(blocks, hosts, stream) as (b_addr, p_addr, _):
        args = copy._args(b_addr, p_addr, n * len(segs), 1, True)
    steps = {
        "arrays_and_checks": lambda: copy._check(np.asarray(blocks), np.asarray(hosts)),
        "caller_stream": lambda: torch.cuda.current_stream(dev).cuda_stream,
        "order_events": order,
        "index_slots": slots,
        "arguments": lambda: copy._args(0, 0, n * len(segs), 1, True),
        "compiled_launch": lambda: copy._compiled[True](1, stream, args),
        "done_event": lambda: CopyDone(stream),
        "whole_start": lambda: copy.start(blocks, hosts, True),
    }
    out = {}
    for name, fn in steps.items():
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        out[name] = statistics.median(times)
    print("host µs to issue a direct copy, step by step: "
          + "  ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)  # fmt: skip
    out.update(inside_start(copy, blocks, hosts, repeat))
    return out


def inside_start(copy: SegmentCopy, blocks, hosts, repeat: int) -> dict[str, float]:
    """The same whole ``start``, its steps timed inside it (medians of ``repeat``): what
    the steps timed alone leave out."""
    import hicache.kernels.segments as segments

    inner: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable) -> Callable:
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                inner.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)

        return run

    patched = {"_check": copy._check, "_launch": copy._launch, "staged": copy.staged}
    for name, fn in patched.items():
        setattr(copy, name, timed(name, fn))
    runner = copy._compiled[True]
    copy._compiled[True] = timed("compiled_call", runner)
    done_event = segments.CopyDone
    segments.CopyDone = timed("done_event", done_event)
    start = timed("whole", copy.start)
    try:
        for _ in range(repeat):
            start(blocks, hosts, True)
            torch.cuda.synchronize()
    finally:
        for name in patched:
            delattr(copy, name)
        copy._compiled[True] = runner
        segments.CopyDone = done_event
    med = {f"in_start_{k}": statistics.median(v) for k, v in inner.items()}
    med["in_start_rest"] = med["in_start_whole"] - sum(
        med[f"in_start_{k}"] for k in ("_check", "_launch", "staged", "done_event")
    )
    print("host µs inside one start: "
          + "  ".join(f"{k[9:]} {v:.1f}" for k, v in med.items()), flush=True)  # fmt: skip
    return med


def ways(n, way, clock, add, rng, tensors, pages, segs, flat_h, flat_d, stage_d) -> None:
    """The rows of ``n`` MiB one way."""
    n_max, row, nb = pages.shape[0], pages.shape[1], n * MIB
    to_host = way == "to_host"
    blocks = rng.permutation(n_max)[:n].astype(np.int64)
    hosts = rng.permutation(n_max)[:n].astype(np.int64)
    host_addr = (pages.data_ptr() + FRAME + hosts * row).astype(np.uint64)
    dev_addr = (stage_d.data_ptr() + np.arange(n, dtype=np.uint64) * PAGE).astype(np.uint64)
    sizes_u = np.full(n, PAGE, dtype=np.uint64)
    run_host = pages.data_ptr() + FRAME + int(rng.integers(0, n_max - n + 1)) * row
    stream = clock.stream
    lib = _cudart()
    dst, src = (flat_h[:nb], flat_d[:nb]) if to_host else (flat_d[:nb], flat_h[:nb])
    memcpy = clock(lambda: (dst.copy_(src, non_blocking=True), None)[1])
    floor = memcpy
    add(n, "memcpy", way, memcpy, floor)
    dsts, srcs = (host_addr, dev_addr) if to_host else (dev_addr, host_addr)
    for name, batched in (("dma_per_page_batched", True), ("dma_per_page_each", False)):
        if not batched and n > 256:  # a queue this deep blocks the issuing thread
            continue
        copies = Copies1D(dsts, srcs, sizes_u, stream.cuda_stream, batched)
        add(n, name, way, clock(lambda c=copies: c.issue(0, n)), floor)

    def dma_2d() -> None:
        if to_host:
            args_ = (run_host, row, stage_d.data_ptr(), PAGE, PAGE, n)
        else:
            args_ = (stage_d.data_ptr(), PAGE, run_host, row, PAGE, n)
        err = lib.cudaMemcpy2DAsync(*args_, 4, ctypes.c_void_p(stream.cuda_stream))
        assert not err, err

    add(n, "dma_2d_consecutive", way, clock(dma_2d), floor)
    direct = SegmentCopy(segs, pages, FRAME, TransferTuning(staged_segments_min_bytes=0))
    direct.warm()
    add(n, "kernel_to_pinned", way, clock(lambda: direct.start(blocks, hosts, to_host)), floor)
    # The same launched through Triton's own launch every time (no compiled variant kept).
    bound = SegmentCopy(segs, pages, FRAME, TransferTuning(staged_segments_min_bytes=0))
    bound._compiled = {True: None, False: None}
    add(n, "kernel_triton_launch", way, clock(lambda: bound.start(blocks, hosts, to_host)), floor)
    # The gather (a store) or scatter (a load) alone: blocks <-> a device staging buffer
    # of n back-to-back pages.
    stage_pages = stage_d[: n * PAGE].view(n, PAGE)
    off = TransferTuning(staged_segments_min_bytes=0)
    alone = SegmentCopy(segs, stage_pages, 0, off, use_kernel=True)
    slots = np.arange(n, dtype=np.int64)
    add(n, "kernel_device_only", way, clock(lambda: alone.start(blocks, slots, to_host)), floor)
    for chunk_mib, chunks in STAGINGS:
        tuning = TransferTuning(staging_chunk_bytes=chunk_mib * MIB, staging_chunks=chunks)
        staged = SegmentCopy(segs, pages, FRAME, tuning)
        staged.warm()
        timed = clock(lambda s=staged: s.start(blocks, hosts, to_host))
        add(n, f"staged_{chunk_mib}MiBx{chunks}", way, timed, floor)
        release_rings()


if __name__ == "__main__":
    main()
