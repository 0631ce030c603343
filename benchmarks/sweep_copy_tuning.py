"""The GPU copy kernels under several launch tunings, each way and both ways at once.

    python3 benchmarks/sweep_copy_tuning.py [--sizes-mib 64,1024] [--repeat 20] [--json OUT]

A vLLM-shaped segment copy (16 per-layer byte tensors, 64 KiB of each a block, a 1 MiB host
page per block; blocks and pages in a shuffled order, as an engine's are) and the
load-back's prepared KV copy (16 layers, 8 KV heads of 128, bf16, 16-token pages of 1 MiB)
are timed on the device (CUDA events, median of ``--repeat``) to the device, to the host,
and both at once on two streams (a load and a store of as many bytes each), under each
tuning of :data:`TUNINGS` (tile bytes, programs per SM, warps); and the segment copy staged
(``segments_staged``: a device staging ring and one copy-engine DMA per page,
kernels/staged_segments.py) under the default tuning. Each is printed as the
ratio to a pinned memcpy of the same bytes the same way (both at once: two memcpys on two
streams, one each way), measured in the same run. Diagnostic, for choosing the defaults
of :class:`hicache.kernels.TransferTuning`; one CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial

import numpy as np
import torch

from hicache.kernels import PreparedTransfer
from hicache.kernels.segments import Segment, SegmentCopy
from hicache.kernels.tuning import TransferTuning

MIB = 1 << 20
LAYERS, SEG = 16, 64 << 10
# (tile bytes, programs per SM, warps): the default first.
# The staged segment copy (kernels/staged_segments.py) forced on, whatever the size.
STAGED = TransferTuning(staged_segments_min_bytes=1, staged_min_dma_bytes=1)
TUNINGS = [(16384, 2, 4), (16384, 1, 4), (16384, 4, 4), (32768, 2, 8), (8192, 4, 4), (16384, 2, 8)]


def device_us(fns, repeat: int, streams) -> float:
    """Device µs from before the first of ``fns`` starts to after the last ends, each
    ``fns[i]`` issued on ``streams[i]`` (median of ``repeat``, after a warm-up)."""
    main = torch.cuda.current_stream()
    times = []
    for i in range(repeat + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        for fn, s in zip(fns, streams):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                fn()
        for s in streams:
            main.wait_stream(s)
        end.record(main)
        end.synchronize()
        if i:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", default="64,1024")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    dev = torch.device("cuda")
    n_max = max(sizes)
    rng = np.random.default_rng(0)
    a, b = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    out: dict = {"device": torch.cuda.get_device_name(0), "rows": []}
    # Segment copies: 2 * n_max blocks and pages (a load's and a store's, apart).
    tensors = [torch.zeros(2 * n_max, SEG, dtype=torch.uint8, device=dev) for _ in range(LAYERS)]
    pages = torch.zeros(2 * n_max, LAYERS * SEG, dtype=torch.uint8).pin_memory()
    segs = [Segment(t, 0, SEG, i * SEG) for i, t in enumerate(tensors)]
    host_kv = torch.zeros(2 * n_max, 2, LAYERS, 16, 8, 128, dtype=torch.bfloat16).pin_memory()
    dev_kv = torch.zeros(2, LAYERS, 2 * n_max * 16, 8, 128, dtype=torch.bfloat16, device=dev)
    flat_h = torch.zeros(2 * n_max * MIB, dtype=torch.uint8).pin_memory()
    flat_d = torch.zeros(2 * n_max * MIB, dtype=torch.uint8, device=dev)
    for n in sizes:
        nb = n * MIB
        down = partial(_copy, flat_d[:nb], flat_h[:nb])
        up = partial(_copy, flat_h[nb : 2 * nb], flat_d[nb : 2 * nb])
        memcpy = {
            "to_device": device_us([down], args.repeat, [a]),
            "to_host": device_us([up], args.repeat, [a]),
            "both": device_us([down, up], args.repeat, [a, b]),
        }
        print(f"{n} MiB memcpy µs: " + " ".join(f"{k}={v:.0f}" for k, v in memcpy.items()))
        load_b = rng.permutation(2 * n_max)[:n]
        load_p = rng.permutation(2 * n_max)[:n]
        store_b = rng.permutation(np.setdiff1d(np.arange(2 * n_max), load_b))[:n]
        store_p = rng.permutation(np.setdiff1d(np.arange(2 * n_max), load_p))[:n]
        lists = [x.tolist() for x in (load_b, load_p, store_b, store_p)]
        for tile, pps, warps in TUNINGS:
            tuning = TransferTuning(tile_bytes=tile, programs_per_sm=pps, num_warps=warps)
            seg = SegmentCopy(segs, pages, 0, tuning)
            kv_in = PreparedTransfer.kv(dev_kv, host_kv, 16, to_host=False, backend="triton",
                                        tuning=tuning)  # fmt: skip
            kv_out = PreparedTransfer.kv(dev_kv, host_kv, 16, to_host=True, backend="triton",
                                         tuning=tuning)  # fmt: skip
            kinds = {
                "segments": (
                    partial(seg._launch, load_b, load_p, False),
                    partial(seg._launch, store_b, store_p, True),
                ),
                "load_back": (partial(kv_in, *lists[:2]), partial(kv_out, *lists[2:])),
            }
            if (tile, pps, warps) == TUNINGS[0]:  # the staged segment copy, beside
                staged = SegmentCopy(segs, pages, 0, STAGED).staged()
                kinds["segments_staged"] = (
                    partial(staged.run, load_b, load_p, False),
                    partial(staged.run, store_b, store_p, True),
                )
            for kind, (to_device, to_host) in kinds.items():
                us = {
                    "to_device": device_us([to_device], args.repeat, [a]),
                    "to_host": device_us([to_host], args.repeat, [a]),
                    "both": device_us([to_device, to_host], args.repeat, [a, b]),
                }
                row = {"kind": kind, "MiB": n, "tile_bytes": tile, "programs_per_sm": pps,
                       "num_warps": warps, "us": us,
                       "ratio": {k: memcpy[k] / v for k, v in us.items()}}  # fmt: skip
                out["rows"].append(row)
                print(
                    f"{n:5d} MiB {kind:15s} tile {tile:5d} per-SM {pps} warps {warps}: "
                    + " ".join(f"{k} {v:.3f}" for k, v in row["ratio"].items()),
                    flush=True,
                )
        out[f"memcpy_us_{n}"] = memcpy
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
