"""Throughput of hicache's SGLang backend against SGLang's HiCacheFile and a memcpy.

Run in the SGLang environment (``bash scripts/sglang_env.sh`` builds it)::

    .venv-sglang/bin/python benchmarks/bench_sglang_storage.py [--pages 128] [--rounds 3]

One run, the same host pages for all: ``batch_set_v1`` / ``batch_get_v1`` through a fresh
``hicache serve``, HiCacheFile's ``batch_set`` / ``batch_get`` (the calls SGLang's
controller makes for it) in a temporary directory, and a plain ``copy_`` of the same
bytes between two contiguous host buffers (the floor: the fastest of the run, for both
directions). The sidecar runs twice: through
the backend's staging pages (the copy path) and with the host pool in a memfd the sidecar
maps (the zero-copy path, SGLang's ``"allocator": "shm"``), and a third time with the
backend copying pages straight to and from the sidecar's host pages mapped into it (the
engine-copies path, the default with a local sidecar); that path's get also as SGLang
makes it, after its hit query (``batch_exists``, untimed), whose pin lets the get copy at
once (``hicache_read_ahead``). Prints GB/s per direction and each one's ratio to the
memcpy.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support
sys.path.insert(0, str(ROOT / "tests" / "engines" / "sglang"))

import sglang_support as sgl  # noqa: E402

from tests.support.sidecar import Sidecar, short_tmpdir  # noqa: E402

AFTER_QUERY = "hicache engine copies, hit query"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=128, help="pages per batch (SGLang's batch)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--page-tokens", type=int, default=4, help="4: 64 KiB pages, 64: 1 MiB, 512: 8 MiB"
    )
    args = ap.parse_args()

    # a page of 2 x 8 layers x 4 heads x 128 x page-tokens bf16 values
    sgl.LAYERS, sgl.HEADS, sgl.HEAD_DIM = 8, 4, 128
    sgl.PAGE_SIZE = args.page_tokens
    sgl.DEVICE_TOKENS = args.pages * sgl.PAGE_SIZE
    pages, ps = args.pages, sgl.PAGE_SIZE
    pool = sgl.mha_host_pool()
    shm_pool = sgl.mha_host_pool(allocator="shm")  # SGLang's "allocator": "shm": a memfd
    src, dst = pool.alloc(pages * ps), pool.alloc(pages * ps)
    assert torch.equal(shm_pool.alloc(pages * ps), src)
    assert torch.equal(shm_pool.alloc(pages * ps), dst)
    pool.kv_buffer.view(torch.int16).random_()
    shm_pool.kv_buffer.view(torch.int16).copy_(pool.kv_buffer.view(torch.int16))
    offsets = [int(src[i * ps]) for i in range(pages)]
    dst_offsets = [int(dst[i * ps]) for i in range(pages)]
    page_bytes = pool.get_data_page(offsets[0]).numel() * pool.dtype.itemsize
    total = pages * page_bytes

    # the floor: one contiguous copy of as many bytes as the batch holds
    copy_src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    copy_dst = torch.empty(total, dtype=torch.uint8)

    tmp = tempfile.TemporaryDirectory()
    hf = sgl.file_backend(tmp.name, pool)
    workdir = short_tmpdir("hcbench")  # the sidecar's socket and LMDB, removed at the end
    car = Sidecar(
        workdir, args=["--host-pool-bytes", "2GiB", "--disk-budget-bytes", "8GiB"]
    ).start()
    opts = {
        "hicache_staging_pages": pages,
        "hicache_backup_timeout_s": 60.0,
        "hicache_load_timeout_s": 60.0,
    }
    copy_path = sgl.hicache_backend(car.endpoint, pool, hicache_engine_copies=False, **opts)
    zero_copy = sgl.hicache_backend(car.endpoint, shm_pool, hicache_engine_copies=False, **opts)
    engine = sgl.hicache_backend(car.endpoint, pool, **opts)
    assert zero_copy.zero_copy and not copy_path.zero_copy
    assert engine.pages.copied, "the engine-copies path is not available"
    times: dict[str, list[list[float]]] = {}
    try:
        for r in range(args.rounds):
            # fresh keys each round (a page already held is only deduplicated), the
            # methods interleaved so that a busy moment of the machine hits them alike
            keys = sgl.page_keys([r * 7919 + 1, *range(pages * ps - 1)])
            zc_keys = sgl.page_keys([r * 7919 + 2, *range(pages * ps - 1)])
            ec_keys = sgl.page_keys([r * 7919 + 3, *range(pages * ps - 1)])
            hq_keys = sgl.page_keys([r * 7919 + 4, *range(pages * ps - 1)])

            def file_get(keys=keys) -> None:
                got = hf.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
                for o, page in zip(dst_offsets, got):
                    pool.set_from_flat_data_page(o, page)

            rows = {
                "memcpy": (lambda: copy_dst.copy_(copy_src), lambda: copy_dst.copy_(copy_src)),
                "HiCacheFile": (
                    lambda keys=keys: hf.batch_set(keys, [pool.get_data_page(o) for o in offsets]),
                    file_get,
                ),
                "hicache sidecar, copy path": (
                    lambda keys=keys: copy_path.batch_set_v1(keys, src),
                    lambda keys=keys: copy_path.batch_get_v1(keys, dst),
                ),
                "hicache sidecar, zero-copy": (
                    lambda zc_keys=zc_keys: zero_copy.batch_set_v1(zc_keys, src),
                    lambda keys=keys: zero_copy.batch_get_v1(keys, dst),
                ),
                "hicache sidecar, engine copies": (
                    lambda ec_keys=ec_keys: engine.batch_set_v1(ec_keys, src),
                    lambda ec_keys=ec_keys: engine.batch_get_v1(ec_keys, dst),
                ),
                # the get as SGLang makes it: after its hit query (untimed, below)
                AFTER_QUERY: (
                    lambda hq_keys=hq_keys: engine.batch_set_v1(hq_keys, src),
                    lambda hq_keys=hq_keys: engine.batch_get_v1(hq_keys, dst),
                ),
            }
            for name, (put, take) in rows.items():
                times.setdefault(name, [[], []])
                for i, fn in enumerate((put, take)):
                    if name == AFTER_QUERY and i == 1:
                        assert engine.batch_exists(hq_keys) == pages
                    answer: list = []
                    times[name][i].append(_timed(lambda fn=fn, answer=answer: answer.append(fn())))
                    # a call that stored or found nothing ran fast for nothing: not timed
                    if name.startswith("hicache") and not all(answer[0]):
                        raise SystemExit(
                            f"{name}: {'set' if i == 0 else 'get'} answered a miss for "
                            f"{answer[0].count(False)} of {len(answer[0])} pages"
                        )
        hit = zero_copy.batch_get_v1(keys, dst)
        assert all(hit), "hicache lost pages during the benchmark"
        got = shm_pool.kv_buffer.view(torch.int16)[:, :, dst[0] : dst[-1] + 1]
        assert torch.equal(got, pool.kv_buffer.view(torch.int16)[:, :, src[0] : src[-1] + 1])
    finally:
        copy_path.close()
        zero_copy.close()
        engine.close()
        car.stop()
        tmp.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)

    best = {name: (min(t[0]), min(t[1])) for name, t in times.items()}
    # The floor of both directions: the fastest memcpy of the run, in either slot. The
    # slot before the sets follows the last round's sets, whose disk writes the sidecar
    # may still be making, and ran up to half as fast; a floor per slot flattered the sets.
    base_set = base_get = min(best["memcpy"])
    print(
        f"{pages} pages of {page_bytes / 1024:.0f} KiB ({total / 2**20:.1f} MiB), best of "
        f"{args.rounds} interleaved rounds"
    )
    print(f"{'':34s} {'set GB/s':>9s} {'x memcpy':>9s} {'get GB/s':>9s} {'x memcpy':>9s}")
    for name, (s, g) in best.items():
        print(
            f"{name:34s} {total / s / 1e9:9.2f} {base_set / s:9.3f} "
            f"{total / g / 1e9:9.2f} {base_get / g:9.3f}"
        )
    f_set, f_get = best["HiCacheFile"]
    for label in (
        "hicache sidecar, copy path",
        "hicache sidecar, zero-copy",
        "hicache sidecar, engine copies",
        AFTER_QUERY,
    ):
        hc_set, hc_get = best[label]
        print(
            f"{label} / HiCacheFile throughput: set {f_set / hc_set:.2f}x, "
            f"get {f_get / hc_get:.2f}x"
        )


if __name__ == "__main__":
    main()
