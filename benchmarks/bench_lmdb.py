"""LMDB tier and host-pool load-back throughput, each against its baseline in the same run.

* LMDB write: pages through the tier's writer thread (header, checksum, batched commits)
  against raw ``txn.put`` of the same bytes in transactions of the same batch size.
* LMDB read: the tier's ``read_into`` (one read transaction per page, copy into a host
  page, checksum) against raw ``txn.get`` of the same keys, one transaction per page.
  Both read what the writes left in the page cache.
* Load-back and backup: ``LocalController.load`` of pages held on host into device slots
  and ``LocalController.backup`` of device slots into host pages, each against a plain
  ``Tensor.copy_`` of the same number of bytes (pinned host memory on a GPU); the copy
  kernel alone on the same pages is printed too, and the difference per page is what the
  controller's bookkeeping adds; the same with 1 KiB pages, where the copy is nearly free,
  gives the controller's cost per page.
* "pool read": the tier's reads through its reader pool (``reader_threads``), for scale.
* ``--restart-pages N``: a controller's start on an LMDB tier of N pages (the index rebuilt
  from the headers) against one raw cursor pass over the same keys and headers.

Usage: ``python benchmarks/bench_lmdb.py [--total-mib 256] [--path DIR] [--sync]
[--load-back-only] [--restart-pages N]``
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import threading
import time
from pathlib import Path

import lmdb
import numpy as np
import torch

from hicache import CacheConfig, ComponentType, DevicePools, ModelLayout
from hicache.controller.config import MIB, ControllerConfig
from hicache.controller.store.local import LocalController
from hicache.controller.store.page_codec import HEADER_BYTES
from hicache.controller.tiers.lmdb_tier import LmdbTier, ReadStatus, WriteJob
from hicache.controller_api import PageRef
from hicache.kernels import kv_pages_to_device, kv_pages_to_host
from hicache.keys import namespace_hash, page_hashes

SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _keys(n: int) -> list[bytes]:
    return [i.to_bytes(16, "big") + b"\0" for i in range(n)]


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def _raw_run(path: Path, keys, pages, sync: bool, batch: int, map_size: int) -> tuple:
    """Raw lmdb: put in ``batch``-page transactions, then get one page per transaction."""
    env = lmdb.open(str(path), map_size=map_size, sync=sync, metasync=sync, readahead=False)
    t0 = time.perf_counter()
    for start in range(0, len(keys), batch):
        with env.begin(write=True) as txn:
            for i in range(start, min(len(keys), start + batch)):
                txn.put(keys[i], pages[i % len(pages)])
    write_s = time.perf_counter() - t0
    read_s = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for k in keys:
            with env.begin() as txn:
                txn.get(k)
        read_s = min(read_s, time.perf_counter() - t0)
    env.close()
    return write_s, read_s


def _tier_run(path: Path, keys, pages, sync: bool, batch: int) -> tuple:
    """The tier: pages through the writer thread, then ``read_into`` (alone, and pooled)."""
    size = pages[0].nbytes
    live = {"bytes": 0}

    def on_written(results, seconds):
        live["bytes"] += sum(r.nbytes for r in results if r.ok)

    cfg = ControllerConfig(
        disk_path=path,
        disk_budget_bytes=2 * len(keys) * (size + 4096),
        disk_sync=sync,
        writer_batch_pages=batch,
        writer_batch_bytes=batch * size,
    )
    tier = LmdbTier(
        cfg, b"D" * 16, {ComponentType.FULL: size}, lambda: live["bytes"], lambda b: [], on_written
    )
    tier.scan()
    tier.start()
    # Host pages carry room for the header in front (a frame), as the controller's do.
    frames = []
    for p in pages:
        frames.append(np.empty(HEADER_BYTES + size, np.uint8))
        frames[-1][HEADER_BYTES:] = p
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        job = WriteJob(k, ComponentType.FULL, b"P" * 16, frames[i % len(frames)], framed=True)
        tier.submit_write(job)
    assert tier.flush(600)
    write_s = time.perf_counter() - t0
    dst = np.empty(size, np.uint8)
    read_s = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for k in keys:
            assert tier.read_into(k, dst) is ReadStatus.OK
        read_s = min(read_s, time.perf_counter() - t0)
    local = threading.local()

    def read_one(key: bytes) -> ReadStatus:
        if not hasattr(local, "dst"):
            local.dst = np.empty(size, np.uint8)
        return tier.read_into(key, local.dst)

    t0 = time.perf_counter()
    futs = [tier.submit_read(read_one, k) for k in keys]
    assert all(f.result() is ReadStatus.OK for f in futs)
    pool_s = time.perf_counter() - t0
    tier.close()
    return write_s, read_s, pool_s


def bench_lmdb(
    size: int, total: int, root: Path, sync: bool, batch: int, repeats: int
) -> dict[str, float]:
    """Raw and tier runs alternated ``repeats`` times on fresh files; the best of each."""
    n = max(16, total // size)
    pages = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(8)]
    keys = _keys(n)
    map_size = 3 * n * (size + 8192) + 64 * MIB
    best = dict.fromkeys(("raw_write", "raw_read", "tier_write", "tier_read", "pool_read"), 1e9)
    for r in range(repeats):
        raw_dir, tier_dir = root / f"raw-{size}-{r}", root / f"tier-{size}-{r}"
        w, rd = _raw_run(raw_dir, keys, pages, sync, batch, map_size)
        best["raw_write"], best["raw_read"] = min(best["raw_write"], w), min(best["raw_read"], rd)
        w, rd, pool = _tier_run(tier_dir, keys, pages, sync, batch)
        best["tier_write"] = min(best["tier_write"], w)
        best["tier_read"] = min(best["tier_read"], rd)
        best["pool_read"] = min(best["pool_read"], pool)
        shutil.rmtree(raw_dir)
        shutil.rmtree(tier_dir)
    nbytes = n * size
    return {"pages": n, **{k: _mbps(nbytes, v) for k, v in best.items()}}


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def bench_load_back(
    total: int,
    device: str,
    layers: int = 8,
    heads: int = 8,
    head_dim: int = 128,
    backup_chunk_bytes: int = ControllerConfig.backup_chunk_bytes,
    gc_freeze: bool = False,
) -> dict[str, float]:
    """Device slots → host pages (backup) and back (load) through the controller, vs one
    plain copy of the bytes and vs the copy kernel alone on the same pages. The default
    layout has 512 KiB pages (bandwidth); a tiny one shows the per-page bookkeeping."""
    layout = ModelLayout(
        ("full",) * layers, num_kv_heads=heads, head_dim=head_dim, dtype="bfloat16"
    )
    page_size = 16
    page_bytes = layout.page_bytes(ComponentType.FULL, page_size)
    n = max(8, total // page_bytes)
    cache_cfg = CacheConfig(page_size=page_size, full_slots=2 * n * page_size, device=device)
    pools = DevicePools.allocate(layout, cache_cfg)
    fp = layout.fingerprint(page_size)
    src = pools.alloc_kv_pages(n)
    reps = 5
    # A backup of pages the controller holds already is a no-op: each timed backup is of
    # new pages (a new token range); the last one is then loaded back. The host pool is
    # written once first, as a running controller's would have been (pinned memory is).
    ctl = LocalController(
        ControllerConfig(
            host_pool_bytes=(reps * n + 4) * page_bytes, backup_chunk_bytes=backup_chunk_bytes
        )
    )
    ctl.register(layout, page_size, pools)
    ctl.store.host_view(ComponentType.FULL).zero_()
    if gc_freeze:  # as the sidecar does once its index is built
        gc.collect()
        gc.freeze()
    best_backup = best_call = float("inf")
    for rep in range(reps):
        tokens = list(range(rep * n * page_size, (rep + 1) * n * page_size))
        hashes = page_hashes(tokens, fp, page_size)
        parents = [namespace_hash(fp, None), *hashes[:-1]]
        refs = [PageRef(ComponentType.FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, src)]
        t0 = time.perf_counter()
        handle = ctl.backup(refs)
        best_call = min(best_call, time.perf_counter() - t0)  # the caller's thread is free
        assert handle.wait(60)
        best_backup = min(best_backup, time.perf_counter() - t0)
    dst = pools.alloc_kv_pages(n)
    load_refs = [PageRef(ComponentType.FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, dst)]
    pin = ctl.pin([r.key for r in load_refs], 60)
    best_load = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        assert ctl.load(load_refs, pin, 60)
        best_load = min(best_load, time.perf_counter() - t0)
    # The copy kernel alone, with the same pages: what the controller adds is the rest.
    host_kv = ctl.store.host_view(ComponentType.FULL)
    host_idx = torch.as_tensor(ctl.store.host_pages([r.key for r in refs]))
    dev_idx = torch.as_tensor([int(d) for d in dst])
    src_idx = torch.as_tensor([int(d) for d in src])
    best_kernel = best_kernel_out = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        kv_pages_to_device(host_kv, pools.full.buffer, host_idx, dev_idx, page_size)
        _sync(device)
        best_kernel = min(best_kernel, time.perf_counter() - t0)
        t0 = time.perf_counter()
        kv_pages_to_host(pools.full.buffer, host_kv, src_idx, host_idx, page_size)
        _sync(device)
        best_kernel_out = min(best_kernel_out, time.perf_counter() - t0)
    ctl.unpin(pin)
    ctl.close()
    a = torch.empty(n * page_bytes, dtype=torch.uint8)
    if device != "cpu":
        a = a.pin_memory()
    b = torch.empty(n * page_bytes, dtype=torch.uint8, device=device)
    best_copy = best_copy_out = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(device)
        best_copy = min(best_copy, time.perf_counter() - t0)
        t0 = time.perf_counter()
        a.copy_(b)
        _sync(device)
        best_copy_out = min(best_copy_out, time.perf_counter() - t0)
    nbytes = n * page_bytes
    return {
        "pages": n,
        "load": _mbps(nbytes, best_load),
        "kernel": _mbps(nbytes, best_kernel),
        "copy": _mbps(nbytes, best_copy),
        "backup": _mbps(nbytes, best_backup),
        "kernel_out": _mbps(nbytes, best_kernel_out),
        "copy_out": _mbps(nbytes, best_copy_out),
        # µs per page: through the controller, and the copy kernel alone
        "load_us": best_load / n * 1e6,
        "backup_us": best_backup / n * 1e6,
        "backup_call_us": best_call / n * 1e6,
        "kernel_us": best_kernel / n * 1e6,
        "kernel_out_us": best_kernel_out / n * 1e6,
    }


def bench_restart(pages: int, root: Path) -> dict[str, float]:
    """A controller's start on an LMDB tier holding ``pages`` pages of 1 KiB (the index is
    rebuilt from the stored headers), against one raw cursor pass over the same
    environment that copies every key and value header."""
    layout = ModelLayout(("full",) * 2, num_kv_heads=1, head_dim=8, dtype="bfloat16")
    page_size, batch = 16, 2048
    page_bytes = layout.page_bytes(ComponentType.FULL, page_size)
    path = root / "restart"
    cfg = CacheConfig(page_size=page_size, full_slots=batch * page_size, device="cpu")
    pools = DevicePools.allocate(layout, cfg)

    def controller() -> LocalController:
        ctl = LocalController(
            ControllerConfig(
                host_pool_bytes=2 * batch * page_bytes,
                disk_path=path,
                disk_budget_bytes=2 * pages * (page_bytes + 4096),
                disk_sync=False,
            )
        )
        ctl.register(layout, page_size, pools)
        return ctl

    ctl = controller()
    fp = layout.fingerprint(page_size)
    src = pools.alloc_kv_pages(batch)
    for start in range(0, pages, batch):
        tokens = list(range(start * page_size, (start + batch) * page_size))
        hashes = page_hashes(tokens, fp, page_size)
        parents = [namespace_hash(fp, None), *hashes[:-1]]
        refs = [PageRef(ComponentType.FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, src)]
        assert ctl.backup(refs).wait(60) and ctl.flush(120)
    ctl.close()
    t0 = time.perf_counter()
    ctl = controller()
    open_s = time.perf_counter() - t0
    found = ctl.store.indexed_pages()
    ctl.close()
    env = lmdb.open(str(path), subdir=True, readonly=True, lock=False, readahead=False)
    t0 = time.perf_counter()
    with env.begin(buffers=True) as txn:
        raw = sum(1 for k, v in txn.cursor() if bytes(k) and bytes(v[:HEADER_BYTES]))
    raw_s = time.perf_counter() - t0
    env.close()
    assert raw == found, f"{found} pages indexed, {raw} stored"
    return {"pages": found, "open_s": open_s, "raw_s": raw_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--total-mib", type=int, default=256, help="bytes per page size (MiB)")
    ap.add_argument("--path", type=Path, default=None, help="where to put the LMDB files")
    ap.add_argument("--sync", action="store_true", help="fsync every commit (both sides)")
    ap.add_argument("--batch-pages", type=int, default=64, help="pages per write transaction")
    ap.add_argument("--repeats", type=int, default=3, help="alternated runs; best of each")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--load-back-only", action="store_true", help="skip the LMDB runs (load-back, backup)"
    )
    ap.add_argument(
        "--restart-pages",
        type=int,
        default=0,
        help="also time a start on an LMDB tier holding this many pages (0: skip)",
    )
    ap.add_argument(
        "--backup-chunk-mib",
        default=f"0,{ControllerConfig.backup_chunk_bytes // MIB}",
        help="backup_chunk_bytes values to time backups with, MiB, comma-separated "
        "(0: the whole backup in one copy per component; default: 0 and the default)",
    )
    ap.add_argument(
        "--gc-freeze",
        action="store_true",
        help="freeze the garbage collector's objects before the timed backups and loads, "
        "as the sidecar does (an engine embedding the controller may not)",
    )
    args = ap.parse_args()
    total = args.total_mib * MIB
    chunks = [int(float(c) * MIB) for c in args.backup_chunk_mib.split(",")]
    if not args.load_back_only:
        root = Path(tempfile.mkdtemp(prefix="bench-lmdb-", dir=args.path))
        try:
            print(
                f"LMDB tier vs raw lmdb, {args.total_mib} MiB per size, sync={args.sync}, "
                f"batch={args.batch_pages} pages, best of {args.repeats}, files under {root}"
            )
            print(
                f"{'page':>8} {'pages':>6} | {'write MB/s':>10} {'raw':>8} {'ratio':>6} | "
                f"{'read MB/s':>10} {'raw':>8} {'ratio':>6} | {'pool read':>9}"
            )
            for size in SIZES:
                r = bench_lmdb(size, total, root, args.sync, args.batch_pages, args.repeats)
                print(
                    f"{size >> 10:>6}Ki {r['pages']:>6} | {r['tier_write']:>10.0f} "
                    f"{r['raw_write']:>8.0f} {r['tier_write'] / r['raw_write']:>6.0%} | "
                    f"{r['tier_read']:>10.0f} {r['raw_read']:>8.0f} "
                    f"{r['tier_read'] / r['raw_read']:>6.0%} | {r['pool_read']:>9.0f}"
                )
        finally:
            shutil.rmtree(root, ignore_errors=True)
    lb = bench_load_back(total, args.device, backup_chunk_bytes=chunks[0], gc_freeze=args.gc_freeze)
    print(
        f"host-pool load-back to {args.device}: {lb['pages']} pages of 512 KiB, "
        f"{lb['load']:.0f} MB/s vs plain copy {lb['copy']:.0f} MB/s "
        f"({lb['load'] / lb['copy']:.0%}); the copy kernel alone: {lb['kernel']:.0f} MB/s"
    )
    for i, chunk in enumerate(chunks):
        if i:
            lb = bench_load_back(
                total, args.device, backup_chunk_bytes=chunk, gc_freeze=args.gc_freeze
            )
        print(
            f"backup from {args.device} into the host pool, backup_chunk_bytes "
            f"{chunk / MIB:g} MiB: {lb['backup']:.0f} MB/s vs plain copy "
            f"{lb['copy_out']:.0f} MB/s ({lb['backup'] / lb['copy_out']:.0%}); the copy "
            f"kernel alone: {lb['kernel_out']:.0f} MB/s; the call returns after "
            f"{lb['backup_call_us'] * lb['pages'] / 1000:.2f} ms, "
            f"done after {lb['backup_us'] * lb['pages'] / 1000:.2f} ms"
        )
    if args.restart_pages:
        root = Path(tempfile.mkdtemp(prefix="bench-restart-", dir=args.path))
        try:
            rs = bench_restart(args.restart_pages, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(
            f"start on an LMDB tier of {rs['pages']} pages: {rs['open_s']:.2f} s "
            f"({rs['open_s'] / rs['pages'] * 1e6:.1f} µs per page); a raw cursor pass over "
            f"its keys and headers: {rs['raw_s']:.2f} s ({rs['open_s'] / rs['raw_s']:.1f}x)"
        )
    # 1 KiB pages: the copy is nearly free, so the rest is the controller's cost per page.
    sm = bench_load_back(
        4 * MIB, args.device, layers=2, heads=1, head_dim=8, gc_freeze=args.gc_freeze
    )
    print(
        f"per page, {sm['pages']} pages of 1 KiB: backup {sm['backup_us']:.1f} µs "
        f"(the call {sm['backup_call_us']:.1f}) "
        f"(copy kernel alone {sm['kernel_out_us']:.2f}), load {sm['load_us']:.1f} µs "
        f"(copy kernel alone {sm['kernel_us']:.2f})"
    )


if __name__ == "__main__":
    main()
