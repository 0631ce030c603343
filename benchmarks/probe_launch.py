"""Where a segment copy's fixed cost goes on a GPU: one vLLM-shaped copy (64 block tensors
of 16 KiB rows, a 1 MiB host page per block) timed stage by stage on the host, and its
device time by CUDA events, beside a pinned memcpy of the same bytes and the same copy with
its indices uploaded from pageable memory (as before they were read from a pinned buffer),
and the kernel alone each way with 16-byte accesses and with one word per access. Then the
load-back's own kernel (a prepared KV transfer) alone each way (``pool_kernel``), what a
backup's interprocess event costs (``ipc_event``), and what a small upload on the compute
stream waits while a load's copies are queued on the copy engines from another stream
(``behind_load``). Prints µs per call (median of ``--repeat``); ``--json`` writes the same
figures. Diagnostic, not in CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from hicache.kernels.segments import Segment, SegmentCopy


def median_us(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def device_us(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    nseg, seg_bytes, blocks = 64, 16 << 10, 1100
    tensors = [torch.zeros(blocks, seg_bytes, dtype=torch.uint8, device=dev) for _ in range(nseg)]
    pages = torch.zeros(blocks, nseg * seg_bytes, dtype=torch.uint8).pin_memory()
    segments = [Segment(t, 0, seg_bytes, i * seg_bytes) for i, t in enumerate(tensors)]
    copy = SegmentCopy(segments, pages)
    out: dict = {"device": torch.cuda.get_device_name(0)}
    for n in (1, 64, 1024):
        out[n] = row = probe(n, copy, pages, nseg, args.repeat)
        print(n, "MiB:", " ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True)
    out["pool_kernel"] = pools = pool_kernel(dev, args.repeat)
    for k, v in pools.items():
        print("load-back kernel:", k, " ".join(f"{a}={b:.3f}" for a, b in v.items()), flush=True)
    out["ipc_event"] = ipc = ipc_event_us(args.repeat)
    print("interprocess event:", " ".join(f"{a}={b:.1f}" for a, b in ipc.items()), flush=True)
    out["behind_load"] = behind = behind_load(dev)
    for k, v in behind.items():
        print("behind a load:", k, " ".join(f"{a}={b:.2f}" for a, b in v.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def probe(n: int, copy: SegmentCopy, pages: torch.Tensor, nseg: int, repeat: int) -> dict:
    """One size's figures (µs)."""
    dev = copy.device
    ids = list(range(n))
    host = torch.zeros(n << 20, dtype=torch.uint8).pin_memory()
    flat = torch.zeros(n << 20, dtype=torch.uint8, device=dev)
    row = {}
    row["memcpy_wall"] = median_us(
        lambda: (flat.copy_(host, non_blocking=True), torch.cuda.synchronize()), repeat
    )
    row["memcpy_dev"] = device_us(lambda: flat.copy_(host, non_blocking=True), repeat)
    row["to_device_wall"] = median_us(lambda: copy.to_device(ids, ids), repeat)
    row["start_only"] = median_us(lambda: copy.start(ids, ids, False), repeat)
    row["kernel_dev"] = device_us(
        lambda: copy._launch(np.asarray(ids), np.asarray(ids), False), repeat
    )
    a = np.asarray(ids, dtype=np.int64)
    row["np_and_check"] = median_us(
        lambda: copy._check(np.asarray(ids, dtype=np.int64), np.asarray(ids, dtype=np.int64)),
        repeat,
    )
    s = torch.cuda.Stream(dev)
    row["wait_stream"] = median_us(lambda: s.wait_stream(torch.cuda.current_stream(dev)), repeat)
    row["idx_pageable_h2d"] = median_us(
        lambda: torch.from_numpy(np.stack([a, a])).to(dev, non_blocking=True), repeat
    )
    pin = torch.empty((2, 4096), dtype=torch.int64).pin_memory()
    devidx = torch.empty((2, 4096), dtype=torch.int64, device=dev)

    def pinned_idx() -> None:
        pin.numpy()[0, :n] = a
        pin.numpy()[1, :n] = a
        devidx[:, :n].copy_(pin[:, :n], non_blocking=True)

    row["idx_pinned_h2d"] = median_us(pinned_idx, repeat)
    idx = torch.from_numpy(np.stack([a, a])).to(dev)

    def launch() -> None:
        copy._launch_on(idx, False)

    row["triton_launch"] = median_us(launch, repeat)
    row["launch_dev"] = device_us(launch, repeat)
    row["event_record_sync"] = median_us(
        lambda: torch.cuda.Event().record() or torch.cuda.synchronize(), repeat
    )
    # The same copy as DMAs: one 2-D copy per segment (rows n, pitch the page), and
    # one batched 1-D copy per segment and page.
    from hicache.kernels.copy_engine import Copies1D, issue_2d_copies

    seg_bytes = pages.shape[1] // nseg
    plan = [
        (s.tensor.data_ptr(), s.tensor.stride(0), pages.data_ptr() + s.dst_offset,
         pages.shape[1], seg_bytes, n)
        for s in copy.segments
    ]  # fmt: skip
    stream = torch.cuda.current_stream(dev).cuda_stream
    row["dma_2d_issue"] = median_us(lambda: issue_2d_copies(plan, stream), repeat)
    row["dma_2d_dev"] = device_us(lambda: issue_2d_copies(plan, stream), repeat)
    d1 = np.array(
        [s.tensor.data_ptr() + b * s.tensor.stride(0) for b in range(n) for s in copy.segments],
        dtype=np.uint64,
    )
    s1 = np.array(
        [pages.data_ptr() + b * pages.shape[1] + s.dst_offset for b in range(n)
         for s in copy.segments],
        dtype=np.uint64,
    )  # fmt: skip
    z1 = np.full(d1.size, seg_bytes, dtype=np.uint64)
    side = torch.cuda.Stream(dev)
    batch = Copies1D(d1, s1, z1, side.cuda_stream, batched=True)

    def batched() -> None:
        side.wait_stream(torch.cuda.current_stream(dev))
        batch.issue(0, d1.size)
        torch.cuda.current_stream(dev).wait_stream(side)

    row["dma_1d_issue"] = median_us(batched, repeat)
    row["dma_1d_dev"] = device_us(batched, repeat)
    side2 = torch.cuda.Stream(dev)

    def pageable_copy() -> None:  # the copy as it was: indices uploaded from pageable memory
        side2.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side2):
            up = torch.from_numpy(np.stack([a, a])).to(dev, non_blocking=True)
            copy._launch_on(up, False)
            done = torch.cuda.Event()
            done.record(side2)
        done.synchronize()

    row["to_device_wall_pageable"] = median_us(pageable_copy, repeat)
    # The kernel each way with 16-byte accesses (as it runs) and one word per access (as it
    # ran before), beside a memcpy the same way: device µs.
    row["memcpy_dev_to_host"] = device_us(lambda: host.copy_(flat, non_blocking=True), repeat)
    vec = copy._gpu["vec"]
    for v in sorted({vec, 1}):
        copy._gpu["vec"] = v
        for to_host in (False, True):
            way = "to_host" if to_host else "to_device"
            row[f"kernel_dev_{way}_vec{v}"] = device_us(
                lambda to_host=to_host: copy._launch(a, a, to_host), repeat
            )
    copy._gpu["vec"] = vec
    row["ratio_dev"] = row["memcpy_dev"] / row["kernel_dev"]
    row["ratio_wall"] = row["memcpy_wall"] / row["to_device_wall"]
    row["ratio_wall_pageable"] = row["memcpy_wall"] / row["to_device_wall_pageable"]
    return row


def pool_kernel(dev: torch.device, repeat: int) -> dict:
    """The load-back's own kernel (a prepared KV transfer: 16 layers, 8 KV heads of 128,
    bf16, 16-token pages of 1 MiB, as bench_data_plane's pools) alone, each way, at 64 and
    1024 pages: device µs beside a pinned memcpy of the same bytes, and the ratio."""
    return {n: _pool_row(dev, n, repeat) for n in (64, 1024)}


def _pool_row(dev: torch.device, n: int, repeat: int) -> dict:
    from hicache.kernels import PreparedTransfer

    host_kv = torch.zeros(n, 2, 16, 16, 8, 128, dtype=torch.bfloat16).pin_memory()
    device_kv = torch.zeros(2, 16, n * 16, 8, 128, dtype=torch.bfloat16, device=dev)
    ids = list(range(n))
    flat_h, flat_d = host_kv.view(-1), device_kv.view(-1)
    row = {}
    for to_host in (False, True):
        way = "to_host" if to_host else "to_device"
        move = PreparedTransfer.kv(device_kv, host_kv, 16, to_host=to_host, backend="triton")
        row[f"kernel_{way}_us"] = device_us(lambda move=move: move(ids, ids), repeat)
        src, dst = (flat_d, flat_h) if to_host else (flat_h, flat_d)
        row[f"memcpy_{way}_us"] = device_us(
            lambda src=src, dst=dst: dst.copy_(src, non_blocking=True), repeat
        )
        row[f"ratio_{way}"] = row[f"memcpy_{way}_us"] / row[f"kernel_{way}_us"]
    return row


_OPEN_EVENTS = """
import sys, time, statistics, torch
dev = torch.device("cuda", 0)
torch.cuda.init()
times = []
for line in sys.stdin:
    handle = bytes.fromhex(line.strip())
    t0 = time.perf_counter()
    ev = torch.cuda.Event.from_ipc_handle(dev, handle)
    torch.cuda.current_stream(dev).wait_event(ev)
    times.append(time.perf_counter() - t0)
print(statistics.median(times) * 1e6)
"""


def ipc_event_us(repeat: int) -> dict:
    """What a backup's interprocess event costs each time: µs to create, record and export
    one (the engine's side), and to open it and make a stream wait on it in another
    process (the sidecar's side), medians of ``repeat``."""
    import subprocess
    import sys

    handles, times, alive = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ev = torch.cuda.Event(interprocess=True)
        ev.record(torch.cuda.current_stream())
        handles.append(bytes(ev.ipc_handle()).hex())
        times.append(time.perf_counter() - t0)
        alive.append(ev)
    torch.cuda.synchronize()
    opened = subprocess.run(
        [sys.executable, "-c", _OPEN_EVENTS], input="\n".join(handles), text=True,
        capture_output=True, timeout=120,
    )  # fmt: skip
    row = {"export_us": statistics.median(times) * 1e6}
    try:
        row["open_and_wait_us"] = float(opened.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        print("opening the events failed:", opened.stderr[-500:], flush=True)
    return row


def behind_load(dev: torch.device, piece_mib: int = 32, pieces: int = 32) -> dict:
    """Milliseconds a small upload, a small pinned copy and a small kernel queued on the
    compute stream take to finish while ``queued`` pieces of a load (pinned host to device,
    ``piece_mib`` each) wait on the copy engines from a stream of their own: whether the
    compute stream's copies wait behind the load's."""
    host = torch.empty(pieces, piece_mib << 20, dtype=torch.uint8).pin_memory()
    devbuf = torch.empty(pieces, piece_mib << 20, dtype=torch.uint8, device=dev)
    load = torch.cuda.Stream(dev, priority=-1)
    small = np.arange(256, dtype=np.int64)
    pinned_small = torch.from_numpy(small).pin_memory()
    target = torch.empty(256, dtype=torch.int64, device=dev)
    out = {}
    for queued in (0, 2, pieces):
        row = {}
        for what in ("pageable_upload", "pinned_copy", "kernel"):
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                with torch.cuda.stream(load):
                    for i in range(queued):
                        devbuf[i].copy_(host[i], non_blocking=True)
                t0 = time.perf_counter()
                if what == "pageable_upload":  # as torch.tensor(list).to(device) does
                    torch.from_numpy(small).to(dev)
                else:
                    if what == "pinned_copy":
                        target.copy_(pinned_small, non_blocking=True)
                    else:
                        target.add_(1)
                    torch.cuda.current_stream(dev).synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            row[what + "_ms"] = statistics.median(times)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(load):
            for i in range(queued):
                devbuf[i].copy_(host[i], non_blocking=True)
        load.synchronize()
        row["load_alone_ms"] = (time.perf_counter() - t0) * 1e3
        out[f"queued_{queued}"] = row
    return out


if __name__ == "__main__":
    main()
