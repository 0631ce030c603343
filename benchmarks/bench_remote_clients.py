"""The remote tier's client, chosen by measurement: valkey-glide against redis-py.

Both clients write and read the same pages (``--pages`` values of ``--page-kib``, as the
remote tier stores them: one hash of two fields each) on the same three-master cluster,
as one pipelined batch each way, glide through its async ``ClusterBatch`` (non-atomic),
redis-py (with hiredis) through its cluster pipeline. The two alternate within each
round; the medians of ``--rounds`` rounds are printed.

valkey-glide is not a dependency of hicache: run this from an environment that has it
(and redis-py, hiredis and pytest, for the tests' cluster harness).

Usage: ``python benchmarks/bench_remote_clients.py [--pages 64] [--page-kib 1024]
[--rounds 6]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from redis.cluster import ClusterNode, RedisCluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--page-kib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    try:
        from glide import (
            ClusterBatch,
            GlideClusterClient,
            GlideClusterClientConfiguration,
            NodeAddress,
        )
    except ImportError:
        print("valkey-glide is not installed here: nothing to compare")
        return 1
    from tests.support.cluster import LocalCluster

    cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="hicache-bench-clients-"))).start()
    value = os.urandom(args.page_kib * 1024)
    mib = args.pages * args.page_kib / 1024
    rates: dict[str, list[float]] = {k: [] for k in ("glide_put", "glide_get", "py_put", "py_get")}

    async def glide_round(client: GlideClusterClient, r: int) -> None:
        keys = [f"g:{r}:{{{i}}}" for i in range(args.pages)]
        batch = ClusterBatch(is_atomic=False)
        for k in keys:
            batch.hset(k, {"h": "x", "b": value})
        t0 = time.perf_counter()
        await client.exec(batch, raise_on_error=True)
        rates["glide_put"].append(mib / (time.perf_counter() - t0))
        batch = ClusterBatch(is_atomic=False)
        for k in keys:
            batch.hmget(k, ["h", "b"])
        t0 = time.perf_counter()
        await client.exec(batch, raise_on_error=True)
        rates["glide_get"].append(mib / (time.perf_counter() - t0))

    def py_round(client: RedisCluster, r: int) -> None:
        keys = [f"r:{r}:{{{i}}}" for i in range(args.pages)]
        pipe = client.pipeline()
        for k in keys:
            pipe.hset(k, mapping={"h": "x", "b": value})
        t0 = time.perf_counter()
        pipe.execute()
        rates["py_put"].append(mib / (time.perf_counter() - t0))
        pipe = client.pipeline()
        for k in keys:
            pipe.hmget(k, ["h", "b"])
        t0 = time.perf_counter()
        pipe.execute()
        rates["py_get"].append(mib / (time.perf_counter() - t0))

    async def run() -> None:
        addrs = [NodeAddress("127.0.0.1", port) for port in cluster.ports]
        glide = await GlideClusterClient.create(
            GlideClusterClientConfiguration(addrs, request_timeout=30000)
        )
        py = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", port) for port in cluster.ports])
        for r in range(args.rounds):
            if r % 2:
                py_round(py, r)
                await glide_round(glide, r)
            else:
                await glide_round(glide, r)
                py_round(py, r)
            cluster.flushall()
        await glide.close()
        py.close()

    try:
        asyncio.run(run())
    finally:
        cluster.stop()
    m = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{args.pages} x {args.page_kib} KiB, median of {args.rounds} rounds (MiB/s)")
    print(f"  valkey-glide:       put {m['glide_put']:6.0f}   get {m['glide_get']:6.0f}")
    print(f"  redis-py + hiredis: put {m['py_put']:6.0f}   get {m['py_get']:6.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
