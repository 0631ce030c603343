"""Host time of one controller copy: prepared transfers against per-call checked ones.

A controller backs up and loads a few pages at a time, so the host time of issuing a copy
matters as much as its bandwidth. This times :class:`TransferEngine` (which prepares each
engine's transfers once: shapes checked and launchers built on the first copy, indices
checked and moved in one piece after) against the same engine driving the checked
functions of ``hicache.kernels`` on every call (the way it copied before: every call
checks both tensors' shapes, builds the row geometry and a launcher, and moves each index
list on its own), in the same run, on the same buffers.

* ``backup issue``: µs of host time per ``to_host`` call, over many calls back to back
  (the copies are small, so the GPU keeps up and the loop measures the host);
* ``backup + wait``: a ``to_host`` followed by waiting for its event, per call;
* ``load``: a ``to_device`` (it waits for its copy), per call.

Layout: 32 full-attention layers of 8 KV heads × 128 (bf16), page 1, and a hybrid
layout's Mamba states. Runs on CPU too (there both sides run the torch reference).

Usage: ``python benchmarks/bench_transfer_issue.py [--calls 2000] [--pages 1,8,64]``
"""

from __future__ import annotations

import argparse
import time

import torch

import hicache.kernels as kernels
from hicache import CacheConfig, ComponentType, DevicePools, ModelLayout
from hicache.controller.config import ControllerConfig
from hicache.controller.host_pool import HostPool
from hicache.controller.transfer import EngineBuffers, TransferEngine

FULL, MAMBA = ComponentType.FULL, ComponentType.MAMBA


class CheckedEveryCall(TransferEngine):
    """The baseline: the checked functions of ``hicache.kernels`` on every copy."""

    def _plan(self, component, buffers, to_host):
        host = self.host_pool
        ps = buffers.page_size

        def idx(values):
            return torch.as_tensor(values, dtype=torch.int64)

        if component is MAMBA:
            conv, ssm, hc, hs = buffers.mamba_conv, buffers.mamba_ssm, host.conv(), host.ssm()
            if to_host:
                return lambda d, h: kernels.mamba_states_to_host(conv, ssm, hc, hs, idx(d), idx(h))
            return lambda d, h: kernels.mamba_states_to_device(hc, hs, conv, ssm, idx(h), idx(d))
        dev, hkv = buffers.full_kv, host.kv(component)
        if to_host:
            return lambda d, h: kernels.kv_pages_to_host(dev, hkv, idx(d), idx(h), ps)
        return lambda d, h: kernels.kv_pages_to_device(hkv, dev, idx(h), idx(d), ps)


def setup(device: str):
    layout = ModelLayout(
        ("full",) * 32 + ("mamba",) * 4,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        conv_dim=256,
        conv_kernel=4,
        ssm_state_shape=(8, 16, 16),
    )
    cfg = CacheConfig(page_size=1, full_slots=4096, mamba_slots=256, device=device)
    pools = DevicePools.allocate(layout, cfg)
    host = HostPool(layout, 1, ControllerConfig(host_pool_bytes=2 << 30))
    return EngineBuffers.from_pools(pools), host


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, calls: int, device: str) -> float:
    for _ in range(20):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / calls * 1e6


def measure(engine: TransferEngine, buffers, comp, n: int, calls: int, device: str) -> dict:
    dev = list(range(3, 3 + n))
    host = list(range(5, 5 + n))

    def backup_wait():
        ev = engine.to_host(comp, buffers, dev, host)
        if ev is not None:
            ev.synchronize()

    return {
        "backup issue": per_call_us(
            lambda: engine.to_host(comp, buffers, dev, host), calls, device
        ),
        "backup + wait": per_call_us(backup_wait, calls // 2, device),
        "load": per_call_us(lambda: engine.to_device(comp, buffers, host, dev), calls // 2, device),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--pages", default="1,8,64")
    parser.add_argument("--rounds", type=int, default=3, help="alternate the two this often")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    buffers, host = setup(device)
    prepared, checked = TransferEngine(host), CheckedEveryCall(host)
    print(f"device {device}, {args.calls} calls per figure, best of {args.rounds} rounds (µs)")
    print()
    print("| copy | pages | what | checked every call | prepared | prepared / checked |")
    print("|---|---|---|---|---|---|")
    for comp in (FULL, MAMBA):
        for n in (int(p) for p in args.pages.split(",")):
            best: dict[str, dict[str, float]] = {"checked": {}, "prepared": {}}
            for _ in range(args.rounds):  # interleaved, so a busy moment hits both
                for name, engine in (("checked", checked), ("prepared", prepared)):
                    got = measure(engine, buffers, comp, n, args.calls, device)
                    for what, us in got.items():
                        best[name][what] = min(us, best[name].get(what, float("inf")))
            for what in best["checked"]:
                a, b = best["checked"][what], best["prepared"][what]
                print(f"| {comp.name} | {n} | {what} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
