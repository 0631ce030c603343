"""CPU page copies between an engine's memory and the host pool, against a plain memcpy.

Same run, same bytes, best of ``--repeats``:

* ``memcpy``: one ``Tensor.copy_`` of that many contiguous bytes (the baseline);
* ``reference``: the torch reference (gather, permute, scatter) — the CPU path before
  ``Backend.CPU``;
* ``cpu rows``: ``hicache.kernels`` on CPU tensors by default (a KV page or a Mamba
  state is one strided copy per item, split by items across threads; items whose
  sources are consecutive, one numpy assignment per run: the ``in a row`` rows);
* ``memmove per row``: the CPU path before that, one memmove per row (a page of one
  layer's K or V), split across threads by bytes;
* ``controller``: ``LocalController.load`` / ``backup`` through the host pool, the whole
  path a sidecar runs for an engine on a CPU;
* ``blocks``: vLLM-shaped block copies (:class:`hicache.kernels.SegmentCopy`, what an
  engine that copies its own blocks runs: 16 per-layer tensors of 64 KiB block rows, a
  1 MiB page per block), both ways, with the blocks and the host pages each consecutive or
  shuffled; the default path (one numpy assignment per segment and run of consecutive
  sources, else a ``memmove`` per segment and block) beside ``(memmoves)``, a ``memmove``
  per segment and block for every item, on the same threads.

KV pages of the load-back benchmark's layout (8 layers, 8 KV heads, head_dim 128,
bfloat16, 16 tokens a page: 512 KiB pages) into random host pages, both ways; and the
same for Mamba states.

Usage: ``python benchmarks/bench_cpu_copy.py [--total-mib 256] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from hicache import CacheConfig, ComponentType, DevicePools, ModelLayout
from hicache.controller.config import MIB, ControllerConfig
from hicache.controller.store.local import LocalController
from hicache.controller_api import PageRef
from hicache.kernels import (
    kv_pages_to_device,
    kv_pages_to_host,
    mamba_states_to_device,
    mamba_states_to_host,
    reference,
)
from hicache.kernels.cpu_rows import move_runs, row_runs
from hicache.kernels.geometry import kv_row_copy
from hicache.kernels.segments import Segment, SegmentCopy
from hicache.keys import namespace_hash, page_hashes

PAGE_SIZE = 16


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class Memcpy:
    """The baseline: one ``Tensor.copy_`` of ``nbytes`` contiguous bytes."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.ones(nbytes, dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)

    def __call__(self) -> None:
        self.dst.copy_(self.src)


def against_memcpy(fn: Callable[[], object], nbytes: int, repeats: int) -> tuple[float, float]:
    """Best seconds of ``fn`` and of a memcpy of ``nbytes``, timed alternately, so that
    both see the same machine (a shared box's load changes by the second)."""
    memcpy = Memcpy(nbytes)
    best, best_base = float("inf"), float("inf")
    for _ in range(repeats):
        best_base = min(best_base, best_seconds(memcpy, 1))
        best = min(best, best_seconds(fn, 1))
    return best, best_base


Transfer = tuple[str, Callable[[], object], int]  # what, run it once, bytes moved


def kv_transfers(total: int) -> list[Transfer]:
    """KV pages both ways, the reference and the default CPU path."""
    layers, heads, dim = 8, 8, 128
    page_bytes = 2 * layers * PAGE_SIZE * heads * dim * 2
    n = max(8, total // page_bytes)
    device_kv = torch.randn(2, layers, 2 * n * PAGE_SIZE, heads, dim).to(torch.bfloat16)
    # Host pages are frames with room in front, as the host pool lays them out.
    host = torch.zeros(2 * n, 128 + page_bytes, dtype=torch.uint8)
    host_kv = host[:, 128:].view(torch.bfloat16).view(2 * n, 2, layers, PAGE_SIZE, heads, dim)
    rng = np.random.default_rng(0)
    dev = torch.from_numpy(rng.permutation(2 * n)[:n])
    hp = torch.from_numpy(rng.permutation(2 * n)[:n])
    in_a_row = torch.from_numpy(rng.permutation(n) + n // 2)  # consecutive, in any order
    nbytes = n * page_bytes
    ps = PAGE_SIZE
    return [
        (
            "KV to host, reference",
            lambda: reference.kv_pages_to_host_ref(device_kv, host_kv, dev, hp, ps),
            nbytes,
        ),
        ("KV to host, cpu rows", lambda: kv_pages_to_host(device_kv, host_kv, dev, hp, ps), nbytes),
        (
            "KV to host, memmove per row",
            memmove_per_row(device_kv, host_kv, dev, hp, ps, to_host=True),
            nbytes,
        ),
        (
            "KV to device, reference",
            lambda: reference.kv_pages_to_device_ref(host_kv, device_kv, hp, dev, ps),
            nbytes,
        ),
        (
            "KV to device, cpu rows",
            lambda: kv_pages_to_device(host_kv, device_kv, hp, dev, ps),
            nbytes,
        ),
        (
            "KV to device, memmove per row",
            memmove_per_row(device_kv, host_kv, dev, hp, ps, to_host=False),
            nbytes,
        ),
        # Consecutive sources (device pages of a store, host pages of a load): runs.
        (
            "KV to host, cpu rows, device pages in a row",
            lambda: kv_pages_to_host(device_kv, host_kv, in_a_row, hp, ps),
            nbytes,
        ),
        (
            "KV to device, cpu rows, host pages in a row",
            lambda: kv_pages_to_device(host_kv, device_kv, in_a_row, dev, ps),
            nbytes,
        ),
    ]


def block_transfers(total: int) -> list[Transfer]:
    """vLLM-shaped block copies both ways, for each layout of blocks and pages."""
    layers, row = 16, 64 << 10
    n = max(8, total // (layers * row))
    tensors = [torch.randint(0, 256, (2 * n, row), dtype=torch.uint8) for _ in range(layers)]
    host = torch.zeros(2 * n, 128 + layers * row, dtype=torch.uint8)
    copy = SegmentCopy([Segment(t, 0, row, i * row) for i, t in enumerate(tensors)], host, 128)
    copy.start([0], [0], True)  # the CPU form's views, made once
    # The path before runs by source: a memmove per segment and block, on threads alike.
    memmoves = SegmentCopy(copy.segments, host, 128)
    memmoves.start([0], [0], True)
    memmoves._cpu.min_run = 2 * n + 1
    rng = np.random.default_rng(1)
    consecutive, shuffled = np.arange(n) + n // 2, rng.permutation(2 * n)[:n]
    shuffled_too = rng.permutation(2 * n)[:n]
    out: list[Transfer] = []
    for label, blocks, pages in (
        ("both consecutive", consecutive, consecutive),
        ("pages shuffled", consecutive, shuffled),
        ("blocks shuffled", shuffled, consecutive),
        ("both shuffled", shuffled, shuffled_too),
    ):
        for to_host, way in ((True, "to host"), (False, "to device")):
            for how, c in (("", copy), (" (memmoves)", memmoves)):
                out.append(
                    (
                        f"blocks {way}, {label}{how}",
                        lambda b=blocks, p=pages, t=to_host, c=c: c.start(b, p, t),
                        n * layers * row,
                    )
                )
    return out


def memmove_per_row(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    dev: torch.Tensor,
    hp: torch.Tensor,
    page_size: int,
    to_host: bool,
) -> Callable[[], object]:
    """The CPU path before strided item copies: one ``memmove`` per row (a page of one
    layer's K or V), rows merged where contiguous on both sides, split across threads."""
    copy = kv_row_copy(device_kv, host_kv, dev, hp, page_size, to_host)
    src, dst = (dev, hp) if to_host else (hp, dev)
    return lambda: move_runs(*row_runs(copy, src.numpy(), dst.numpy()))


def mamba_transfers(total: int) -> list[Transfer]:
    """Mamba states (conv and SSM of 8 layers, 1 MiB a state) both ways."""
    layers, conv_shape, ssm_shape = 8, (2048, 3), (32, 64, 16)
    conv_b = int(np.prod(conv_shape)) * 4 * layers
    ssm_b = int(np.prod(ssm_shape)) * 4 * layers
    n = max(8, total // (conv_b + ssm_b))
    conv = torch.randn(layers, 2 * n, *conv_shape)
    ssm = torch.randn(layers, 2 * n, *ssm_shape)
    host = torch.zeros(2 * n, conv_b + ssm_b + 128, dtype=torch.uint8)
    hc = host[:, :conv_b].view(torch.float32).view(2 * n, layers, *conv_shape)
    hs = host[:, conv_b : conv_b + ssm_b].view(torch.float32).view(2 * n, layers, *ssm_shape)
    rng = np.random.default_rng(1)
    slots = torch.from_numpy(rng.permutation(2 * n)[:n])
    hp = torch.from_numpy(rng.permutation(2 * n)[:n])
    nbytes = n * (conv_b + ssm_b)
    return [
        (
            "Mamba to host, reference",
            lambda: reference.mamba_states_to_host_ref(conv, ssm, hc, hs, slots, hp),
            nbytes,
        ),
        (
            "Mamba to host, cpu rows",
            lambda: mamba_states_to_host(conv, ssm, hc, hs, slots, hp),
            nbytes,
        ),
        (
            "Mamba to device, reference",
            lambda: reference.mamba_states_to_device_ref(hc, hs, conv, ssm, hp, slots),
            nbytes,
        ),
        (
            "Mamba to device, cpu rows",
            lambda: mamba_states_to_device(hc, hs, conv, ssm, hp, slots),
            nbytes,
        ),
    ]


class ControllerTransfers:
    """Backup and load-back through ``LocalController`` and its host pool."""

    def __init__(self, total: int, repeats: int) -> None:
        layout = ModelLayout(("full",) * 8, num_kv_heads=8, head_dim=128, dtype="bfloat16")
        self.page_bytes = layout.page_bytes(ComponentType.FULL, PAGE_SIZE)
        self.n = n = max(8, total // self.page_bytes)
        self.pools = DevicePools.allocate(
            layout, CacheConfig(page_size=PAGE_SIZE, full_slots=2 * n * PAGE_SIZE)
        )
        self.pools.full.buffer.copy_(torch.randn(self.pools.full.buffer.shape))
        self.fp = layout.fingerprint(PAGE_SIZE)
        host_bytes = (repeats + 2) * n * self.page_bytes
        self.ctl = LocalController(ControllerConfig(host_pool_bytes=host_bytes))
        self.ctl.register(layout, PAGE_SIZE, self.pools)
        self.ctl.store.host_view(ComponentType.FULL).zero_()
        self.src = self.pools.alloc_kv_pages(n)
        self.dst = self.pools.alloc_kv_pages(n)
        self.round = 0
        self.refs: list[PageRef] = []

    def backup(self) -> None:
        """Back up the source pages under new hashes (a held page is only touched)."""
        n, ps = self.n, PAGE_SIZE
        hashes = page_hashes(range(self.round * n * ps, (self.round + 1) * n * ps), self.fp, ps)
        self.round += 1
        parents = [namespace_hash(self.fp, None), *hashes[:-1]]
        self.refs = [
            PageRef(ComponentType.FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, self.src)
        ]
        assert self.ctl.backup(self.refs).wait(60)

    def load(self) -> None:
        refs = [
            PageRef(ComponentType.FULL, r.page_hash, r.parent_hash, int(d))
            for r, d in zip(self.refs, self.dst)
        ]
        pin = self.ctl.pin([r.key for r in refs], 60)
        assert self.ctl.load(refs, pin, 60)
        self.ctl.unpin(pin)

    def transfers(self) -> list[Transfer]:
        nbytes = self.n * self.page_bytes
        return [
            ("controller backup", self.backup, nbytes),
            ("controller load-back", self.load, nbytes),
        ]

    def close(self) -> None:
        self.ctl.close()
        self.pools.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--total-mib", type=int, default=256, help="bytes per transfer (MiB)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    total = args.total_mib * MIB
    controller = ControllerTransfers(total, args.repeats)
    print(
        f"CPU copies, {args.total_mib} MiB per transfer, best of {args.repeats} (each "
        f"alternated with a memcpy of the same bytes), torch threads {torch.get_num_threads()}"
    )
    print(f"{'transfer':<44} {'GB/s':>7} {'memcpy':>7} {'ratio':>6}")
    try:
        for name, fn, nbytes in (
            kv_transfers(total)
            + mamba_transfers(total)
            + block_transfers(total)
            + controller.transfers()
        ):
            seconds, base = against_memcpy(fn, nbytes, args.repeats)
            print(
                f"{name:<44} {nbytes / seconds / 1e9:>7.2f} {nbytes / base / 1e9:>7.2f} "
                f"{base / seconds:>6.2f}"
            )
    finally:
        controller.close()


if __name__ == "__main__":
    main()
