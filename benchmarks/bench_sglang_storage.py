"""Throughput of hicache's SGLang backend against SGLang's HiCacheFile and a memcpy.

Run in the SGLang environment (``bash scripts/sglang_env.sh`` builds it)::

    .venv-sglang/bin/python benchmarks/bench_sglang_storage.py [--pages 128] [--rounds 3]

One run, the same host pages for all three: ``batch_set_v1`` / ``batch_get_v1`` through a
fresh ``hicache serve`` (the copy path: SGLang's host pages through the backend's shared
staging pages), HiCacheFile's ``batch_set`` / ``batch_get`` (the calls SGLang's controller
makes for it) in a temporary directory, and a plain ``copy_`` of the same bytes between
two host buffers. Prints GB/s per direction and each one's ratio to the memcpy.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "engines" / "sglang"))

import sglang_support as sgl  # noqa: E402
from sidecar_support import Sidecar, short_tmpdir  # noqa: E402


def _best(fn, rounds: int) -> float:
    """The fastest of ``rounds`` runs of ``fn`` (seconds): the least disturbed one."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=128, help="pages per batch (SGLang's batch)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    sgl.LAYERS, sgl.HEADS, sgl.HEAD_DIM = 8, 4, 128  # a page of 2 x 8 x 4 x 128 x 4 tokens
    sgl.DEVICE_TOKENS = args.pages * sgl.PAGE_SIZE
    pool = sgl.mha_host_pool()
    pages = args.pages
    src = pool.alloc(pages * sgl.PAGE_SIZE)
    dst = pool.alloc(pages * sgl.PAGE_SIZE)
    pool.kv_buffer.view(torch.int16).random_()
    ps = pool.page_size
    offsets = [int(src[i * ps]) for i in range(pages)]
    keys = sgl.page_keys(list(range(pages * ps)))
    page_bytes = pool.get_data_page(offsets[0]).numel() * pool.dtype.itemsize
    total = pages * page_bytes

    copy_dst = torch.empty(total, dtype=torch.uint8)

    def memcpy() -> None:
        at = 0
        for o in offsets:
            page = pool.get_data_page(o).view(torch.uint8)
            copy_dst[at : at + page.numel()].copy_(page)
            at += page.numel()

    results = {"memcpy": (_best(memcpy, args.rounds),) * 2}

    with tempfile.TemporaryDirectory() as tmp:
        hf = sgl.file_backend(tmp, pool)

        def file_set() -> None:
            hf.clear()
            hf.batch_set(keys, [pool.get_data_page(o) for o in offsets])

        def file_get() -> None:
            targets = [pool.get_dummy_flat_data_page() for _ in keys]
            got = hf.batch_get(keys, targets)
            for o, page in zip([int(dst[i * ps]) for i in range(pages)], got):
                pool.set_from_flat_data_page(o, page)

        results["HiCacheFile"] = (_best(file_set, args.rounds), _best(file_get, args.rounds))

    workdir = short_tmpdir("hcbench")
    sidecar_args = ["--host-pool-bytes", "512MiB", "--disk-budget-bytes", "2GiB"]
    with Sidecar(workdir, args=sidecar_args) as car:
        backend = sgl.hicache_backend(car.endpoint, pool, hicache_staging_pages=pages,
                                      hicache_backup_timeout_s=60.0, hicache_load_timeout_s=60.0)
        try:
            # fresh keys each round: a page already held is only deduplicated
            rounds = iter(range(1, args.rounds + 1))
            set_s = _best(
                lambda: backend.batch_set_v1(
                    sgl.page_keys([next(rounds), *range(pages * ps - 1)]), src
                ),
                args.rounds,
            )
            assert all(backend.batch_set_v1(keys, src)), "hicache refused pages"
            ok = backend.batch_get_v1(keys, dst)
            assert all(ok), "hicache lost pages during the benchmark"
            get_s = _best(lambda: backend.batch_get_v1(keys, dst), args.rounds)
        finally:
            backend.close()
        results["hicache sidecar (copy path)"] = (set_s, get_s)

    base_set, base_get = results["memcpy"]
    print(f"{pages} pages of {page_bytes / 1024:.0f} KiB ({total / 2**20:.1f} MiB), best of "
          f"{args.rounds}")
    print(f"{'':30s} {'set GB/s':>9s} {'x memcpy':>9s} {'get GB/s':>9s} {'x memcpy':>9s}")
    for name, (s, g) in results.items():
        print(f"{name:30s} {total / s / 1e9:9.2f} {base_set / s:9.3f} "
              f"{total / g / 1e9:9.2f} {base_get / g:9.3f}")
    hc_set, hc_get = results["hicache sidecar (copy path)"]
    f_set, f_get = results["HiCacheFile"]
    print(f"hicache / HiCacheFile throughput: set {f_set / hc_set:.2f}x, get {f_get / hc_get:.2f}x")


if __name__ == "__main__":
    main()
