"""LMDB tier and host-pool load-back throughput, each against its baseline in the same run.

* LMDB write: pages through the tier's writer thread (header, checksum, batched commits)
  against raw ``txn.put`` of the same bytes in transactions of the same batch size.
* LMDB read: the tier's ``read_into`` (one read transaction per page, copy into a host
  page, checksum) against raw ``txn.get`` of the same keys, one transaction per page.
  Both read what the writes left in the page cache.
* Load-back: ``LocalController.load`` of pages held on host into device slots, against a
  plain ``Tensor.copy_`` of the same number of bytes.

Usage: ``python benchmarks/bench_lmdb.py [--total-mib 256] [--path DIR] [--sync]``
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np
import torch

from hicache import CacheConfig, ComponentType, DevicePools, ModelLayout
from hicache.controller.config import MIB, ControllerConfig
from hicache.controller.lmdb_tier import LmdbTier, ReadStatus, WriteJob
from hicache.controller.local import LocalController
from hicache.controller_api import PageRef
from hicache.keys import namespace_hash, page_hashes

SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _keys(n: int) -> list[bytes]:
    return [i.to_bytes(16, "big") + b"\0" for i in range(n)]


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def bench_lmdb(size: int, total: int, root: Path, sync: bool, batch: int) -> dict[str, float]:
    n = max(16, total // size)
    pages = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(8)]
    keys = _keys(n)
    map_size = 3 * n * (size + 8192) + 64 * MIB

    raw_dir = root / f"raw-{size}"
    env = lmdb.open(str(raw_dir), map_size=map_size, sync=sync, metasync=sync, readahead=False)
    t0 = time.perf_counter()
    for start in range(0, n, batch):
        with env.begin(write=True) as txn:
            for i in range(start, min(n, start + batch)):
                txn.put(keys[i], pages[i % 8])
    raw_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    for k in keys:
        with env.begin() as txn:
            value = txn.get(k)
        assert len(value) == size
    raw_read = time.perf_counter() - t0
    env.close()

    live = {"bytes": 0}

    def on_written(results, seconds):
        live["bytes"] += sum(r.nbytes for r in results if r.ok)

    cfg = ControllerConfig(
        disk_path=root / f"tier-{size}",
        disk_budget_bytes=2 * n * (size + 4096),
        disk_sync=sync,
        writer_batch_pages=batch,
        writer_batch_bytes=batch * size,
    )
    tier = LmdbTier(
        cfg, b"D" * 16, {ComponentType.FULL: size}, lambda: live["bytes"], lambda b: [], on_written
    )
    tier.scan()
    tier.start()
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        tier.submit_write(WriteJob(k, ComponentType.FULL, b"P" * 16, pages[i % 8]))
    assert tier.flush(600)
    tier_write = time.perf_counter() - t0
    dst = np.empty(size, np.uint8)
    t0 = time.perf_counter()
    for k in keys:
        assert tier.read_into(k, dst) is ReadStatus.OK
    tier_read = time.perf_counter() - t0
    tier.close()
    shutil.rmtree(raw_dir)
    shutil.rmtree(cfg.disk_path)
    nbytes = n * size
    return {
        "pages": n,
        "raw_write": _mbps(nbytes, raw_write),
        "tier_write": _mbps(nbytes, tier_write),
        "raw_read": _mbps(nbytes, raw_read),
        "tier_read": _mbps(nbytes, tier_read),
    }


def bench_load_back(total: int, device: str) -> dict[str, float]:
    """Host pages → device slots through the controller, vs one plain copy of the bytes."""
    layout = ModelLayout(("full",) * 8, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    page_size = 16
    page_bytes = layout.page_bytes(ComponentType.FULL, page_size)  # 512 KiB
    n = max(8, total // page_bytes)
    cache_cfg = CacheConfig(page_size=page_size, full_slots=2 * n * page_size, device=device)
    pools = DevicePools.allocate(layout, cache_cfg)
    ctl = LocalController(ControllerConfig(host_pool_bytes=(n + 4) * page_bytes))
    ctl.register(layout, page_size, pools)
    fp = layout.fingerprint(page_size)
    hashes = page_hashes(list(range(n * page_size)), fp, page_size)
    parents = [namespace_hash(fp, None), *hashes[:-1]]
    src = pools.alloc_kv_pages(n)
    refs = [PageRef(ComponentType.FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, src)]
    assert ctl.backup(refs).wait(60)
    dst = pools.alloc_kv_pages(n)
    load_refs = [PageRef(ComponentType.FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, dst)]
    pin = ctl.pin([r.key for r in load_refs], 60)
    best_load = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        assert ctl.load(load_refs, pin, 60)
        best_load = min(best_load, time.perf_counter() - t0)
    ctl.unpin(pin)
    ctl.close()
    a = torch.empty(n * page_bytes, dtype=torch.uint8)
    if device != "cpu":
        a = a.pin_memory()
    b = torch.empty(n * page_bytes, dtype=torch.uint8, device=device)
    best_copy = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        if device != "cpu":
            torch.cuda.synchronize()
        best_copy = min(best_copy, time.perf_counter() - t0)
    nbytes = n * page_bytes
    return {"pages": n, "load": _mbps(nbytes, best_load), "copy": _mbps(nbytes, best_copy)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--total-mib", type=int, default=256, help="bytes per page size (MiB)")
    ap.add_argument("--path", type=Path, default=None, help="where to put the LMDB files")
    ap.add_argument("--sync", action="store_true", help="fsync every commit (both sides)")
    ap.add_argument("--batch-pages", type=int, default=64, help="pages per write transaction")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    total = args.total_mib * MIB
    root = Path(tempfile.mkdtemp(prefix="bench-lmdb-", dir=args.path))
    try:
        print(
            f"LMDB tier vs raw lmdb, {args.total_mib} MiB per size, sync={args.sync}, "
            f"batch={args.batch_pages} pages, files under {root}"
        )
        print(
            f"{'page':>8} {'pages':>6} | {'write MB/s':>10} {'raw':>8} {'ratio':>6} | "
            f"{'read MB/s':>10} {'raw':>8} {'ratio':>6}"
        )
        for size in SIZES:
            r = bench_lmdb(size, total, root, args.sync, args.batch_pages)
            print(
                f"{size >> 10:>6}Ki {r['pages']:>6} | {r['tier_write']:>10.0f} "
                f"{r['raw_write']:>8.0f} {r['tier_write'] / r['raw_write']:>6.0%} | "
                f"{r['tier_read']:>10.0f} {r['raw_read']:>8.0f} "
                f"{r['tier_read'] / r['raw_read']:>6.0%}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lb = bench_load_back(total, args.device)
    print(
        f"host-pool load-back to {args.device}: {lb['pages']} pages of 512 KiB, "
        f"{lb['load']:.0f} MB/s vs plain copy {lb['copy']:.0f} MB/s "
        f"({lb['load'] / lb['copy']:.0%})"
    )


if __name__ == "__main__":
    main()
