"""The controller's page index at scale: a use of a page (a touch) against a plain LRU.

An index of N pages on disk is built the way a start builds it, then 2N uses of random
pages are timed one by one: the mean, the 99.9th percentile and the worst single use,
against the same uses of an ``OrderedDict`` LRU of the same keys (``move_to_end``), the
least any LRU does per use. The worst use is what a lookup waiting on the controller's lock
would see. ``--frozen`` first moves the index out of garbage collection, as the sidecar
does once its index is built.

    .venv/bin/python benchmarks/bench_index.py [--pages 1000000] [--frozen]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections import OrderedDict
from types import SimpleNamespace

from hicache.controller.store.page_index import PageIndex
from hicache.types import ComponentType

ROOT = b"\0" * 16


def _timed(uses: list, use) -> tuple[float, float, float]:
    """Mean, 99.9th percentile and worst seconds of ``use(x)`` over ``uses``."""
    times = []
    clock = time.perf_counter
    for x in uses:
        t0 = clock()
        use(x)
        times.append(clock() - t0)
    times.sort()
    return sum(times) / len(times), times[int(len(times) * 0.999)], times[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=1_000_000)
    ap.add_argument("--frozen", action="store_true", help="gc.freeze() the built index")
    args = ap.parse_args()
    n = args.pages
    records = [
        SimpleNamespace(
            skey=i.to_bytes(16, "little") + b"\0",
            component=ComponentType.FULL,
            page_hash=i.to_bytes(16, "little"),
            parent_hash=ROOT,
            nbytes=4096,
        )
        for i in range(n)
    ]
    index = PageIndex()
    gc.disable()  # as a start does (controller/store/page_store.py)
    t0 = time.perf_counter()
    index.restore_disk(records)
    build_s = time.perf_counter() - t0
    gc.enable()
    entries = list(index)
    del records
    if args.frozen:
        gc.collect()
        gc.freeze()
    rng = random.Random(0)
    uses = [rng.randrange(n) for _ in range(2 * n)]
    ours = _timed(uses, lambda i: index.touch(entries[i]))
    lru = OrderedDict((e.skey, e) for e in entries)
    keys = [e.skey for e in entries]
    base = _timed(uses, lambda i: lru.move_to_end(keys[i]))
    index.check_invariants()
    print(f"index of {n} disk pages built in {build_s:.2f} s; {len(uses)} uses of random pages")
    print(f"{'':22} {'mean µs':>9} {'p99.9 µs':>9} {'worst ms':>9}")
    for name, (mean, p999, worst) in (("page index touch", ours), ("OrderedDict LRU", base)):
        print(f"{name:22} {mean * 1e6:9.2f} {p999 * 1e6:9.1f} {worst * 1e3:9.1f}")
    print(f"worst use, index / LRU: {ours[2] / base[2]:.0f}x; mean: {ours[0] / base[0]:.1f}x")


if __name__ == "__main__":
    main()
