"""How long a host pool takes to allocate and page-lock: torch's pinned allocation against
the shared pages of ``hicache serve`` (memfd, populated by several threads, then
``cudaHostRegister``) and the same without the populate, in one run.

    python3 benchmarks/bench_host_alloc.py [--gib 1,4,16]

Needs CUDA (on a CPU there is nothing to page-lock). Each allocation is freed before the
next; every figure is one allocation (the first touch of fresh memory is what is timed).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from hicache.controller.config import HostPinning
from hicache.controller.store import host_pool


def timed(make) -> float:
    t0 = time.perf_counter()
    obj = make()
    seconds = time.perf_counter() - t0
    del obj
    gc.collect()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", default="1,4,16")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "page-locking needs CUDA"
    torch.cuda.init()
    row = 1 << 20
    real_populate = host_pool.populate
    print("GiB  torch pinned s  shared s  shared, no populate s  shared / torch")
    for gib in (int(g) for g in args.gib.split(",")):
        pages = gib << 10

        def torch_pinned(n=pages):
            return torch.empty((n, row), dtype=torch.uint8, pin_memory=True)

        def shared(n=pages):
            return host_pool.SharedPages("bench", n, row, HostPinning.PINNED)

        t_torch = timed(torch_pinned)
        t_shared = timed(shared)
        host_pool.populate = lambda address, nbytes: None
        try:
            t_plain = timed(shared)
        finally:
            host_pool.populate = real_populate
        ratio = t_shared / t_torch
        print(f"{gib:>3}  {t_torch:14.2f}  {t_shared:8.2f}  {t_plain:21.2f}  {ratio:14.2f}")


if __name__ == "__main__":
    main()
