"""Time to first token of transformers models served with hicache on a GPU, and load-back
bandwidth through the sidecar against the copy alone, in one run.

Run from the repository root on a CUDA machine (hicache need not be installed; it needs
torch, transformers 5.x, numpy, pyzmq, msgpack, lmdb, xxhash, prometheus-client):

    python3 benchmarks/hf_ttft_gpu.py [--lengths 2048,8192,32768] [--json OUT.json]

1. **load-back** of 1 MiB … 1 GiB of FULL KV pages (a Llama-like layout, bf16): the
   prepared copy alone (``TransferEngine.to_device``), the in-process controller
   (``LocalController.load``), the sidecar (``SidecarController.load``, CUDA IPC) and a
   pinned ``cudaMemcpy`` of the same bytes — GB/s, and the fixed cost of one load-back.
2. **TTFT** of a 1.1 B attention-only model (Llama-like) and a 1.3 B hybrid (Bamba,
   Mamba2 + attention), random weights, bf16, SDPA: for each prompt length, a prompt of
   that many cached tokens plus a 64-token suffix, with a device hit, a host hit through a
   sidecar process (CUDA IPC), a disk hit after the sidecar restarted, and no hit; the
   pinned-memcpy time of the bytes a host hit loads, and whether the restored prefix gives
   logits bit-identical to the live cache object's. transformers' Mamba kernels fall
   back to torch here, so the hybrid's recompute is slower than in a serving engine.
3. ``--headline 10240:16,64:20`` instead of both: a Llama-3.1-8B-shaped model (random
   bf16 weights), a 10,240-token prefix on the host tier of a ``hicache serve`` plus a 16-
   and a 64-token suffix, 20 host hits each beside the same prefix's device hit: TTFT mean
   and p99, the cold prefill, a pinned memcpy of the prefix's KV, and the cache's share
   (host hit minus device hit) against that memcpy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_sidecar_check import import_hicache  # noqa: E402

SUFFIX = 64
MIB = 1 << 20
MAX_CHECKED_PREFIX = 8192
REPEAT = 5  # device and host hits per length, in turn (the median is reported)
# ``--dry-run``: tiny models and small sizes on the CPU, to check the script off a GPU.
DEVICE = "cuda"
# ``--trace-dir``: where each sidecar and this process write their request stages
# (sidecar_trace.py); rows then carry the monotonic windows their timings ran in.
TRACE_DIR: pathlib.Path | None = None
RESTART_DISK_HIT = False  # --restart-disk-hit
LAYER_COPIES: list[str] = []  # --layer-copies: layer-wise rows again, copied these ways
TIMELINE = False  # --timeline: one more layer-wise request per row, its GPU timeline summed up
TRACED_LOADS = 30  # one-page loads timed with the trace on, through each controller
SPIN_S = 0.05  # the clients' reply_spin_s, but the load-back table's "sleeping" one


def trace_path(name: str) -> pathlib.Path | None:
    return None if TRACE_DIR is None else TRACE_DIR / f"{name}.json"


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


class SidecarProc:
    """``hicache serve`` in a subprocess (via gpu_sidecar_check's sidecar role)."""

    def __init__(
        self,
        workdir: pathlib.Path,
        host_pool: str,
        disk_budget: str,
        switch_interval_s: float | None = None,
        profile_path: pathlib.Path | None = None,
        trace_path: pathlib.Path | None = None,
    ) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = self.dir / "s.sock"
        ready = self.dir / "ready.json"
        ready.unlink(missing_ok=True)
        argv = [
            "--socket", str(self.socket), "--disk-path", str(self.dir / "lmdb"),
            "--metrics-port", "0", "--host-pool-bytes", host_pool,
            "--disk-budget-bytes", disk_budget, "--ready-file", str(ready),
            "--set", "prewarm_bytes=0",  # a disk hit after a restart reads disk, not host
        ]  # fmt: skip
        if DEVICE == "cpu":  # --dry-run: tiny models; a GPU run's pool need not fit here
            from hicache.controller.settings import parse_size

            pool = min(parse_size(host_pool, "host_pool_bytes"), 2 << 30)
            argv[argv.index(host_pool)] = str(pool)
            argv += ["--set", "host_populate=false"]
        # The sidecar role, optionally with the interpreter's thread switch interval set
        # first (how long a thread that wants the GIL may wait for it).
        run = f"role_sidecar({argv!r})"
        if profile_path is not None:
            # Requests run on the server's worker threads, which a profiler of the main
            # thread never sees: profile each job on its thread, write when it stops.
            run = f"__import__('hf_ttft_gpu').profiled_sidecar({argv!r}, {str(profile_path)!r})"
        if trace_path is not None:  # timestamps of each request's stages (sidecar_trace.py)
            run = (
                "__import__('gpu_sidecar_check').import_hicache() or __import__("
                f"'sidecar_trace').install_server({str(trace_path)!r}) or {run}"
            )
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
            + ("" if switch_interval_s is None else f"sys.setswitchinterval({switch_interval_s}); ")
            + f"from gpu_sidecar_check import role_sidecar; sys.exit({run})"
        )
        cmd = [sys.executable, "-c", code]
        self.log = open(self.dir / "sidecar.log", "a")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log)
        end = time.monotonic() + 300
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError((self.dir / "sidecar.log").read_text()[-4000:])
            time.sleep(0.1)

    @property
    def endpoint(self) -> str:
        return "ipc://" + str(self.socket)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


class TimedController:
    """A controller whose calls are timed (seconds summed per verb since :meth:`reset`)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.seconds: dict[str, float] = {}

    def reset(self) -> None:
        self.seconds = {}

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if name not in ("lookup", "pin", "load", "unpin", "prefetch") or not callable(attr):
            return attr

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

        return timed


def client(endpoint: str, name: str, reply_spin_s: float = SPIN_S, **options):
    """A sidecar client with long timeouts that spins for its replies (``reply_spin_s``:
    every call of the engine here blocks its only thread); ``options``: other
    SidecarClientConfig fields."""
    from hicache.controller.client.sidecar_client import SidecarClientConfig, SidecarController

    options["reply_spin_s"] = reply_spin_s
    cfg = SidecarClientConfig(
        request_timeout_s=600.0, lookup_timeout_s=60.0, connect_timeout_s=60.0, **options
    )
    return SidecarController(endpoint, name, cfg)


def cuda_ms(fn, repeat: int = 5) -> float:
    """Median wall ms of ``fn`` with the device synchronized around each call."""

    fn()
    sync()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def pinned_memcpy_ms(nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    return cuda_ms(lambda: dst.copy_(src, non_blocking=True))


# -- 1. load-back bandwidth ---------------------------------------------------------------


def loadback_table(
    work: pathlib.Path,
    sizes_mib: list[int],
    switch_interval_s: float | None = None,
    profile_dir: pathlib.Path | None = None,
) -> list[dict[str, Any]]:
    """One row per size; the last row holds the fixed costs and the RPC floor."""
    import numpy as np
    import torch

    from hicache import CacheConfig, DevicePools, ModelLayout
    from hicache.controller.config import ControllerConfig
    from hicache.controller.store.host_pool import HostPool
    from hicache.controller.store.local import LocalController
    from hicache.controller.store.transfer_engine import EngineBuffers, TransferEngine
    from hicache.controller_api import PageRef
    from hicache.keys import namespace_hash, page_hashes
    from hicache.types import ComponentType

    page = 64
    layout = ModelLayout(
        ("full",) * 22, num_kv_heads=4, head_dim=64, dtype="bfloat16", model_id="loadback"
    )
    page_bytes = layout.page_bytes(ComponentType.FULL, page)
    max_pages = max(sizes_mib) * MIB // page_bytes + 1
    cfg = CacheConfig(
        page_size=page, full_slots=2 * max_pages * page, device=DEVICE, shared_memory=True
    )
    pools = DevicePools.allocate(layout, cfg)
    pools.full.buffer.copy_(torch.randn(pools.full.buffer.shape, device=DEVICE).bfloat16())
    fp = layout.fingerprint(page)
    host_bytes = f"{max_pages * page_bytes // MIB + 64}MiB"
    label = "default" if switch_interval_s is None else f"switch_{switch_interval_s * 1e6:.0f}us"
    previous = sys.getswitchinterval()
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)
    side_profile = None if profile_dir is None else profile_dir / f"sidecar-{label}.prof"
    side = SidecarProc(
        work / f"loadback-{label}",
        host_bytes,
        "64MiB",
        switch_interval_s,
        side_profile,
        trace_path(f"sidecar-loadback-{label}"),
    )
    local = LocalController(
        ControllerConfig(host_pool_bytes=max_pages * page_bytes + (64 << 20), disk_path=None)
    )
    profiler = None
    if profile_dir is not None:  # the engine side of the sidecar's loads
        import cProfile

        profiler = cProfile.Profile()
    # The default client: it copies load-backs of host pages itself from the sidecar's
    # shared host pages (controller/client/host_share.py).
    remote = client(side.endpoint, "loadback")
    # The same sidecar copying them itself (engine_copies=False), the client spinning for
    # the reply, and one that sleeps while it waits (reply_spin_s = 0).
    copier = client(side.endpoint, "loadback-sidecar-copies", engine_copies=False)
    sleeper = client(side.endpoint, "loadback-sleeping", reply_spin_s=0.0, engine_copies=False)
    controllers = (
        ("in_process", local),
        ("sidecar", remote),
        ("sidecar_copies", copier),
        ("sidecar_sleeping", sleeper),
    )
    rows = []
    try:
        local.register(layout, page, pools)
        for ctl in (remote, copier, sleeper):
            ctl.register(layout, page, pools)
        assert remote._share is not None, "the default client maps the shared host pages"
        share_open = {"host_pool_bytes": remote._share.pool.resident_bytes,
                      "map_and_register_s": round(remote._share.open_s, 3)}  # fmt: skip
        print(json.dumps({"pass": label, "host_share_open": share_open}), flush=True)
        src = pools.alloc_kv_pages(max_pages)
        dst = pools.alloc_kv_pages(max_pages)
        hashes = page_hashes(np.arange(max_pages * page), fp, page)
        parents = [namespace_hash(fp, None), *hashes[:-1]]
        refs = [PageRef(ComponentType.FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, src)]
        for ctl in (local, remote):
            assert ctl.backup(refs).wait(600), "backup failed"
        local.flush(600)
        # the copy alone: the prepared kernel between the same pools and a host pool of its own
        engine = TransferEngine(
            HostPool(layout, page, ControllerConfig(host_pool_bytes=max_pages * page_bytes))
        )
        buffers = EngineBuffers.from_pools(pools)
        engine.to_host(ComponentType.FULL, buffers, src.tolist(), list(range(max_pages)))
        sync()
        for mib in sizes_mib:
            n = max(1, mib * MIB // page_bytes)
            dst_list = dst[:n].tolist()
            nbytes = n * page_bytes
            loads = [
                PageRef(ComponentType.FULL, r.page_hash, r.parent_hash, int(d))
                for r, d in zip(refs[:n], dst[:n])
            ]
            keys = [r.key for r in loads]
            kernel = cuda_ms(
                lambda k=n, dd=dst_list: engine.to_device(
                    ComponentType.FULL, buffers, list(range(k)), dd
                )
            )
            times = {"kernel": kernel}
            cold = {}
            windows = {}
            for name, ctl in controllers:
                pin = ctl.pin(keys, 600)
                t0 = time.perf_counter()
                ctl.load(loads, pin, 600)  # the first load of these pages: what a hit pays
                sync()
                cold[name] = (time.perf_counter() - t0) * 1e3
                if name == "sidecar" and profiler is not None:
                    profiler.enable()
                w0 = time.monotonic()
                times[name] = cuda_ms(lambda c=ctl, p=pin, lo=loads: c.load(lo, p, 600))
                windows[name] = [w0, time.monotonic()]
                if name == "sidecar" and profiler is not None:
                    profiler.disable()
                ctl.unpin(pin)
            times["pinned_memcpy"] = pinned_memcpy_ms(nbytes)
            row = {"pass": label, "MiB": round(nbytes / MIB, 2), "pages": n}
            for k, ms in times.items():
                row[f"{k}_ms"] = round(ms, 3)
                row[f"{k}_GBps"] = round(nbytes / ms / 1e6, 2)
            for k, ms in cold.items():
                row[f"{k}_first_ms"] = round(ms, 3)
            row["sidecar_vs_in_process"] = round(times["in_process"] / times["sidecar"], 3)
            row["sidecar_copies_vs_in_process"] = round(
                times["in_process"] / times["sidecar_copies"], 3
            )
            row["sleeping_vs_in_process"] = round(
                times["in_process"] / times["sidecar_sleeping"], 3
            )
            row["in_process_vs_kernel"] = round(times["kernel"] / times["in_process"], 3)
            if TRACE_DIR is not None:
                row["windows"] = windows
            rows.append(row)
            print(json.dumps(row), flush=True)
        equal = torch.equal(
            pools.full.buffer[:, :, _slots(pools, src[:n])].view(torch.int16),
            pools.full.buffer[:, :, _slots(pools, dst[:n])].view(torch.int16),
        )
        one = [refs[0].page_hash]
        floor = cuda_ms(lambda: remote.lookup(one, [ComponentType.FULL]), repeat=20)
        fixed = {"pass": label, "loadback_bytes_equal": equal, "sidecar_rpc_floor_us": floor * 1e3}
        fixed["host_share_open"] = share_open
        if TRACE_DIR is not None:  # many one-page loads, each stage timed on both sides
            fixed["windows"] = {}
            for name, ctl in controllers:
                pin = ctl.pin(keys[:1], 600)
                w0 = time.monotonic()
                ms = cuda_ms(lambda c=ctl, p=pin: c.load(loads[:1], p, 600), TRACED_LOADS)
                fixed["windows"][name] = [w0, time.monotonic()]
                fixed[f"{name}_one_page_us"] = round(ms * 1e3, 1)
                ctl.unpin(pin)
        a, b = rows[0], rows[1]
        for k in ("kernel", *(n for n, _ in controllers)) if b["MiB"] > a["MiB"] else ():
            # intercept of the line through the two smallest sizes: the cost of a load-back
            # of no bytes
            slope = (b[f"{k}_ms"] - a[f"{k}_ms"]) / (b["MiB"] - a["MiB"])
            fixed[f"{k}_fixed_us"] = round((a[f"{k}_ms"] - slope * a["MiB"]) * 1e3, 1)
        rows.append(fixed)
        print(json.dumps(fixed), flush=True)
    finally:
        sys.setswitchinterval(previous)
        for ctl in (sleeper, copier, remote):
            ctl.close()
        local.close()
        side.stop()
        pools.close()
    if profile_dir is not None:
        profiler.dump_stats(str(profile_dir / f"engine-{label}.prof"))
        for name in (f"engine-{label}.prof", f"sidecar-{label}.prof"):
            path = profile_dir / name
            if path.exists():
                print_profile(path)
    return rows


def profiled_sidecar(argv: list[str], path: str) -> int:
    """The sidecar role with every request job profiled (jobs run one at a time here)."""
    import cProfile

    from gpu_sidecar_check import role_sidecar

    import_hicache()
    from hicache.controller.sidecar.server import SidecarServer

    profiler = cProfile.Profile()
    run_job = SidecarServer._run_job

    def job(self, *args):
        profiler.enable()
        try:
            return run_job(self, *args)
        finally:
            profiler.disable()

    SidecarServer._run_job = job
    try:
        return role_sidecar(argv)
    finally:
        profiler.dump_stats(path)


def print_profile(path: pathlib.Path, top: int = 25) -> None:
    """The functions where a profiled process spent its time, by own time."""
    import io
    import pstats

    buf = io.StringIO()
    stats = pstats.Stats(str(path), stream=buf)
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    text = buf.getvalue()
    print(f"== profile {path.name} (by own time)")
    print("\n".join(ln.strip() for ln in text[text.find("ncalls") :].splitlines() if ln.strip()))


def _slots(pools, pages):
    import torch

    return torch.from_numpy(pools.full.pages_to_slots(pages)).to(DEVICE)


# -- 2. TTFT ------------------------------------------------------------------------------


def ttft_rows(work: pathlib.Path, family: str, lengths: list[int]) -> list[dict[str, Any]]:
    import torch
    import transformers

    from hicache.config import PrefetchPolicy
    from hicache.integrations.transformers import PrefixCachedLM
    from hicache.integrations.transformers_models import realistic_config, tiny_config
    from hicache.layout import LayerKind

    cfg = realistic_config(family) if DEVICE == "cuda" else tiny_config(family)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    vocab = cfg.vocab_size
    page, chunk = (64, 2048) if DEVICE == "cuda" else (16, 64)
    slots = (max(lengths) + 4 * SUFFIX + page) * 3
    side_dir = work / f"ttft-{family}"
    sidecar = SidecarProc(
        side_dir, "12GiB", "48GiB", trace_path=trace_path(f"sidecar-ttft-{family}")
    )
    made: list = []

    def engine(prefetch=None, **options):
        c = TimedController(client(sidecar.endpoint, f"{family}-{len(made)}", **options))
        extra = {} if prefetch is None else {"prefetch_policy": prefetch}
        lm = PrefixCachedLM.build(
            model, page_size=page, full_slots=slots, mamba_slots=64, controller=c,
            chunk_tokens=chunk, keep_logits=True, shared_memory=DEVICE == "cpu", **extra,
            layerwise=False,  # these rows time whole loads (--hit-fraction: both ways)
        )  # fmt: skip
        made.append((lm, c))
        return lm

    rows = []
    try:
        lm = engine()
        g = torch.Generator().manual_seed(1)

        def toks(n, gen=None):
            return torch.randint(3, vocab, (n,), generator=gen or g).tolist()

        # warm-up of every path (kernels, allocator, transfer plans), from its own stream
        gw = torch.Generator().manual_seed(99)
        warm = toks(4 * page, gw)
        lm.generate(warm + toks(SUFFIX, gw), 1, use_cache=False)
        lm.generate([*warm, 7], 1)
        lm.generate(warm + toks(SUFFIX, gw), 1)
        lm.cache.flush_backups()
        lm.cache.evict(full_tokens=10**9)
        lm.generate(warm + toks(SUFFIX, gw), 1)
        # host hits again through a client whose loads pin their own pages (pin_at_load)
        own = engine(pin_at_load=True)
        own.generate(warm + toks(SUFFIX, gw), 1)  # its first host hit: plans, allocator
        own_ctl = made[1][1]
        # The host hits of the main comparison run on an engine of their own (same model,
        # same sidecar, same client options as ``lm``), so that ``lm`` keeps the prefix on
        # its device between its device hits and the two can be timed in turn.
        hosted = engine()
        hosted.generate(warm + toks(SUFFIX, gw), 1)  # its first host hit: plans, allocator
        ctl = made[2][1]
        for length in lengths:
            prefix = toks(length)
            s = {t: toks(SUFFIX) for t in ("none", "device", "host", "disk")}
            reps = [toks(SUFFIX) for _ in range(2 * (REPEAT - 1))]
            row: dict[str, Any] = {"model": family, "params_B": round(params / 1e9, 2)}
            row["prompt"] = length + SUFFIX
            # the first recompute of a length pays first-call costs of its shapes; the
            # median of the next ones is the recompute a hit is compared with
            no_hit = [
                lm.generate(prefix + s["none"], 1, use_cache=False).ttft_s * 1e3
                for _ in range(REPEAT + 1)
            ]
            row["ttft_no_hit_first_ms"] = no_hit[0]
            row["ttft_no_hit_ms"] = statistics.median(no_hit[1:])
            lm.generate([*prefix, 7], 1)  # caches the prefix (backed up to the sidecar)
            lm.cache.flush_backups()
            sync()
            device_ms, host = [], []
            # A device hit (``lm``) and a host hit (``hosted``) in turn, so that the two
            # medians see the machine in the same state: timed one set after the other, the
            # device hit alone moved by up to 40 % between runs (docs/performance.md).
            device_suffixes = [s["device"], *reps[: REPEAT - 1]]
            host_suffixes = [s["host"], *reps[REPEAT - 1 :]]
            for i in range(REPEAT):
                # Neither timed call runs beside the other engine's backups: with the
                # benchmark's spinning clients a backup in flight takes the GIL from the
                # forward pass timed next to it.
                hosted.cache.flush_backups()
                sync()
                suffix = device_suffixes[i]
                r = lm.generate(prefix + suffix, 1)
                assert r.device_hit_tokens == length, r
                device_ms.append(r.ttft_s * 1e3)
                if i == 0:
                    row["same_as_live_device"] = _same(lm, prefix + suffix, length, r)
                suffix = host_suffixes[i]
                lm.cache.flush_backups()
                hosted.cache.flush_backups()
                hosted.cache.evict(full_tokens=10**9)
                ctl.reset()
                w0 = time.monotonic()
                r = hosted.generate(prefix + suffix, 1)
                assert r.host_hit_tokens == length, r
                host.append((r.ttft_s * 1e3, r, dict(ctl.seconds)))
                row.setdefault("host_hit_windows", []).append([w0, time.monotonic()])
                if i == 0:
                    row["same_as_live_host"] = _same(hosted, prefix + suffix, length, r)
            row["ttft_device_hit_ms"] = statistics.median(device_ms)
            lm.cache.flush_backups()
            hosted.cache.flush_backups()
            own_runs = []
            gown = torch.Generator().manual_seed(7 + length)  # suffixes no engine cached yet
            for i, suffix in enumerate([toks(SUFFIX, gown) for _ in range(REPEAT)]):
                own.cache.flush_backups()
                own.cache.evict(full_tokens=10**9)
                own_ctl.reset()
                r = own.generate(prefix + suffix, 1)
                assert r.host_hit_tokens == length, r
                own_runs.append((r.ttft_s * 1e3, dict(own_ctl.seconds)))
                if i == 0:
                    row["same_as_live_host_own_pins"] = _same(own, prefix + suffix, length, r)
            own_ms, own_rpc = sorted(own_runs, key=lambda h: h[0])[len(own_runs) // 2]
            row["ttft_host_hit_own_pins_ms"] = own_ms
            for verb, sec in own_rpc.items():
                row[f"host_own_pins_{verb}_rpc_ms"] = sec * 1e3
            ttft, r, rpc = sorted(host, key=lambda h: h[0])[len(host) // 2]  # the median
            row["ttft_host_hit_ms"] = ttft
            row["host_match_ms"] = r.match_s * 1e3
            row["load_back_host_ms"] = r.load_back_s * 1e3
            row["host_restore_ms"] = r.restore_s * 1e3
            for verb, sec in rpc.items():
                row[f"host_{verb}_rpc_ms"] = sec * 1e3
            row["ttft_device_hit_runs_ms"] = [round(x, 1) for x in device_ms]
            row["ttft_host_hit_runs_ms"] = [round(h[0], 1) for h in host]
            lay = lm.cache.layout
            per_token = lay.kv_bytes_per_token(LayerKind.FULL) + lay.kv_bytes_per_token(
                LayerKind.SWA
            )
            nbytes = length * per_token + lay.mamba_state_bytes
            row["loaded_MB"] = round(nbytes / 1e6, 1)
            row["pinned_memcpy_ms"] = pinned_memcpy_ms(nbytes)
            row["host_vs_goal"] = row["ttft_host_hit_ms"] / (
                row["pinned_memcpy_ms"] + row["ttft_device_hit_ms"]
            )
            row["host_own_pins_vs_goal"] = row["ttft_host_hit_own_pins_ms"] / (
                row["pinned_memcpy_ms"] + row["ttft_device_hit_ms"]
            )
            row["host_speedup_vs_no_hit"] = row["ttft_no_hit_ms"] / row["ttft_host_hit_ms"]
            share = made[0][1]._inner._share  # the sidecar's host pages mapped here
            row["host_share_open_s"] = None if share is None else round(share.open_s, 3)
            row["host_loads_engine_copied"] = sum(
                c._inner.counters["load_engine_copied"] for _, c in made
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
        # disk hits: restart the sidecar (host tier empty), a fresh engine, every length again
        for lm_c in made:
            lm_c[1].close()
        for lm_c in made:
            lm_c[0].cache.pools.close()
        made.clear()
        del lm, own
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        sidecar.stop()
        sidecar = SidecarProc(side_dir, "12GiB", "48GiB")
        lm = engine(PrefetchPolicy.WAIT_COMPLETE)
        g = torch.Generator().manual_seed(1)
        lm.generate(warm + toks(SUFFIX, gw), 1)  # the first disk hit: readers, plans
        prefixes = []
        for length, row in zip(lengths, rows):
            prefix = toks(length)
            prefixes.append(prefix)
            s = {t: toks(SUFFIX) for t in ("none", "device", "host", "disk")}
            [toks(SUFFIX) for _ in range(2 * (REPEAT - 1))]  # as drawn in the first pass
            r = lm.generate(prefix + s["disk"], 1)
            row["disk_hit_tokens"] = r.disk_hit_tokens
            row["ttft_disk_hit_ms"] = r.ttft_s * 1e3
            row["load_back_disk_ms"] = r.load_back_s * 1e3
            row["same_as_live_disk"] = _same(lm, prefix + s["disk"], length, r)
            print(json.dumps({"model": family, "prompt": row["prompt"],
                              "ttft_disk_hit_ms": row["ttft_disk_hit_ms"],
                              "disk_hit_tokens": r.disk_hit_tokens}), flush=True)  # fmt: skip
        if RESTART_DISK_HIT:
            sidecar = first_disk_hits_after_restart(
                lm, made[-1][1], sidecar, prefixes, rows, lambda: toks(SUFFIX)
            )
    finally:
        for lm_c in made:
            lm_c[1].close()
        sidecar.stop()
    return rows


def first_disk_hits_after_restart(lm, ctl, sidecar, prefixes, rows, suffix) -> SidecarProc:
    """``--restart-disk-hit``: for each prompt length, the sidecar is stopped and started
    again on its LMDB (the engine is not: its client reconnects by itself), the engine's
    device tier is emptied, and the next request on the prefix is the first disk hit after
    the restart, beside the warm disk hit of the same row; the engine reports its prefill
    rate, so the cost rule recomputes where the disk is slower (``restart_disk_hit_tokens``
    0). Returns the running sidecar."""
    for prefix, row in zip(prefixes, rows):
        lm.cache.flush_backups()
        lm.cache.evict(full_tokens=10**9)  # the prefix is now on disk only
        client = ctl._inner
        connected = client.counters["connected"]
        sidecar.stop()
        sidecar = SidecarProc(sidecar.dir, "12GiB", "48GiB")
        end = time.monotonic() + 120
        while client.counters["connected"] == connected or not client.available:
            if time.monotonic() > end:
                raise RuntimeError("the engine did not reconnect to the restarted sidecar")
            client.stats()  # the old session is refused: the client reconnects
            time.sleep(0.05)
        # The engine's prefill rate, from its own cold prefill: the sidecar's cost rule
        # then loads the prefix from disk only if that beats computing it again.
        client.prefill_rate = len(prefix) / (row["ttft_no_hit_ms"] / 1e3)
        prompt = prefix + suffix()
        r = lm.generate(prompt, 1)
        row["restart_disk_hit_tokens"] = r.disk_hit_tokens
        row["ttft_first_disk_hit_after_restart_ms"] = r.ttft_s * 1e3
        row["load_back_first_disk_after_restart_ms"] = r.load_back_s * 1e3
        row["first_disk_hit_over_warm"] = r.ttft_s * 1e3 / row["ttft_disk_hit_ms"]
        row["first_disk_hit_over_no_hit"] = r.ttft_s * 1e3 / row["ttft_no_hit_ms"]
        row["same_as_live_restart_disk"] = _same(lm, prompt, len(prefix), r)
        print(json.dumps({k: row[k] for k in ("model", "prompt", "ttft_disk_hit_ms",
                          "ttft_first_disk_hit_after_restart_ms", "first_disk_hit_over_warm",
                          "restart_disk_hit_tokens")}), flush=True)  # fmt: skip
    return sidecar


# -- 3. the headline: an 8 B-class host hit through the sidecar ------------------------------

#: Llama-3.1-8B's shape (random weights from the config; nothing downloaded).
LLAMA_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "max_position_embeddings": 16384,
}


def _cold_ms(lm, prefix: list[int], suffix, runs: int) -> list[float]:
    """TTFT in ms of ``runs`` prefills of ``prefix`` + ``suffix()`` with no cache, after one
    more that pays its shapes' first-call costs."""
    return [
        lm.generate(prefix + suffix(), 1, use_cache=False).ttft_s * 1e3 for _ in range(runs + 1)
    ][1:]


def _close_all(made: list, sidecar: SidecarProc) -> None:
    """Close every engine's client and pools in ``made`` ((lm, client) pairs), then the
    sidecar."""
    for lm, c in made:
        c.close()
        lm.cache.pools.close()
    sidecar.stop()


def _p99(xs: list[float]) -> float:
    import numpy as np

    return float(np.percentile(xs, 99))


def headline_rows(
    work: pathlib.Path, prefix_len: int, suffixes: list[int], requests: int
) -> list[dict[str, Any]]:
    """A Llama-3.1-8B-shaped model: a ``prefix_len``-token prefix on the host tier of a
    ``hicache serve`` plus a short suffix, ``requests`` host hits, each beside a device hit
    of the same prefix (timed in turn), a few cold prefills, and a pinned memcpy of the
    prefix's KV. The cache's share of a host hit is its TTFT minus the device hit's."""
    import torch
    import transformers

    from hicache.integrations.transformers import PrefixCachedLM
    from hicache.integrations.transformers_models import tiny_config
    from hicache.layout import LayerKind

    if DEVICE == "cuda":
        cfg = transformers.AutoConfig.for_model("llama", **LLAMA_8B)
        cfg._attn_implementation = "sdpa"
        dtype, page, chunk = torch.bfloat16, 64, 2048
    else:
        cfg, dtype, page, chunk = tiny_config("llama"), torch.float32, 16, 64
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    slots = (prefix_len + 2 * max(suffixes) + 2 * page) * 2
    sidecar = SidecarProc(work / "headline", "8GiB", "4GiB")
    made: list = []

    def engine(layerwise: bool = False):
        c = client(sidecar.endpoint, f"headline-{len(made)}")
        lm = PrefixCachedLM.build(
            model, page_size=page, full_slots=slots, mamba_slots=8, controller=c,
            chunk_tokens=chunk, keep_logits=True, shared_memory=DEVICE == "cpu",
            layerwise=layerwise,
        )  # fmt: skip
        made.append((lm, c))
        return lm

    rows = []
    try:
        live, hosted = engine(), engine()  # ``live`` keeps the prefix on its device
        layered = engine(layerwise=True)  # the same host hit, loaded while the suffix computes
        g = torch.Generator().manual_seed(3)

        def toks(n):
            return torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()

        warm = toks(4 * page)  # every path once: kernels, allocator, plans, the mapping
        live.generate(warm + toks(16), 1)
        live.cache.flush_backups()
        for lm in (hosted, layered):
            lm.generate(warm + toks(16), 1)
            lm.cache.evict(full_tokens=10**9)
            lm.generate(warm + toks(16), 1)
        lay = live.cache.layout
        nbytes = prefix_len * lay.kv_bytes_per_token(LayerKind.FULL)
        memcpy_ms = pinned_memcpy_ms(nbytes)
        for suffix_len in suffixes:
            prefix = toks(prefix_len)
            cold = _cold_ms(live, prefix, lambda n=suffix_len: toks(n), 3)
            live.generate([*prefix, 7], 1)
            live.cache.flush_backups()
            device_ms, host_ms, layered_ms, same = [], [], [], None
            stages: dict[str, list[float]] = {}
            for i in range(requests):
                for lm in (hosted, layered):
                    lm.cache.flush_backups()
                    lm.cache.evict(full_tokens=10**9)
                sync()
                r = live.generate(prefix + toks(suffix_len), 1)
                assert r.device_hit_tokens == prefix_len, r
                device_ms.append(r.ttft_s * 1e3)
                live.cache.flush_backups()
                prompt = prefix + toks(suffix_len)
                r = hosted.generate(prompt, 1)
                assert r.host_hit_tokens == prefix_len, r
                host_ms.append(r.ttft_s * 1e3)
                for stage in ("match_s", "load_back_s", "restore_s"):  # where a hit's time goes
                    stages.setdefault(stage, []).append(getattr(r, stage) * 1e3)
                if i == 0:  # the restored prefix continues as the live cache would
                    ref = hosted.reference(prompt, 1, prefix_len)
                    same = all(torch.equal(a, b) for a, b in zip(r.logits, ref))
                prompt = prefix + toks(suffix_len)
                r = layered.generate(prompt, 1)
                assert r.host_hit_tokens == prefix_len, r
                layered_ms.append(r.ttft_s * 1e3)
                if i == 0:
                    ref = layered.reference(prompt, 1, prefix_len)
                    same = same and all(torch.equal(a, b) for a, b in zip(r.logits, ref))
            mean = statistics.fmean
            row = {
                "model": "llama-3.1-8b-shape" if DEVICE == "cuda" else "llama-tiny",
                "params_B": round(params / 1e9, 2),
                "prefix": prefix_len,
                "suffix": suffix_len,
                "requests": requests,
                "kv_MB": round(nbytes / 1e6, 1),
                "pinned_memcpy_ms": memcpy_ms,
                "ttft_cold_ms": statistics.median(cold),
                "ttft_device_hit_mean_ms": mean(device_ms),
                "ttft_device_hit_p99_ms": _p99(device_ms),
                "ttft_host_hit_mean_ms": mean(host_ms),
                "ttft_host_hit_p99_ms": _p99(host_ms),
                "ttft_host_hit_median_ms": statistics.median(host_ms),
                "same_as_live_host": same,
            }
            for stage, ms in stages.items():
                row[f"host_{stage[:-2]}_mean_ms"] = mean(ms)
            row["cache_share_mean_ms"] = mean(host_ms) - mean(device_ms)
            row["cache_share_p99_ms"] = _p99(host_ms) - _p99(device_ms)
            row["share_mean_vs_memcpy"] = row["cache_share_mean_ms"] / memcpy_ms
            row["share_p99_vs_memcpy"] = row["cache_share_p99_ms"] / memcpy_ms
            # Loaded layer by layer while the suffix computes (PrefixCachedLM(layerwise=True))
            row["ttft_host_layerwise_mean_ms"] = mean(layered_ms)
            row["ttft_host_layerwise_p99_ms"] = _p99(layered_ms)
            row["layerwise_share_mean_vs_memcpy"] = (mean(layered_ms) - mean(device_ms)) / memcpy_ms
            row["layerwise_share_p99_vs_memcpy"] = (_p99(layered_ms) - _p99(device_ms)) / memcpy_ms
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        _close_all(made, sidecar)
    return rows


def hit_fraction_model(family: str):
    """``--hit-fraction``'s model of ``family`` (``llama-8b``: the Llama-3.1-8B shape)
    and its page and chunk sizes: realistic on the GPU (chunks of 1024 tokens, so that a
    prefix on the chunk grid is within 3 % of the fraction asked), tiny on the CPU."""
    import torch
    import transformers

    from hicache.integrations.transformers_models import realistic_config, tiny_config

    if DEVICE != "cuda":
        cfg = tiny_config("llama" if family == "llama-8b" else family)
        dtype, page, chunk = torch.float32, 16, 64
    else:
        if family == "llama-8b":
            cfg = transformers.AutoConfig.for_model("llama", **LLAMA_8B)
            cfg._attn_implementation = "sdpa"
        else:
            cfg = realistic_config(family)
        dtype, page, chunk = torch.bfloat16, 64, 1024
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return model, cfg, page, chunk


@contextlib.contextmanager
def layer_copies(how: str | None):
    """Layer-wise loads copied ``how`` inside the block: ``dma`` (on the copy engines:
    2-D copies over runs of pages where they run, else one batched copy per layer
    group), ``rows`` (one batched 1-D copy per group, runs or not), ``queued`` (the
    default copies, every group queued at the start instead of a few ahead of the
    compute) or a kernel on that many programs (``0``: two per SM, as a whole load's);
    None: the default."""
    import dataclasses

    from hicache.controller.store.transfer_engine import TransferEngine

    if how is None:
        yield
        return
    if how == "queued":
        ahead, TransferEngine.layer_ahead = TransferEngine.layer_ahead, 0
        try:
            yield
        finally:
            TransferEngine.layer_ahead = ahead
        return
    saved = TransferEngine.layer_dmas, TransferEngine.layer_tuning, TransferEngine.layer_runs
    TransferEngine.layer_dmas = how in ("dma", "rows")
    TransferEngine.layer_runs = how == "dma"
    if how not in ("dma", "rows"):
        TransferEngine.layer_tuning = dataclasses.replace(saved[1], grid_limit=int(how))
    try:
        yield
    finally:
        TransferEngine.layer_dmas, TransferEngine.layer_tuning, TransferEngine.layer_runs = saved


@contextlib.contextmanager
def layer_loads():
    """The layer-wise loads started by the engine's own copies meanwhile (a list, filled
    as they start): each says how long its copies took to issue (``issue_s``)."""
    from hicache.controller.store.transfer_engine import TransferEngine

    started: list = []
    original = TransferEngine.start_layers_to_device

    def start(self, *args, **kwargs):
        load = original(self, *args, **kwargs)
        started.append(load)
        return load

    TransferEngine.start_layers_to_device = start
    try:
        yield started
    finally:
        TransferEngine.start_layers_to_device = original


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """How much of ``[lo, hi)`` the (merged, sorted) ``spans`` cover."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)


def gpu_timeline(fn: Callable[[], Any]) -> dict[str, float]:
    """``fn()`` under torch's profiler, its GPU work summed up (ms from the first GPU event):
    when the host-to-device copies ran, how much of that the compute kernels overlapped,
    the first and last compute kernel, and the time no kernel ran before the last copy
    ended (compute waiting for the load)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    copies, kernels = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start = e.time_range.start / 1e3
        span = (start, start + e.time_range.elapsed_us() / 1e3)
        name = e.name.lower()
        if "memcpy" in name and ("htod" in name or "h2d" in name):
            copies.append(span)
        elif "memcpy" in name or "memset" in name:
            continue
        else:
            kernels.append(span)  # compute, and any copy kernel of the load
    if not kernels:
        return {}
    t0 = min(a for a, _ in copies + kernels)
    ks, cs = _union(kernels), _union(copies)
    out = {
        "first_kernel_ms": ks[0][0] - t0,
        "last_kernel_end_ms": ks[-1][1] - t0,
        "kernel_busy_ms": sum(b - a for a, b in ks),
        "copies": float(len(copies)),
    }
    if cs:
        lo, hi = cs[0][0], cs[-1][1]
        out |= {
            "copy_first_ms": lo - t0,
            "copy_last_end_ms": hi - t0,
            "copy_busy_ms": sum(b - a for a, b in cs),
            "copy_overlapped_by_kernels_ms": sum(_covered(ks, a, b) for a, b in cs),
            "no_kernel_while_loading_ms": (hi - lo) - _covered(ks, lo, hi),
        }
    return out


def hit_fraction_rows(
    work: pathlib.Path, family: str, lengths: list[int], fractions: list[float], requests: int
) -> list[dict[str, Any]]:
    """TTFT of a prompt of each length whose leading ``fraction`` lies on the host tier of
    a ``hicache serve``: loaded whole before the suffix computes, and loaded layer by layer
    while the suffix's first chunk computes (``PrefixCachedLM(layerwise=True)``), in turn,
    beside the cold prefill, the device hit of the same prefix (the suffix's compute) and
    a pinned memcpy of the bytes the hit loads (the load's floor). ``layerwise_vs_bound``
    is the layer-wise TTFT over max(floor, suffix compute)."""
    import torch

    from hicache.integrations.transformers import PrefixCachedLM
    from hicache.layout import LayerKind

    model, cfg, page, chunk = hit_fraction_model(family)
    params = sum(p.numel() for p in model.parameters())
    slots = (max(lengths) + 2 * page) * 2
    pool = ("12GiB", "16GiB") if DEVICE == "cuda" else ("256MiB", "1GiB")
    sidecar = SidecarProc(work / f"fraction-{family}", *pool)
    made: list = []

    def engine(layerwise: bool):
        c = client(sidecar.endpoint, f"fraction-{family}-{len(made)}")
        lm = PrefixCachedLM.build(
            model, page_size=page, full_slots=slots, mamba_slots=8, controller=c,
            chunk_tokens=chunk, keep_logits=True, shared_memory=DEVICE == "cpu",
            layerwise=layerwise,
        )  # fmt: skip
        made.append((lm, c))
        return lm

    rows = []
    try:
        whole, layered = engine(False), engine(True)
        g = torch.Generator().manual_seed(5)

        def toks(n):
            return torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()

        warm = toks(4 * page)  # every path once: kernels, allocator, plans, the mapping
        for lm in (whole, layered):
            lm.generate(warm + toks(16), 1)
            lm.cache.flush_backups()
            lm.cache.evict(full_tokens=10**9)
            lm.generate(warm + toks(16), 1)
        lay = whole.cache.layout
        for length in lengths:
            for fraction in fractions:
                # On the chunk grid: the prefix's bytes are then the ones its reference
                # computes (a chunk across the prefix's end rounds its sums otherwise).
                prefix_len = int(length * fraction) // chunk * chunk
                suffix_len = length - prefix_len
                prefix = toks(prefix_len)
                nbytes = prefix_len * lay.kv_bytes_per_token(LayerKind.FULL)
                if lay.has_swa:  # the window only
                    window = min(prefix_len, whole.cache.config.sliding_window)
                    nbytes += window * lay.kv_bytes_per_token(LayerKind.SWA)
                if lay.has_mamba:
                    nbytes += lay.mamba_state_bytes
                memcpy_ms = pinned_memcpy_ms(nbytes)
                cold = _cold_ms(whole, prefix, lambda n=suffix_len: toks(n), 2)
                whole.generate([*prefix, 7], 1)
                whole.cache.flush_backups()
                runs = [("whole", whole, None), ("layerwise", layered, None)]
                runs += [(f"layerwise_{how}", layered, how) for how in LAYER_COPIES]
                times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
                times["device"] = []
                issued: dict[str, list[float]] = {name: [] for name, _, _ in runs}
                same: dict[str, bool | None] = {}
                for i in range(requests):
                    for name, lm, how in runs:
                        for other in (whole, layered):
                            other.cache.flush_backups()
                            other.cache.evict(full_tokens=10**9)
                        sync()
                        prompt = prefix + toks(suffix_len)
                        with layer_copies(how), layer_loads() as loads:
                            r = lm.generate(prompt, 1)
                        assert r.host_hit_tokens == prefix_len, (name, r)
                        times[name].append(r.ttft_s * 1e3)
                        issued[name] += [ld.issue_s[1] * 1e3 for ld in loads if ld.issue_s]
                        if i == 0:
                            same[name] = _same(lm, prompt, prefix_len, r)
                    r = layered.generate(prefix + toks(suffix_len), 1)  # on its device now
                    assert r.device_hit_tokens == prefix_len, r
                    times["device"].append(r.ttft_s * 1e3)
                med = {k: statistics.median(v) for k, v in times.items()}
                bound = max(memcpy_ms, med["device"])
                row = {
                    "model": family if DEVICE == "cuda" else f"{family}-tiny",
                    "params_B": round(params / 1e9, 2),
                    "prompt": length,
                    "hit_fraction": fraction,
                    "hit_fraction_actual": round(prefix_len / length, 3),
                    "prefix": prefix_len,
                    "suffix": suffix_len,
                    "requests": requests,
                    "load_MB": round(nbytes / 1e6, 1),
                    "pinned_memcpy_ms": memcpy_ms,
                    "ttft_cold_ms": statistics.median(cold),
                    "ttft_device_hit_ms": med["device"],
                    "ttft_host_whole_ms": med["whole"],
                    "ttft_host_layerwise_ms": med["layerwise"],
                    "whole_vs_bound": med["whole"] / bound,
                    "layerwise_vs_bound": med["layerwise"] / bound,
                    "layerwise_vs_whole": med["layerwise"] / med["whole"],
                    "same_as_live_whole": same.get("whole"),
                    "same_as_live_layerwise": same.get("layerwise"),
                }
                if TIMELINE and DEVICE == "cuda":
                    for name, lm in (("whole", whole), ("layerwise", layered)):
                        for other in (whole, layered):
                            other.cache.flush_backups()
                            other.cache.evict(full_tokens=10**9)
                        sync()
                        prompt = prefix + toks(suffix_len)
                        row[f"timeline_{name}"] = gpu_timeline(
                            lambda p=prompt, m=lm: m.generate(p, 1)
                        )
                    prompt = prefix + toks(suffix_len)  # the layer-wise load left it on device
                    row["timeline_device"] = gpu_timeline(lambda p=prompt: layered.generate(p, 1))
                for how in LAYER_COPIES:  # the same layer-wise load, copied another way
                    row[f"ttft_host_layerwise_{how}_ms"] = med[f"layerwise_{how}"]
                    row[f"layerwise_{how}_vs_bound"] = med[f"layerwise_{how}"] / bound
                for name, ms in issued.items():  # host time to issue every group's copy
                    if ms:
                        row[f"issue_{name}_ms"] = statistics.median(ms)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        _close_all(made, sidecar)
    return rows


def _same(lm, prompt: list[int], prefix_len: int, result) -> bool | None:
    """Logits of the restored prefix equal the live cache object's (None: not checked, the
    reference recompute of a long prompt would cost more than the run can spare)."""
    import torch

    if prefix_len > MAX_CHECKED_PREFIX:
        return None
    ref = lm.reference(prompt, 1, prefix_len)
    return all(torch.equal(a, b) for a, b in zip(result.logits, ref))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,8192,32768")
    p.add_argument("--sizes-mib", default="1,4,16,64,256,1024")
    p.add_argument("--models", default="llama,bamba")
    p.add_argument("--skip-loadback", action="store_true")
    p.add_argument(
        "--switch-interval-us",
        type=float,
        default=0.0,
        help="also run the load-back table with this thread switch interval (0: not)",
    )
    p.add_argument("--profile-dir", default=None, help="profile the sidecar's loads here")
    p.add_argument("--trace-dir", default=None, help="time each request's stages, files here")
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true", help="tiny models on the CPU")
    p.add_argument(
        "--headline",
        default="",
        help="PREFIX:SUFFIX,SUFFIX:REQUESTS, e.g. 10240:16,64:20 - the 8 B-shaped host hit only",
    )
    p.add_argument(
        "--hit-fraction",
        default="",
        help="e.g. 0.5,0.9: that fraction of each --lengths prompt on the host tier, loaded "
        "whole and layer by layer beside the cold prefill (--models, e.g. llama-8b,bamba)",
    )
    p.add_argument("--requests", type=int, default=5, help="host hits per --hit-fraction row")
    p.add_argument(
        "--layer-copies",
        default="",
        help="--hit-fraction: the layer-wise rows again, copied each of these ways "
        "(comma-separated): dma (on the copy engines: 2-D copies over runs of pages, else a "
        "batched copy per layer group), rows (a batched 1-D copy per group), queued (the "
        "default copies, every group queued at the start) or N (a kernel on N programs; 0: "
        "two per SM, as a whole load's)",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="--hit-fraction: one more layer-wise, whole and device-hit request per row under "
        "torch's profiler, their GPU timelines summed up (copies, kernels, their overlap)",
    )
    p.add_argument(
        "--restart-disk-hit",
        action="store_true",
        help="also the first disk hit after a sidecar restart, per length, beside the warm one",
    )
    args = p.parse_args()
    global DEVICE, TRACE_DIR, RESTART_DISK_HIT, LAYER_COPIES, TIMELINE
    RESTART_DISK_HIT = args.restart_disk_hit
    TIMELINE = args.timeline
    LAYER_COPIES = [x for x in args.layer_copies.split(",") if x]
    if args.dry_run:
        DEVICE = "cpu"
    import_hicache()
    import torch

    if args.trace_dir:
        import sidecar_trace

        TRACE_DIR = pathlib.Path(args.trace_dir)
        TRACE_DIR.mkdir(parents=True, exist_ok=True)
        sidecar_trace.install_client(str(TRACE_DIR / "engine.json"))
        sidecar_trace.install_controller()
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    import transformers

    out["transformers"] = transformers.__version__
    work = pathlib.Path(tempfile.mkdtemp(prefix="hcttft", dir="/tmp"))

    def save() -> None:  # after each part, so that a run cut short keeps what it measured
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(out, default=float))

    try:
        if args.headline:
            prefix_len, suffixes, requests = args.headline.split(":")
            out["headline"] = headline_rows(
                work, int(prefix_len), [int(x) for x in suffixes.split(",")], int(requests)
            )
            save()
            return 0
        if args.hit_fraction:
            fractions = [float(x) for x in args.hit_fraction.split(",")]
            out["hit_fraction"] = []
            for family in filter(None, args.models.split(",")):
                lengths = [int(x) for x in args.lengths.split(",")]
                out["hit_fraction"] += hit_fraction_rows(
                    work, family, lengths, fractions, args.requests
                )
                save()
            return 0
        if not args.skip_loadback:
            sizes = [int(s) for s in args.sizes_mib.split(",")]
            prof = pathlib.Path(args.profile_dir) if args.profile_dir else None
            if prof is not None:
                prof.mkdir(parents=True, exist_ok=True)
            out["loadback"] = loadback_table(work, sizes, profile_dir=prof)
            if args.switch_interval_us:
                out["loadback"] += loadback_table(work, sizes, args.switch_interval_us * 1e-6)
            save()
        lengths = [int(x) for x in args.lengths.split(",")]
        out["ttft"] = []
        for family in filter(None, args.models.split(",")):  # --models "": no TTFT rows
            out["ttft"] += ttft_rows(work, family, lengths)
            save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        save()
    else:
        print(json.dumps(out, default=float))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
