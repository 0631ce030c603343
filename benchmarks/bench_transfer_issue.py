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

``--steps``: each step of a prepared 8-page KV backup timed alone (GPU only).

Usage: ``python benchmarks/bench_transfer_issue.py [--calls 2000] [--pages 1,8,64]
[--steps]``
"""

from __future__ import annotations

import argparse
import time

import torch

import hicache.kernels as kernels
from hicache import CacheConfig, ComponentType, DevicePools, ModelLayout
from hicache.controller.config import ControllerConfig
from hicache.controller.store.host_pool import HostPool
from hicache.controller.store.transfer_engine import EngineBuffers, TransferEngine

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


def steps(buffers, host, calls: int) -> None:
    """Each step of one prepared 8-page FULL backup, timed alone over ``calls`` calls."""
    engine = TransferEngine(host)
    dev, hp = list(range(3, 11)), list(range(5, 13))
    engine.to_host(FULL, buffers, dev, hp)
    plan = engine._plan(FULL, buffers, to_host=True)
    idx = plan._indices(dev, hp)
    on_gpu = torch.from_numpy(idx).to("cuda").unbind(0)
    launcher = plan._launchers[0]
    _, backup = engine._streams_for(buffers.device)
    current = torch.cuda.current_stream()
    ready = torch.cuda.Event()
    ready.record(current)

    def enter_stream():
        with torch.cuda.stream(backup):
            pass

    from hicache.kernels.copy_engine import RawEvents

    raw = RawEvents(1)
    cur_handle, backup_handle = current.cuda_stream, backup.cuda_stream

    def raw_wait():
        raw.record(0, cur_handle)
        raw.wait(backup_handle, 0)

    def event():
        done = torch.cuda.Event()
        done.record(backup)

    table = {
        "whole to_host": lambda: engine.to_host(FULL, buffers, dev, hp),
        "to_host with a ready event": lambda: engine.to_host(FULL, buffers, dev, hp, ready),
        "plan lookup": lambda: engine._plan(FULL, buffers, to_host=True),
        "index checks (numpy)": lambda: plan._indices(dev, hp),
        "indices to the GPU": lambda: torch.from_numpy(idx).to("cuda", non_blocking=True).unbind(0),
        "backend choice": lambda: plan._choose(plan.copies[0], idx),
        "Triton launch": lambda: launcher.launch(*on_gpu),
        "enter + leave the stream": enter_stream,
        "wait on the engine's stream": lambda: backup.wait_stream(current),
        "wait on a ready event": lambda: backup.wait_event(ready),
        "the same wait through raw runtime events": raw_wait,
        "event create + record": event,
    }
    print("| step of an 8-page prepared backup | µs per call |")
    print("|---|---|")
    for name, fn in table.items():
        print(f"| {name} | {per_call_us(fn, calls, 'cuda'):.1f} |")
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--pages", default="1,8,64")
    parser.add_argument("--rounds", type=int, default=3, help="alternate the two this often")
    parser.add_argument("--steps", action="store_true", help="time each step (GPU only)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    buffers, host = setup(device)
    if args.steps:
        if device != "cuda":
            parser.error("--steps needs a CUDA GPU")
        steps(buffers, host, args.calls)
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
