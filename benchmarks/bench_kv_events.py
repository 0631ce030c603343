"""Lookup latency with KV events on: no subscriber, a slow one, none published at all.

One controller (in-process, host tier only) is kept churning by a thread that backs up
fresh chains into a full host pool, so every backup stores pages and evicts others: a
stream of ``BlockStored``/``BlockRemoved`` events. Meanwhile the main thread times
lookups of a resident chain, one by one. Three setups, interleaved in rounds in the same
run so that the machine's noise falls on each alike:

* ``off``: no publisher (the store's listener is None);
* ``absent``: a publisher whose PUB socket nobody reads;
* ``slow``: a subscriber connected that never reads (its high-water mark fills, the PUB
  socket drops for it, the queue may overflow and drop, counted).

Printed: p50 and p99 of a lookup per setup, the ratio of each p99 to ``off``'s, and the
events published and dropped.

    .venv/bin/python benchmarks/bench_kv_events.py [--seconds 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import numpy as np
import zmq

from hicache import CacheConfig, DevicePools, ModelLayout
from hicache.controller.config import ControllerConfig
from hicache.controller.sidecar.config import SidecarConfig
from hicache.controller.sidecar.kv_events import KvEventPublisher
from hicache.controller.store.local import LocalController
from hicache.controller_api import PageRef
from hicache.keys import namespace_hash, page_hashes
from hicache.layout import LayerKind
from hicache.types import ComponentType

PAGE = 16
FULL = ComponentType.FULL


def _layout() -> ModelLayout:
    return ModelLayout(
        (LayerKind.FULL,) * 4, num_kv_heads=2, head_dim=16, dtype="float32", model_id="bench-ev"
    )


def _chain(fp: bytes, seed: int, pages: int, device_pages: np.ndarray) -> list[PageRef]:
    tokens = np.arange(pages * PAGE) + seed * 1_000_003
    hashes = page_hashes(tokens, fp, PAGE)
    parents = [namespace_hash(fp, None), *hashes[:-1]]
    return [PageRef(FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, device_pages)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="per setup and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lookup-pages", type=int, default=64)
    args = ap.parse_args()

    layout = _layout()
    fp = layout.fingerprint(PAGE)
    cfg = CacheConfig(page_size=PAGE, full_slots=64 * PAGE * 8, shared_memory=False)
    pools = DevicePools.allocate(layout, cfg)
    page_bytes = layout.page_bytes(FULL, PAGE)
    ctl = LocalController(
        ControllerConfig(disk_path=None, host_pool_bytes=512 * page_bytes), layout, PAGE
    )
    ctl.register(layout, PAGE, pools)
    device = pools.alloc_kv_pages(64)
    resident = _chain(fp, 0, args.lookup_pages, device)
    assert ctl.backup(resident).wait(30)
    hashes = [r.page_hash for r in resident]

    tmp = tempfile.mkdtemp(prefix="kvev")
    publisher = KvEventPublisher(
        SidecarConfig(
            kv_events_endpoint=f"ipc://{tmp}/ev.sock",
            kv_events_hwm=1000,
            kv_events_queue_events=20_000,
        ),
        lambda: PAGE,
    )
    ctx = zmq.Context()

    stop = threading.Event()

    def churn() -> None:
        seed = 1
        while not stop.is_set():
            ctl.backup(_chain(fp, seed, 32, device[:32])).wait(30)
            seed += 1

    churner = threading.Thread(target=churn, daemon=True)
    churner.start()
    times: dict[str, list[float]] = {"off": [], "absent": [], "slow": []}
    clock = time.perf_counter
    for _ in range(args.rounds):
        for setup in times:
            sub = None
            if setup == "slow":
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.setsockopt(zmq.RCVHWM, 10)
                sub.connect(publisher.endpoint)
            ctl.store.listen(None if setup == "off" else publisher, tell_present=False)
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                t0 = clock()
                ctl.lookup(hashes, [FULL])
                times[setup].append(clock() - t0)
            if sub is not None:
                sub.close(linger=0)
    stop.set()
    churner.join(30)
    ctl.store.listen(None)
    publisher.close()
    ctx.destroy(linger=0)
    ctl.close()

    base = None
    print(f"lookup of {args.lookup_pages} pages, {args.rounds} rounds of {args.seconds}s each")
    for setup, ts in times.items():
        ts.sort()
        p50, p99 = ts[len(ts) // 2] * 1e6, ts[int(len(ts) * 0.99)] * 1e6
        base = base or p99
        print(
            f"  {setup:7} n={len(ts):7d}  p50 {p50:7.1f} us  p99 {p99:7.1f} us  "
            f"p99 / off {p99 / base:.2f}"
        )
    print(f"events published {publisher.published}, dropped {publisher.dropped}")


if __name__ == "__main__":
    main()
