"""A first disk hit through hicache's SGLang backend, with and without read-ahead.

Run in the SGLang environment (``bash scripts/sglang_env.sh`` builds it)::

    .venv-sglang/bin/python benchmarks/bench_sglang_read_ahead.py [--pages 64]
        [--page-tokens 64] [--gap-ms 5,20] [--rounds 8]

``--rounds`` batches are stored (``batch_set_v1``) through a ``hicache serve`` with a disk
tier, which is then restarted: every page is on disk only, as after a node's restart.
Then, batch by batch, SGLang's prefetch as its threads make it: the hit query
(``batch_exists``), the scheduler's step between (``--gap-ms``, slept), and the get
(``batch_get_v1``), with ``hicache_read_ahead`` on and off taking turns. Prints, per gap,
the get's time and the time from the hit query to the get's end (medians), and the ratio
of each with read-ahead to without; the bytes got are checked against the ones stored.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support
sys.path.insert(0, str(ROOT / "tests" / "engines" / "sglang"))

import sglang_support as sgl  # noqa: E402

from tests.support.sidecar import Sidecar, short_tmpdir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64, help="pages per batch")
    ap.add_argument("--page-tokens", type=int, default=64, help="64: 1 MiB pages")
    ap.add_argument("--gap-ms", default="5,20", help="the steps between hit query and get")
    ap.add_argument("--rounds", type=int, default=8, help="batches per gap, half of them each way")
    args = ap.parse_args()
    sgl.LAYERS, sgl.HEADS, sgl.HEAD_DIM = 8, 4, 128
    sgl.PAGE_SIZE = args.page_tokens
    sgl.DEVICE_TOKENS = args.pages * sgl.PAGE_SIZE
    pages, ps = args.pages, sgl.PAGE_SIZE
    gaps = [float(g) / 1e3 for g in args.gap_ms.split(",")]
    pool = sgl.mha_host_pool()
    src, dst = pool.alloc(pages * ps), pool.alloc(pages * ps)
    pool.kv_buffer.view(torch.int16).random_()
    want = sgl.host_page_bytes(pool, src, pages)
    page_bytes = pool.get_data_page(int(src[0])).numel() * pool.dtype.itemsize
    workdir = short_tmpdir("hcra")
    total = pages * page_bytes * args.rounds * len(gaps)
    car = Sidecar(
        workdir, args=["--host-pool-bytes", str(2 * total), "--disk-budget-bytes", str(4 * total)]
    ).start()
    opts = {"hicache_staging_pages": pages, "hicache_load_timeout_s": 60.0,
            "hicache_backup_timeout_s": 60.0}  # fmt: skip
    ms: dict[tuple[float, bool], list[tuple[float, float]]] = {}
    try:
        backend = sgl.hicache_backend(car.endpoint, pool, **opts)
        batches = [sgl.page_keys([r * 7919 + 5, *range(pages * ps - 1)])
                   for r in range(args.rounds * len(gaps))]  # fmt: skip
        for keys in batches:
            assert all(backend.batch_set_v1(keys, src)), "a batch was not stored"
        backend.close()
        car.stop()  # drains: every disk write is committed
        car.start()
        for i, keys in enumerate(batches):
            gap, ahead = gaps[i // args.rounds], i % 2 == 0
            backend = sgl.hicache_backend(car.endpoint, pool, hicache_read_ahead=ahead, **opts)
            try:
                t0 = time.perf_counter()
                assert backend.batch_exists(keys) == pages, "the batch is not held"
                time.sleep(gap)
                t1 = time.perf_counter()
                assert all(backend.batch_get_v1(keys, dst)), "the get missed"
                t2 = time.perf_counter()
            finally:
                backend.close()
            assert sgl.host_page_bytes(pool, dst, pages) == want, "other bytes came back"
            ms.setdefault((gap, ahead), []).append(((t2 - t1) * 1e3, (t2 - t0) * 1e3))
    finally:
        car.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"{pages} pages of {page_bytes >> 10} KiB from disk after a restart, medians of "
          f"{args.rounds // 2} each way")  # fmt: skip
    print(f"{'gap ms':>7} {'read-ahead':>11} {'get ms':>8} {'query..get end ms':>18}")
    for gap in gaps:
        med = {
            a: [statistics.median(x[j] for x in ms[gap, a]) for j in (0, 1)] for a in (True, False)
        }
        for ahead in (True, False):
            get, whole = med[ahead]
            print(f"{gap * 1e3:7.0f} {'on' if ahead else 'off':>11} {get:8.1f} {whole:18.1f}")
        on, off = med[True], med[False]
        print(f"{'':7} {'on / off':>11} {on[0] / off[0]:8.2f} {on[1] / off[1]:18.2f}")


if __name__ == "__main__":
    main()
