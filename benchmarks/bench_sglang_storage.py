"""Throughput of hicache's SGLang backend against SGLang's HiCacheFile and a memcpy.

Run in the SGLang environment (``bash scripts/sglang_env.sh`` builds it)::

    .venv-sglang/bin/python benchmarks/bench_sglang_storage.py [--pages 128] [--rounds 3]

One run, the same host pages for all: ``batch_set_v1`` / ``batch_get_v1`` through a fresh
``hicache serve``, HiCacheFile's ``batch_set`` / ``batch_get`` (the calls SGLang's
controller makes for it) in a temporary directory, and a plain ``copy_`` of the same
bytes between two contiguous host buffers (the floor). The sidecar runs twice: through
the backend's staging pages (the copy path) and with the host pool in a memfd the sidecar
maps (the zero-copy path, SGLang's ``"allocator": "shm"``). Prints GB/s per direction
and each one's ratio to the memcpy.
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


def _through_sidecar(endpoint, pool, src, dst, keys, args, label) -> tuple[float, float]:
    """(set seconds, get seconds) of ``batch_set_v1`` / ``batch_get_v1`` of ``src`` /
    into ``dst`` through the sidecar at ``endpoint``."""
    ps = pool.page_size
    backend = sgl.hicache_backend(endpoint, pool, hicache_staging_pages=args.pages,
                                  hicache_backup_timeout_s=60.0, hicache_load_timeout_s=60.0)
    try:
        assert backend.zero_copy == ("zero-copy" in label), label
        # fresh keys each round: a page already held is only deduplicated
        rounds = iter(range(1, 10 * args.rounds))
        set_s = _best(
            lambda: backend.batch_set_v1(
                sgl.page_keys([next(rounds) * 1000, *range(args.pages * ps - 1)]), src
            ),
            args.rounds,
        )
        assert all(backend.batch_set_v1(keys, src)), "hicache refused pages"
        assert all(backend.batch_get_v1(keys, dst)), "hicache lost pages"
        get_s = _best(lambda: backend.batch_get_v1(keys, dst), args.rounds)
    finally:
        backend.close()
    return set_s, get_s


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

    # the floor: one contiguous copy of as many bytes as the batch holds
    copy_src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    copy_dst = torch.empty(total, dtype=torch.uint8)

    def memcpy() -> None:
        copy_dst.copy_(copy_src)

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
    sidecar_args = ["--host-pool-bytes", "1GiB", "--disk-budget-bytes", "4GiB"]
    with Sidecar(workdir, args=sidecar_args) as car:
        # the same bytes in a memfd host pool (SGLang's "allocator": "shm"): zero-copy
        shm_pool = sgl.mha_host_pool(allocator="shm")
        shm_src = shm_pool.alloc(pages * ps)
        shm_dst = shm_pool.alloc(pages * ps)
        shm_pool.kv_buffer.view(torch.int16).copy_(pool.kv_buffer.view(torch.int16))
        for label, host, put, take in (
            ("hicache sidecar, copy path", pool, src, dst),
            ("hicache sidecar, zero-copy", shm_pool, shm_src, shm_dst),
        ):
            results[label] = _through_sidecar(car.endpoint, host, put, take, keys, args, label)
        got = shm_pool.kv_buffer.view(torch.int16)[:, :, shm_dst[0] : shm_dst[-1] + 1]
        assert torch.equal(got, pool.kv_buffer.view(torch.int16)[:, :, src[0] : src[-1] + 1])

    base_set, base_get = results["memcpy"]
    print(f"{pages} pages of {page_bytes / 1024:.0f} KiB ({total / 2**20:.1f} MiB), best of "
          f"{args.rounds}")
    print(f"{'':30s} {'set GB/s':>9s} {'x memcpy':>9s} {'get GB/s':>9s} {'x memcpy':>9s}")
    for name, (s, g) in results.items():
        print(f"{name:30s} {total / s / 1e9:9.2f} {base_set / s:9.3f} "
              f"{total / g / 1e9:9.2f} {base_get / g:9.3f}")
    f_set, f_get = results["HiCacheFile"]
    for label in ("hicache sidecar, copy path", "hicache sidecar, zero-copy"):
        hc_set, hc_get = results[label]
        print(f"{label} / HiCacheFile throughput: set {f_set / hc_set:.2f}x, "
              f"get {f_get / hc_get:.2f}x")


if __name__ == "__main__":
    main()
