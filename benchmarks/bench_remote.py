"""Remote tier throughput and lookup latency, against the raw client in the same run.

* put: pages leave host through the remote tier's writer as the host tier evicts them
  (``on_host_eviction``: the copy out of the host page, header and checksum, the
  two-field split, an existence check, pipelined writes per master) against redis-py's
  own cluster pipeline writing the same bytes, already split, as ``HSET`` commands (the
  raw client, no check, no copy);
* get: pages read into host pages through the tier's fills (pipelined reads per master,
  the codec's checks, the copy into the host page, the index) against the raw cluster
  pipeline's ``HMGET`` of the same keys;
* lookup: a controller lookup of a chain held only remotely (the local index, then the
  remote probe), p50 and p99, against the raw pipeline's ``EXISTS`` of the same keys;
* memory: the cluster's ``used_memory`` per page stored as the tier stores it (one hash of
  two fields) against one string of header and payload.

The tier runs with its default batch sizes and threads; the raw pipeline sends all of
a round's pages in one batch. Every figure is the median of ``--rounds``
rounds, a ratio the median of each round's tier / raw (the two ran back to back): the
ratios are what to read on a shared machine. Without ``--url`` a cluster of three
``redis-server`` masters is started on loopback (the tests' harness) and stopped at the
end.

Usage: ``python benchmarks/bench_remote.py [--pages 64] [--page-kib 1024] [--rounds 5]
[--url redis://host:port,...]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from redis.cluster import ClusterNode, RedisCluster

from hicache import CacheConfig, ComponentType, DevicePools, ModelLayout
from hicache.controller.config import MIB, ControllerConfig, RemoteWritePolicy
from hicache.controller.store.local import LocalController
from hicache.controller.store.page_codec import encode_value
from hicache.controller.tiers.remote_cluster import parse_remote_url
from hicache.controller.tiers.remote_store import FIELD_BODY, FIELD_HEAD, remote_key, split_value
from hicache.controller_api import P_REMOTE, PageKey, PageRef
from hicache.types import Tier

HEAD_DIM = 128
KV_HEADS = 8


def _node(url: str, layout: ModelLayout, page_size: int, pages: int) -> LocalController:
    page_bytes = layout.page_bytes(ComponentType.FULL, page_size)
    # The tier's own batch sizes and threads (the defaults); the raw pipeline sends every
    # page in one batch.
    config = ControllerConfig(
        host_pool_bytes=pages * page_bytes,
        disk_path=None,
        remote_url=url,
        remote_write_policy=RemoteWritePolicy.OFF,
        remote_write_queue_pages=1 << 16,
        remote_lookup_timeout_s=2.0,
        remote_read_timeout_s=30.0,
        remote_write_timeout_s=30.0,
    )
    return LocalController(config, layout, page_size)


def _chain(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(16) for _ in range(n)]


def run(url: str, pages: int, page_kib: int, rounds: int) -> dict[str, float]:
    page_size = page_kib * 1024 // (2 * KV_HEADS * HEAD_DIM * 4)
    layout = ModelLayout(("full",), num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="float32")
    page_bytes = layout.page_bytes(ComponentType.FULL, page_size)
    cfg = CacheConfig(page_size=page_size, full_slots=pages * page_size)
    pools = DevicePools.allocate(layout, cfg)
    torch.manual_seed(0)
    pools.full.buffer.normal_()
    seeds, _, _ = parse_remote_url(url)
    raw = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in seeds])
    out: dict[str, list[float]] = {k: [] for k in (
        "tier_put", "raw_put", "tier_get", "raw_get", "lookup_p50", "lookup_p99",
        "raw_exists_p50")}  # fmt: skip
    # One writer and one reader for every round, as in a sidecar that has run a while:
    # later rounds reuse host memory the first one touched (a fresh host pool pays its
    # page faults on first use). Round 0 warms up and is not counted.
    writer = _node(url, layout, page_size, pages)
    writer.register(layout, page_size, pools)
    reader = _node(url, layout, page_size, pages)
    reader.register(layout, page_size, pools, engine_id="reader")
    for r in range(rounds + 1):
        if r == 1:
            out = {k: [] for k in out}
        raw.flushall(target_nodes=RedisCluster.PRIMARIES)
        hashes = _chain(pages, seed=r)
        parents = [bytes(16), *hashes[:-1]]
        writer.config.remote_write_policy = RemoteWritePolicy.OFF  # backups: host only
        refs = [PageRef(ComponentType.FULL, h, p, i) for i, (h, p) in
                enumerate(zip(hashes, parents, strict=True))]  # fmt: skip
        assert writer.backup(refs).wait(60)
        # The raw client: the same bytes (already framed and split) under other keys.
        frames = [split_value(encode_value(ComponentType.FULL, bytes(16), p, bytes(page_bytes)))
                  for p in parents]  # fmt: skip
        raw_keys = [b"raw" + remote_key("hicache", h, ComponentType.FULL) for h in hashes]

        def tier_put() -> float:
            writer.config.remote_write_policy = RemoteWritePolicy.ON_HOST_EVICTION
            t0 = time.perf_counter()
            assert writer.store.evict(Tier.HOST, 1 << 62)["pages"] == pages
            assert writer.flush(120)
            return time.perf_counter() - t0

        def raw_put(raw_keys: list = raw_keys, frames: list = frames) -> float:
            t0 = time.perf_counter()
            pipe = raw.pipeline()
            for k, (head, body) in zip(raw_keys, frames, strict=True):
                pipe.hset(k, mapping={FIELD_HEAD: head, FIELD_BODY: body})
            pipe.execute()
            return time.perf_counter() - t0

        def tier_get(hashes: list = hashes) -> float:
            keys = [PageKey(ComponentType.FULL, h) for h in hashes]
            t0 = time.perf_counter()
            assert reader.prefetch(keys, engine_id="reader").wait(120)
            return time.perf_counter() - t0

        def raw_get(raw_keys: list = raw_keys) -> float:
            t0 = time.perf_counter()
            pipe = raw.pipeline()
            for k in raw_keys:
                pipe.hmget(k, [FIELD_HEAD, FIELD_BODY])
            got = pipe.execute()
            seconds = time.perf_counter() - t0
            assert all(len(g[1]) for g in got)
            return seconds

        # Which side goes first alternates: the first pays for memory the second reuses.
        for name, run_one in sorted({"tier_put": tier_put, "raw_put": raw_put}.items(),
                                    reverse=bool(r % 2)):  # fmt: skip
            out[name].append(pages * page_bytes / run_one() / MIB)
        assert writer.stats()["remote"]["ops"]["put"]["ok"] == pages * (r + 1)

        lookups = []
        for _ in range(30):
            t0 = time.perf_counter()
            res = reader.lookup(hashes, [ComponentType.FULL], engine_id="reader")
            lookups.append(time.perf_counter() - t0)
            assert (res.presence[ComponentType.FULL] == P_REMOTE).all()
        out["lookup_p50"].append(float(np.percentile(lookups, 50)) * 1e3)
        out["lookup_p99"].append(float(np.percentile(lookups, 99)) * 1e3)
        exists = []
        for _ in range(30):
            t0 = time.perf_counter()
            pipe = raw.pipeline()
            for k in raw_keys:
                pipe.exists(k)
            pipe.execute()
            exists.append(time.perf_counter() - t0)
        out["raw_exists_p50"].append(float(np.percentile(exists, 50)) * 1e3)

        for name, run_one in sorted({"tier_get": tier_get, "raw_get": raw_get}.items(),
                                    reverse=bool(r % 2)):  # fmt: skip
            out[name].append(pages * page_bytes / run_one() / MIB)
        assert reader.stats()["remote"]["fills"]["ok"] == pages * (r + 1)
        reader.check_invariants()
    for ctrl in (writer, reader):
        ctrl.close()
    raw.close()
    pools.close()
    # Each round's tier/raw ratio: the two ran back to back, under the same load.
    out["put_ratio"] = [t / r for t, r in zip(out["tier_put"], out["raw_put"], strict=True)]
    out["get_ratio"] = [t / r for t, r in zip(out["tier_get"], out["raw_get"], strict=True)]
    return {k: statistics.median(v) for k, v in out.items()}


def memory_per_page(url: str, page_bytes: int, pages: int = 100) -> dict[str, float]:
    """The cluster's memory per stored page, as a multiple of the page's bytes: the
    tier's layout (one hash, two fields) against one string of header and payload."""
    seeds, _, _ = parse_remote_url(url)
    raw = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in seeds])
    rng = np.random.default_rng(0)

    def used() -> int:
        per_node = raw.info("memory", target_nodes=RedisCluster.PRIMARIES)
        return sum(node["used_memory"] for node in per_node.values())

    out = {}
    for layout in ("hash", "string"):
        raw.flushall(target_nodes=RedisCluster.PRIMARIES)
        before = used()
        for _ in range(pages):
            value = encode_value(ComponentType.FULL, bytes(16), bytes(16), rng.bytes(page_bytes))
            key = remote_key("hicache", rng.bytes(16), ComponentType.FULL)
            if layout == "string":
                raw.set(key, value)
            else:
                head, body = split_value(value)
                raw.hset(key, mapping={FIELD_HEAD: head, FIELD_BODY: bytes(body)})
        out[layout] = (used() - before) / pages / page_bytes
    raw.flushall(target_nodes=RedisCluster.PRIMARIES)
    raw.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--page-kib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--url", help="an existing cluster (default: start three masters)")
    args = p.parse_args()
    cluster = None
    url = args.url
    if url is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support
        from tests.support.cluster import LocalCluster

        cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="hicache-bench-remote-"))).start()
        url = cluster.url
    try:
        f = run(url, args.pages, args.page_kib, args.rounds)
        mem = memory_per_page(url, args.page_kib * 1024)
    finally:
        if cluster is not None:
            cluster.stop()
    total = args.pages * args.page_kib / 1024
    print(f"remote tier, {args.pages} pages of {args.page_kib} KiB ({total:.0f} MiB) per round, "
          f"median of {args.rounds} rounds")  # fmt: skip
    print(f"  put:    tier {f['tier_put']:7.0f} MiB/s   raw pipeline {f['raw_put']:7.0f} MiB/s"
          f"   ratio {f['put_ratio']:.2f}")  # fmt: skip
    print(f"  get:    tier {f['tier_get']:7.0f} MiB/s   raw pipeline {f['raw_get']:7.0f} MiB/s"
          f"   ratio {f['get_ratio']:.2f}")  # fmt: skip
    print(
        f"  lookup of {args.pages} pages: p50 {f['lookup_p50']:.2f} ms, p99 "
        f"{f['lookup_p99']:.2f} ms (raw pipelined EXISTS p50 {f['raw_exists_p50']:.2f} ms)"
    )
    print(f"  memory per page: {mem['hash']:.3f} x the page as stored (one hash, two fields), "
          f"{mem['string']:.3f} x as one string of header and payload")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
