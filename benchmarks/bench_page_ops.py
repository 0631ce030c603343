"""The sidecar's bookkeeping per page: what the page store costs an engine's store, load
and lookup of N pages, in µs per page, with no copy in the figure but the backup's.

An in-process ``LocalController`` (no disk tier, a shared host pool as ``hicache serve``
builds it, one FULL-only layout, the pages of one chain per call) is called as the
sidecar's handlers call it for an engine that copies its own KV (the vLLM path):

* ``store_free``: ``begin_store`` + ``commit_store`` of N new pages, the host pool free;
* ``store_full``: the same with the host pool full, so that every new page evicts one;
* ``pin``: ``pin`` of N pages on host, ``pinned_host_pages``, ``unpin`` as copied;
* ``lookup``: ``lookup`` of a chain of N pages on host;
* ``backup``: ``backup`` of N device pages (the controller copies; tiny pages) + wait.

Each case runs ``--rounds`` rounds of ``--calls`` calls on fresh pages; the figure is the
best call's time over N. With ``--compare-ref REV`` the same cases also run on revision
REV's code in the same process (imported as ``hicache_ref``, see ``bench_tree.py``), the
two taking turns round by round, and the table adds this checkout's time as a ratio of
the revision's (below 1: faster).

    .venv/bin/python benchmarks/bench_page_ops.py [--pages 64,1024] [--rounds 7]
        [--compare-ref REV] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_tree import import_revision

PAGE = 4
OPS = ("store_free", "store_full", "pin", "lookup", "backup")


class Setup:
    """One controller of library ``lib`` and the means to make pages for it."""

    def __init__(self, lib: str, host_pages: int, device_pages: int) -> None:
        api = importlib.import_module(lib)
        self.api = api
        self.config_mod = importlib.import_module(f"{lib}.controller.config")
        local = importlib.import_module(f"{lib}.controller.store.local")
        capi = importlib.import_module(f"{lib}.controller_api")
        self.PageRef, self.PageKey = capi.PageRef, capi.PageKey
        self.FULL = api.ComponentType.FULL
        self.layout = api.ModelLayout(("full",), num_kv_heads=1, head_dim=8)
        page_bytes = self.layout.page_bytes(self.FULL, PAGE)
        cfg = self.config_mod.ControllerConfig(
            host_pool_bytes=host_pages * page_bytes, disk_path=None, host_shared=True
        )
        self.ctl = local.LocalController(cfg)
        cache_cfg = api.CacheConfig(page_size=PAGE, full_slots=(device_pages + 1) * PAGE)
        self.pools = api.DevicePools.allocate(self.layout, cache_cfg)
        self.ctl.register(self.layout, PAGE, self.pools)
        self.device_pages = [int(p) for p in self.pools.alloc_kv_pages(device_pages)]
        self._next = 0

    def chain(self, n: int) -> list:
        """The refs of a new chain of ``n`` pages (device pages reused round robin)."""
        refs = []
        parent = b"\0" * 8 + self._next.to_bytes(8, "little")
        for i in range(n):
            self._next += 1
            h = self._next.to_bytes(8, "little") + b"\x5a" * 8
            dev = self.device_pages[i % len(self.device_pages)]
            refs.append(self.PageRef(self.FULL, h, parent, dev))
            parent = h
        return refs

    def store(self, refs: list) -> None:
        store_id, pages = self.ctl.begin_store(refs)
        assert min(pages) >= 0, "a page found no host page"
        assert self.ctl.commit_store(store_id, True) == len(refs)

    def close(self) -> None:
        self.ctl.check_invariants()
        self.ctl.close()


def case(lib: str, op: str, n: int, calls: int, rounds: int) -> Callable[[], list[float]]:
    """A round of ``op`` on ``n`` pages: ``calls`` timed calls, seconds each, on one
    controller kept across the ``rounds`` rounds (its host pool holds every page stored on
    a free pool, and two calls' pages otherwise)."""
    if op in ("store_free", "store_full"):
        free = op == "store_free"
        s = Setup(lib, host_pages=(rounds * calls + 1) * n if free else 2 * n, device_pages=1)
        for _ in range(1 if free else 2):  # a full pool: each page stored next evicts one
            s.store(s.chain(n))

        def run() -> list[float]:
            out = []
            for _ in range(calls):
                refs = s.chain(n)
                t0 = time.perf_counter()
                s.store(refs)
                out.append(time.perf_counter() - t0)
            s.ctl.check_invariants()
            return out

        return run
    s = Setup(lib, host_pages=2 * n, device_pages=n if op == "backup" else 1)
    if op in ("pin", "lookup"):
        refs = s.chain(n)
        s.store(refs)
        keys = [r.key for r in refs]
        hashes = [r.page_hash for r in refs]
        ctl, store = s.ctl, s.ctl.store

        def run() -> list[float]:
            out = []
            for _ in range(calls):
                t0 = time.perf_counter()
                if op == "pin":
                    receipt = ctl.pin(keys, 30.0)
                    pages = store.pinned_host_pages(receipt.pin_id, keys)
                    ctl.unpin(receipt, loaded_s=1e-3)
                else:
                    pages = ctl.lookup(hashes, [s.FULL]).presence[s.FULL]
                out.append(time.perf_counter() - t0)
                assert len(pages) == n and min(pages) >= 0
            return out

        return run
    assert op == "backup"

    def run() -> list[float]:
        out = []
        for _ in range(calls):
            refs = s.chain(n)
            t0 = time.perf_counter()
            ok = s.ctl.backup(refs).wait(10.0)
            out.append(time.perf_counter() - t0)
            assert ok, "a backup failed"
        s.ctl.check_invariants()
        return out

    return run


def measure(libs: list[str], pages: list[int], rounds: int, calls: int) -> dict:
    """Per lib, op and N: the best µs per page over every call of every round."""
    best: dict[str, dict[str, dict[int, float]]] = {lib: {} for lib in libs}
    for op in OPS:
        for n in pages:
            k = max(2, calls * 64 // n)
            runs = {lib: case(lib, op, n, k, rounds) for lib in libs}
            for _ in range(rounds):
                for lib in libs:
                    gc.collect()
                    seconds = min(runs[lib]())
                    us = seconds / n * 1e6
                    row = best[lib].setdefault(op, {})
                    row[n] = min(us, row.get(n, float("inf")))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", default="64,1024", help="pages per call, comma-separated")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per case and side")
    parser.add_argument("--calls", type=int, default=8, help="calls per round at 64 pages")
    parser.add_argument("--compare-ref", metavar="REV", help="a git revision to compare with")
    parser.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    args = parser.parse_args()
    pages = [int(p) for p in args.pages.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-page-ops-ref-") as tmp:
        libs = ["hicache"]
        if args.compare_ref:
            import_revision(args.compare_ref, Path(tmp))
            libs = ["hicache_ref", "hicache"]
        best = measure(libs, pages, args.rounds, args.calls)
    print(
        f"# page store bookkeeping, µs per page (best call of {args.rounds} rounds), "
        f"{platform.processor() or platform.machine()}, python {platform.python_version()}"
    )
    head = f"{'operation':>11} {'pages':>6} {'this µs':>8}"
    if args.compare_ref:
        head += f" {'ref µs':>8} {'this/ref':>8}"
    print(head)
    for op in OPS:
        for n in pages:
            this = best["hicache"][op][n]
            line = f"{op:>11} {n:>6} {this:>8.2f}"
            if args.compare_ref:
                ref = best["hicache_ref"][op][n]
                line += f" {ref:>8.2f} {this / ref:>8.2f}"
            print(line)
    if args.json:
        out = {"pages": pages, "rounds": args.rounds, "us_per_page": best["hicache"]}
        if args.compare_ref:
            out["ref"] = args.compare_ref
            out["ref_us_per_page"] = best["hicache_ref"]
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
