"""vLLM's blocks through hicache on a CPU or a GPU: a store and a load of whole blocks, end to end,
against a memcpy of the same bytes in the same run.

On a CPU vLLM's KV tensors are the worker's private memory, so a store is two copies
(vLLM's blocks into the worker's shared staging area, then the sidecar's backup into its
host pool) and a load the same two the other way, plus the sidecar round trips. This
drives :class:`~hicache.integrations.vllm_worker.HiCacheOffloadingWorker` as vLLM's
connector does (``submit_store`` / ``submit_load``, then ``get_finished``) against a real
``hicache serve``, with one full-attention group of ``--layers`` layers (16 tokens a
block, 8 KV heads, head_dim 128, bfloat16: 64 KiB per layer per block), and prints GB/s
with the ratio to a ``Tensor.copy_`` of the same bytes, timed after warm-up stores have
touched the whole host pool (the sidecar keeps its LMDB tier; its writer is let catch up
between the timed transfers). Run it in ``.venv-vllm``.

Usage: ``.venv-vllm/bin/python benchmarks/bench_vllm_staging.py [--blocks 64] [--layers 8]
[--device cuda]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

PAGE_BYTES = 16 * 8 * 128 * 2 * 2  # one layer's block: 16 tokens of K and V
WARM_ROUNDS = 4


def sidecar_report(socket: Path) -> str:
    """The sidecar's failure counters and tiers, for a run that went wrong."""
    from hicache.controller.client import AdminClient
    from hicache.controller.wire.protocol import Verb

    admin = AdminClient("ipc://" + str(socket), timeout_s=30.0)
    try:
        stats = admin.call(Verb.STATS)
    except Exception as exc:
        return f"no stats: {exc}"
    finally:
        admin.close()
    keep = ("counters", "failures", "host", "disk", "pins_active")
    return json.dumps({k: v for k, v in stats.items() if k in keep}, default=str)[:6000]


def empty_host_pool(socket: Path, pool_bytes: int, timeout_s: float = 120.0) -> None:
    """Once the LMDB writer has committed everything queued, evict the whole host tier
    (the pages stay on disk): the next store finds free pages that were written before."""
    from hicache.controller.client import AdminClient
    from hicache.controller.wire.protocol import Verb

    admin = AdminClient("ipc://" + str(socket), timeout_s=30.0)
    end = time.monotonic() + timeout_s
    try:
        while admin.call(Verb.STATS).get("disk", {}).get("pending_writes", 0):
            assert time.monotonic() < end, "the disk writer did not catch up"
            time.sleep(0.05)
        admin.call(Verb.EVICT, {"tier": "host", "bytes": pool_bytes})
    finally:
        admin.close()


class Baseline:
    """One copy of ``nbytes`` the transfer could at best be: a memcpy on a CPU; on a GPU
    a pinned device-to-host copy (the sidecar's half of a store), timed to its end."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.what = "memcpy" if device.type == "cpu" else "pinned device-to-host copy"
        self.src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def __call__(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--device",
        default="cpu",
        help="where vLLM's blocks live: cpu, or cuda (the staging area then is GPU memory "
        "the sidecar maps over CUDA IPC, and the baseline a pinned host<->device copy)",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        make_offload_key,
    )

    from hicache.apps.engine.cluster import SidecarProcess, SidecarSettings
    from hicache.integrations.vllm_config import HiCacheVllmConfig
    from hicache.integrations.vllm_manager import HiCacheLoadSpec, HiCacheStoreSpec
    from hicache.integrations.vllm_pages import GroupPages, PageNamespace
    from hicache.integrations.vllm_worker import HiCacheOffloadingWorker

    workdir = Path(tempfile.mkdtemp(prefix="hvs", dir="/tmp"))
    # A host pool of WARM_ROUNDS stores: the warm-up touches every page of it (a fresh
    # pool's first writes fault its pages in, as in a sidecar that just started); before
    # each timed store the host tier is emptied (untimed), so it writes into pages that
    # were written before, as a running sidecar's stores do.
    pool_mib = WARM_ROUNDS * args.blocks * args.layers * PAGE_BYTES >> 20
    sidecar = SidecarProcess(
        workdir, SidecarSettings(host_pool_bytes=pool_mib << 20, disk_budget_bytes=1 << 30)
    ).start()
    socket = sidecar.socket_path
    n, layers = args.blocks, args.layers
    tensors = [
        torch.randint(-128, 128, (2 * n + 1, PAGE_BYTES), dtype=torch.int8, device=device)
        for _ in range(layers)
    ]
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, PAGE_BYTES) for t in tensors],
        [[CanonicalKVCacheRef(i, PAGE_BYTES) for i in range(layers)]],
    )
    namespace = PageNamespace.build(
        "bench", "bfloat16", (16,), (GroupPages(0, "FullAttentionSpec", (PAGE_BYTES,) * layers),), 1
    )
    config = HiCacheVllmConfig(socket=str(socket), staging_bytes=(n + 1) * namespace.page_bytes)
    worker = HiCacheOffloadingWorker(namespace, config, caches, rank=0)
    nbytes = n * layers * PAGE_BYTES
    job = 0

    def run(submit) -> float:
        nonlocal job
        job += 1
        t0 = time.perf_counter()
        submit(job)
        while not any(r.job_id == job for r in worker.get_finished()):
            time.sleep(0.0002)
        return time.perf_counter() - t0

    src = list(range(1, n + 1))  # block 0 is vLLM's null block
    dst = list(range(n + 1, 2 * n + 1))
    baseline = Baseline(nbytes, device)
    best = {"store": float("inf"), "load": float("inf"), "memcpy": float("inf")}
    try:
        for rep in range(WARM_ROUNDS + args.repeats):
            keys = [make_offload_key(f"{rep}:{i}".encode().ljust(32, b"."), 0) for i in range(n)]
            if rep < WARM_ROUNDS:
                spec = HiCacheStoreSpec(keys, [None, *keys[:-1]], list(range(n)))
                run(
                    lambda j, spec=spec: worker.submit_store(
                        j, GPULoadStoreSpec(src, [n], [0]), spec
                    )
                )
                continue
            empty_host_pool(socket, pool_mib << 20)
            store = HiCacheStoreSpec(keys, [None, *keys[:-1]], list(range(n)))
            best["store"] = min(
                best["store"],
                run(
                    lambda j, spec=store: worker.submit_store(
                        j, GPULoadStoreSpec(src, [n], [0]), spec
                    )
                ),
            )
            best["load"] = min(
                best["load"],
                run(
                    lambda j, keys=keys: worker.submit_load(
                        j, HiCacheLoadSpec(keys), GPULoadStoreSpec(dst, [n], [0])
                    )
                ),
            )
            assert not worker.take_failed_loads(), worker.counters
            best["memcpy"] = min(best["memcpy"], baseline())
        restored = all(torch.equal(t[1 : n + 1], t[n + 1 :]) for t in tensors)
        assert restored, "a load did not restore the bytes"
    except BaseException:
        print(sidecar_report(socket), "\n", sidecar.log_tail(), flush=True)
        raise
    finally:
        worker.shutdown()
        sidecar.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    m = nbytes / best["memcpy"] / 1e9
    print(
        f"vLLM blocks through the sidecar on {device.type}: {n} blocks x {layers} layers = "
        f"{nbytes / 2**20:.0f} MiB, best of {args.repeats}; {baseline.what} {m:.2f} GB/s"
    )
    for what in ("store", "load"):
        g = nbytes / best[what] / 1e9
        print(
            f"  {what:<5} {g:6.2f} GB/s  ({g / m:.2f} of the {baseline.what}; two copies and "
            f"the round trips)"
        )


if __name__ == "__main__":
    main()
