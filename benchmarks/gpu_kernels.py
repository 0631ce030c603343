"""Transfer kernels on a GPU: every kernel checked against the torch reference, then GB/s.

Run from the repository root on a CUDA machine (needs only torch, triton, numpy and
hicache's core; hicache need not be installed):

    python3 benchmarks/gpu_kernels.py [--out DIR] [--checks-only] [--sweep]

Part 1 checks, bit for bit on fresh random inputs with poisoned outputs, the Triton,
copy-engine and staged transfers and the Triton scatters against the torch reference (and
the scatters against a plain loop too). Part 2 measures device->host and host->device
page transfers for a Llama-3-8B-like layout and a hybrid layout at page sizes 1/16/64,
with random and with consecutive host pages, against a pinned memcpy of the same bytes
and the naive torch gather-then-copy, all in this run, each with Triton, the copy
engines, the staged path and the default dispatch; a backup and a load running at once;
the staging ring's chunk size and slots, and small transfers (Llama layout, page 16);
Mamba state transfers; the speculative-decoding scatters against a boolean-mask +
index_select version; with --sweep, Triton's launch parameters; with --matrix, backup and
load methods mixed. The tables are printed last; DIR/kernels_gpu.json holds every
number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def import_kernels():
    """``hicache.kernels``, mapping the repository's kernels/ in when not installed."""
    try:
        import hicache.kernels as kernels

        return kernels
    except ModuleNotFoundError:
        pass
    sys.path.insert(0, str(ROOT))
    import hicache

    if str(ROOT) not in hicache.__path__:
        hicache.__path__.append(str(ROOT))
    import hicache.kernels as kernels

    return kernels


K = import_kernels()
from hicache.kernels import reference as ref  # noqa: E402

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
GB = 1e9


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_OF_SIZE[t.element_size()])


def randomize(t: torch.Tensor) -> torch.Tensor:
    """Every bit pattern (NaNs included), so that only bit equality can pass."""
    b = bits(t)
    if b.dtype == torch.uint8:
        b.random_(0, 256)
    else:
        width = 8 * b.element_size()
        b.random_(-(2 ** (width - 1)), 2 ** (width - 1))
    return t


def empty_bytes(n: int, device: str, pin: bool) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device=device, pin_memory=pin)


def clone_like(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A copy that stays pinned when ``pin`` (a plain clone of a pinned tensor is not)."""
    out = torch.empty_like(t, pin_memory=pin) if t.device.type == "cpu" else torch.empty_like(t)
    out.copy_(t)
    return out


def paged_view(buf: torch.Tensor, n_pages: int, page_shape, dtype, pad: int) -> torch.Tensor:
    """``[n_pages, *page_shape]`` of ``dtype`` carved from byte buffer ``buf``, each page
    followed by ``pad`` bytes (a host pool's page-first layout)."""
    page_bytes = dtype.itemsize * int(torch.Size(page_shape).numel())
    rows = buf[: n_pages * (page_bytes + pad)].view(n_pages, page_bytes + pad)
    return rows[:, :page_bytes].view(dtype).view(n_pages, *page_shape)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------
# Part 1: correctness
# ---------------------------------------------------------------------------------------


class Checks:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def record(self, name: str, fn: Callable[[], bool]) -> None:
        try:
            ok = bool(fn())
            sync()
            detail = ""
        except Exception as exc:  # a failing check must not hide the others
            ok, detail = False, "".join(traceback.format_exception_only(type(exc), exc)).strip()
            traceback.print_exc()
        self.rows.append({"check": name, "ok": ok, "detail": detail})
        print(f"  [{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)

    @property
    def failures(self) -> int:
        return sum(not r["ok"] for r in self.rows)


def check_kv(
    dtype,
    page_size: int,
    backend: str | None,
    device: str,
    pin: bool,
    big: bool = False,
    tuning=None,
    pad: int = 64,
    consecutive: bool = False,
    prepared: bool = False,
) -> bool:
    """Round trip through host pages; ``big`` pages (Llama-3-8B, 8 MiB at page 64) take
    the copy engines under the default dispatch. ``pad`` bytes follow each host page
    (0: pages back to back, so the staged path merges consecutive ones); ``consecutive``
    host pages are an ascending subset (runs of neighbours) instead of a permutation.
    ``prepared``: through a :class:`PreparedTransfer` (index lists) instead of the
    functions."""
    layers, heads, head_dim, num_pages, host_n, n = 4, 4, 64, 40, 24, 12
    if big:
        layers, heads, head_dim, num_pages, host_n, n = 32, 8, 128, 10, 6, 4
    kw = {"backend": backend}
    if tuning is not None:
        kw["tuning"] = tuning
    device_kv = randomize(
        torch.empty(2, layers, num_pages * page_size, heads, head_dim, dtype=dtype, device=device)
    )
    page_shape = (2, layers, page_size, heads, head_dim)
    page_bytes = dtype.itemsize * 2 * layers * page_size * heads * head_dim
    buf = randomize(empty_bytes(host_n * (page_bytes + pad), "cpu", pin))
    dpages = torch.randperm(num_pages)[:n]
    dpages[1] = dpages[0]  # one device page to two host pages
    hpages = torch.randperm(host_n)[:n]
    if consecutive:
        hpages = torch.sort(hpages).values

    got, want = clone_like(buf, pin), clone_like(buf, pin)
    to_host, to_device = K.kv_pages_to_host, K.kv_pages_to_device
    if prepared:
        to_host, to_device = prepared_kv(True), prepared_kv(False)
    to_host(
        device_kv, paged_view(got, host_n, page_shape, dtype, pad), dpages, hpages, page_size, **kw
    )
    ref.kv_pages_to_host_ref(
        device_kv, paged_view(want, host_n, page_shape, dtype, pad), dpages, hpages, page_size
    )
    sync()
    ok = torch.equal(got, want) and not torch.equal(got, buf)

    host_kv = paged_view(got, host_n, page_shape, dtype, pad)
    back = torch.randperm(num_pages)[:n]
    target = randomize(torch.empty_like(device_kv))
    dev_got, dev_want = target.clone(), target.clone()
    to_device(host_kv, dev_got, hpages, back, page_size, **kw)
    ref.kv_pages_to_device_ref(host_kv, dev_want, hpages, back, page_size)
    sync()
    ok &= torch.equal(bits(dev_got), bits(dev_want))
    paged = dev_got.view(2, layers, num_pages, page_size, heads, head_dim)
    orig = device_kv.view(2, layers, num_pages, page_size, heads, head_dim)
    dev = device_kv.device
    ok &= torch.equal(bits(paged[:, :, back.to(dev)]), bits(orig[:, :, dpages.to(dev)]))
    return ok


def prepared_kv(to_host: bool):
    """A PreparedTransfer of KV pages called like ``kv_pages_to_host`` / ``_to_device``."""

    def run(src, dst, src_items, dst_items, page_size, **kw):
        if to_host:
            copy = K.PreparedTransfer.kv(src, dst, page_size, to_host=True, **kw)
            copy(src_items.tolist(), dst_items.tolist())
        else:
            copy = K.PreparedTransfer.kv(dst, src, page_size, to_host=False, **kw)
            copy(dst_items.tolist(), src_items.tolist())

    return run


def prepared_states(to_host: bool):
    """A PreparedTransfer of Mamba states called like ``mamba_states_to_host`` / ..."""

    def run(a, b, c, d, src_items, dst_items, **kw):
        if to_host:  # conv, ssm, host_conv, host_ssm, slots, host_pages
            K.PreparedTransfer.states(a, b, c, d, to_host=True, **kw)(
                src_items.tolist(), dst_items.tolist()
            )
        else:  # host_conv, host_ssm, conv, ssm, host_pages, slots
            K.PreparedTransfer.states(c, d, a, b, to_host=False, **kw)(
                dst_items.tolist(), src_items.tolist()
            )

    return run


def small_chunks(page_size: int, dtype=torch.bfloat16, **kw):
    """A staging ring of 2 slots of 3 test pages (``check_kv``'s small layout), so that 12
    pages take 4 chunks and every slot is reused."""
    page_bytes = 2 * 4 * page_size * 4 * 64 * dtype.itemsize
    return K.TransferTuning(staging_chunk_bytes=3 * page_bytes, staging_chunks=2, **kw)


def check_staged_default_dispatch(device: str, pin: bool) -> bool:
    """With the staged thresholds at 0 the default dispatch stages a KV transfer, and only
    when its indices are on the CPU and the host pages pinned."""
    tuning = K.TransferTuning(staged_min_transfer_bytes=0, staged_min_dma_bytes=1)
    dev = torch.zeros(2, 2, 64, 2, 32, dtype=torch.float16, device=device)
    host = torch.zeros(8, 2, 2, 16, 2, 32, dtype=torch.float16, pin_memory=pin)
    cpu_idx = torch.tensor([1, 2])
    args = (dev, host, cpu_idx, cpu_idx, 16)
    picked = K.kv_transfer_backend(*args, to_host=True, tuning=tuning)
    gpu_idx = K.kv_transfer_backend(
        dev, host, cpu_idx.to(device), cpu_idx, 16, to_host=True, tuning=tuning
    )
    pageable = K.kv_transfer_backend(
        dev,
        torch.zeros_like(host, device="cpu"),
        cpu_idx,
        cpu_idx,
        16,
        to_host=False,
        tuning=tuning,
    )
    ok = picked is K.Backend.STAGED and gpu_idx is not K.Backend.STAGED
    ok &= pageable is not K.Backend.STAGED
    return ok and check_kv(torch.bfloat16, 16, None, device, pin, tuning=tuning, pad=0)


def check_staged_concurrent(device: str, pin: bool, rounds: int = 3) -> bool:
    """A staged backup (stream A) and a staged load (stream B) at once, several rounds on
    the same two streams (so the rings are reused), each checked against the reference."""
    layers, heads, dim, ps, pages, n = 8, 4, 128, 16, 64, 24
    tuning = K.TransferTuning(staging_chunk_bytes=4 * 2 * layers * ps * heads * dim * 2)
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    ok = True
    for _ in range(rounds):
        dev = randomize(
            torch.empty(2, layers, pages * ps, heads, dim, dtype=torch.bfloat16, device=device)
        )
        host = randomize(
            torch.empty(2 * n, 2, layers, ps, heads, dim, dtype=torch.bfloat16, pin_memory=pin)
        )
        perm, hperm = torch.randperm(pages), torch.randperm(2 * n)
        d_a, d_b, h_a, h_b = perm[:n], perm[n : 2 * n], hperm[:n], hperm[n:]
        want_host, want_dev = host.clone(), dev.clone()
        ref.kv_pages_to_host_ref(dev, want_host, d_a, h_a, ps)
        ref.kv_pages_to_device_ref(host, want_dev, h_b, d_b, ps)
        sync()
        cur = torch.cuda.current_stream()
        sa.wait_stream(cur)
        sb.wait_stream(cur)
        with torch.cuda.stream(sa):
            K.kv_pages_to_host(dev, host, d_a, h_a, ps, backend="staged", tuning=tuning)
        with torch.cuda.stream(sb):
            K.kv_pages_to_device(host, dev, h_b, d_b, ps, backend="staged", tuning=tuning)
        sync()
        ok &= torch.equal(bits(host), bits(want_host)) and torch.equal(bits(dev), bits(want_dev))
    return ok


def check_kv_gpu_indices_out_of_range(device: str, pin: bool) -> bool:
    """Indices on the GPU are not read back; the kernel must skip the bad rows."""
    device_kv = randomize(torch.empty(2, 2, 64, 2, 32, dtype=torch.float16, device=device))
    buf = randomize(empty_bytes(8 * 2 * 2 * 16 * 2 * 32 * 2, "cpu", pin))
    host = paged_view(buf, 8, (2, 2, 16, 2, 32), torch.float16, 0)
    want = clone_like(buf, pin)
    ref.kv_pages_to_host_ref(
        device_kv,
        paged_view(want, 8, (2, 2, 16, 2, 32), torch.float16, 0),
        torch.tensor([2]),
        torch.tensor([5]),
        16,
    )
    dpages = torch.tensor([2, -1, 4, 1], device=device)
    hpages = torch.tensor([5, 0, 3, 99], device=device)
    K.kv_pages_to_host(device_kv, host, dpages, hpages, 16, backend="triton")
    sync()
    return torch.equal(buf, want)


def check_mamba(dtype, backend: str, device: str, pin: bool, prepared: bool = False) -> bool:
    to_host, to_device = K.mamba_states_to_host, K.mamba_states_to_device
    if prepared:
        to_host, to_device = prepared_states(True), prepared_states(False)
    layers, slots, host_n = 3, 10, 6
    conv_shape, ssm_shape = (64, 3), (4, 16, 8)
    conv = randomize(torch.empty(layers, slots, *conv_shape, dtype=dtype, device=device))
    ssm = randomize(torch.empty(layers, slots, *ssm_shape, dtype=dtype, device=device))
    conv_bytes = layers * 64 * 3 * dtype.itemsize
    ssm_bytes = layers * 4 * 16 * 8 * dtype.itemsize
    page = conv_bytes + ssm_bytes + 32

    def views(buf):
        rows = buf.view(host_n, page)
        c = rows[:, :conv_bytes].view(dtype).view(host_n, layers, *conv_shape)
        s = rows[:, conv_bytes : conv_bytes + ssm_bytes].view(dtype)
        return c, s.view(host_n, layers, *ssm_shape)

    buf = randomize(empty_bytes(host_n * page, "cpu", pin))
    got, want = clone_like(buf, pin), clone_like(buf, pin)
    s_idx, h_idx = torch.tensor([9, 0, 4]), torch.tensor([1, 5, 2])
    to_host(conv, ssm, *views(got), s_idx, h_idx, backend=backend)
    ref.mamba_states_to_host_ref(conv, ssm, *views(want), s_idx, h_idx)
    sync()
    ok = torch.equal(got, want) and not torch.equal(got, buf)
    back = torch.tensor([3, 7, 1])
    tc, ts = randomize(torch.empty_like(conv)), randomize(torch.empty_like(ssm))
    gc, gs, wc, ws = tc.clone(), ts.clone(), tc.clone(), ts.clone()
    to_device(*views(got), gc, gs, h_idx, back, backend=backend)
    ref.mamba_states_to_device_ref(*views(got), wc, ws, h_idx, back)
    sync()
    ok &= torch.equal(bits(gc), bits(wc)) and torch.equal(bits(gs), bits(ws))
    d = conv.device
    ok &= torch.equal(bits(gc[:, back.to(d)]), bits(conv[:, s_idx.to(d)]))
    ok &= torch.equal(bits(gs[:, back.to(d)]), bits(ssm[:, s_idx.to(d)]))
    return ok


def loop_scatter(dst, src, dst_indices, step_indices) -> None:
    slots, steps = dst.shape[1], src.shape[2]
    for i, (d, s) in enumerate(zip(dst_indices.tolist(), step_indices.tolist())):
        if 0 <= s < steps and 0 <= d < slots:
            dst[:, d] = src[:, i, s]


def scatter_requests(requests: int, slots: int, steps: int):
    dst = torch.randint(0, slots, (requests,))
    dst[1], dst[2], dst[3] = dst[0], slots, -2  # duplicate, out of range both sides
    step = torch.randint(0, steps, (requests,))
    step[0], step[1], step[4], step[5], step[6], step[7] = 0, 1 % steps, -1, 0, steps - 1, steps
    return dst, step


def check_scatter(dtype, kind: str, device: str) -> bool:
    layers, slots, requests, steps = 3, 12, 10, 4
    dst_idx, step_idx = scatter_requests(requests, slots, steps)
    sources = []
    if kind == "state":
        dst = randomize(torch.empty(layers, slots, 4, 8, 16, dtype=dtype, device=device))
        sources.append(
            randomize(torch.empty(layers, requests, steps, 4, 8, 16, dtype=dtype, device=device))
        )
        fused, fused_ref = (
            K.fused_mamba_state_scatter_with_mask,
            ref.fused_mamba_state_scatter_with_mask_ref,
        )
    else:
        conv_dim, kernel = 96, 4
        dst = randomize(
            torch.empty(layers, slots, conv_dim, kernel - 1, dtype=dtype, device=device)
        )
        dedup = K.ConvWindowBuffer.allocate(
            layers,
            requests,
            steps,
            conv_dim,
            kernel,
            dtype,
            device,
            draft_topk=1,
            layout=None if device == "cuda" else K.ConvWindowLayout.DEDUPLICATED,
        )
        if dedup.layout is not K.ConvWindowLayout.DEDUPLICATED:
            return False
        randomize(dedup.storage)
        dense = K.ConvWindowBuffer.allocate(
            layers,
            requests,
            steps,
            conv_dim,
            kernel,
            dtype,
            device,
            layout=K.ConvWindowLayout.DENSE,
        )
        dense.store_windows(dedup.view)
        sources += [dense.view, dedup.view]
        fused, fused_ref = (
            K.fused_conv_window_scatter_with_mask,
            ref.fused_conv_window_scatter_with_mask_ref,
        )
    outs = []
    for src in sources:
        for fn in (partial(fused, backend="triton"), fused_ref, loop_scatter):
            out = dst.clone()
            fn(out, src, dst_idx, step_idx)
            outs.append(out)
    sync()
    return all(torch.equal(bits(o), bits(outs[0])) for o in outs) and not torch.equal(
        bits(outs[0]), bits(dst)
    )


def check_dedup_bytes(device: str) -> bool:
    for steps, kernel in ((4, 4), (3, 4), (8, 2), (6, 3)):
        shape = (4, 8, steps, 128, kernel)
        dense = K.ConvWindowBuffer.allocate(
            *shape, torch.bfloat16, device, K.ConvWindowLayout.DENSE
        )
        dedup = K.ConvWindowBuffer.allocate(
            *shape, torch.bfloat16, device, K.ConvWindowLayout.DEDUPLICATED
        )
        a = dedup.storage.untyped_storage().nbytes()
        b = dense.storage.untyped_storage().nbytes()
        if a * steps * (kernel - 1) != b * (steps + kernel - 2):
            return False
        if steps == kernel == 4 and 2 * a != b:
            return False
    return True


def check_pageable_host_refused(device: str) -> bool:
    device_kv = torch.zeros(2, 1, 16, 1, 8, device=device)
    host = torch.zeros(2, 2, 1, 16, 1, 8)  # not pinned
    try:
        K.kv_pages_to_host(
            device_kv, host, torch.tensor([0]), torch.tensor([1]), 16, backend="triton"
        )
    except ValueError as exc:
        return "pageable" in str(exc)
    return False


def run_checks(device: str = "cuda") -> Checks:
    """Every kernel against the reference; on ``device='cpu'`` Triton runs interpreted."""
    pin = device == "cuda"
    backends = ["triton", "copy_engine"] if device == "cuda" else ["triton"]
    checks = Checks()
    print(f"== correctness on {device}", flush=True)
    for backend in backends:
        for dtype in DTYPES:
            for ps in (1, 16, 64):
                checks.record(
                    f"kv round trip {backend} {str(dtype)[6:]} page {ps}",
                    partial(check_kv, dtype, ps, backend, device, pin),
                )
            checks.record(
                f"mamba round trip {backend} {str(dtype)[6:]}",
                partial(check_mamba, dtype, backend, device, pin),
            )
    staged_cases = [
        ("random host pages, padded", {"tuning_fn": small_chunks}),
        (
            "consecutive host pages, back to back",
            {"tuning_fn": small_chunks, "pad": 0, "consecutive": True},
        ),
    ]
    for dtype in DTYPES:
        for ps in (1, 16, 64):
            for label, case in staged_cases:
                kw = {k: v for k, v in case.items() if k != "tuning_fn"}
                checks.record(
                    f"kv round trip staged {str(dtype)[6:]} page {ps}, {label}, 4 chunks",
                    partial(
                        check_kv,
                        dtype,
                        ps,
                        "staged",
                        device,
                        pin,
                        tuning=case["tuning_fn"](ps, dtype),
                        **kw,
                    ),
                )
    if device == "cuda":
        checks.record(
            "kv round trip staged, one cudaMemcpyAsync per DMA",
            partial(
                check_kv,
                torch.bfloat16,
                16,
                "staged",
                device,
                pin,
                tuning=small_chunks(16, torch.bfloat16, staged_batched_dma=False),
                pad=0,
                consecutive=True,
            ),
        )
        for ps in (16, 64):
            checks.record(
                f"kv round trip default dispatch, llama pages of {ps}",
                partial(check_kv, torch.bfloat16, ps, None, device, pin, big=True),
            )
            checks.record(
                f"kv round trip staged, llama pages of {ps}",
                partial(check_kv, torch.bfloat16, ps, "staged", device, pin, big=True),
            )
        for backend in (None, "triton", "copy_engine"):
            name = backend or "default dispatch"
            for ps in (1, 16):
                checks.record(
                    f"prepared kv round trip {name} bfloat16 page {ps}",
                    partial(check_kv, torch.bfloat16, ps, backend, device, pin, prepared=True),
                )
            checks.record(
                f"prepared mamba round trip {name} float32",
                partial(check_mamba, torch.float32, backend, device, pin, prepared=True),
            )
        checks.record(
            "prepared kv round trip staged, 4 chunks",
            partial(
                check_kv,
                torch.bfloat16,
                16,
                "staged",
                device,
                pin,
                tuning=small_chunks(16),
                prepared=True,
            ),
        )
        checks.record(
            "prepared kv round trip default dispatch, llama pages of 64",
            partial(check_kv, torch.bfloat16, 64, None, device, pin, big=True, prepared=True),
        )
        checks.record(
            "default dispatch stages large transfers (thresholds at 0)",
            partial(check_staged_default_dispatch, device, pin),
        )
        checks.record(
            "staged backup and staged load at once on two streams, 3 rounds",
            partial(check_staged_concurrent, device, pin),
        )
    for dtype in DTYPES:
        for kind in ("state", "conv"):
            checks.record(
                f"{kind} scatter {str(dtype)[6:]}", partial(check_scatter, dtype, kind, device)
            )
    checks.record("dedup bytes = (D+K-2)/(D(K-1)) of dense", partial(check_dedup_bytes, device))
    if device == "cuda":
        checks.record(
            "kv gpu indices out of range skipped",
            partial(check_kv_gpu_indices_out_of_range, device, pin),
        )
        checks.record(
            "pageable host refused by triton", partial(check_pageable_host_refused, device)
        )
    print(f"== {len(checks.rows) - checks.failures}/{len(checks.rows)} checks passed", flush=True)
    return checks


# ---------------------------------------------------------------------------------------
# Part 2: bandwidth
# ---------------------------------------------------------------------------------------


def measured(failed: object):
    """A timer that reports a failure as ``failed`` (after printing its traceback) instead
    of ending the run."""

    def wrap(timer):
        def run(*args, **kwargs):
            try:
                return timer(*args, **kwargs)
            except Exception:
                traceback.print_exc()
                torch.cuda.synchronize()
                return failed

        return run

    return wrap


@measured(math.nan)
def time_ms(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` between CUDA events on the current stream (host-side
    issue time included, since the end event is recorded after ``fn`` returns)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@measured(math.nan)
def issue_ms(fn: Callable[[], object], reps: int = 5) -> float:
    """Median host milliseconds that ``fn`` takes to return (to queue its work) on an idle
    GPU: the time a transfer issued next on another stream starts late by."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


@measured((math.nan, math.nan, math.nan))
def time_concurrent_ms(
    fn_a: Callable[[], object], fn_b: Callable[[], object], reps: int
) -> tuple[float, float, float]:
    """Median milliseconds until both ``fn_a`` (stream A) and ``fn_b`` (stream B) finish,
    and until each of them does."""
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()

    def once() -> tuple[float, float, float]:
        cur = torch.cuda.current_stream()
        start = torch.cuda.Event(enable_timing=True)
        end_a, end_b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(cur)
        sa.wait_stream(cur)
        sb.wait_stream(cur)
        with torch.cuda.stream(sa):
            fn_a()
            end_a.record(sa)
        with torch.cuda.stream(sb):
            fn_b()
            end_b.record(sb)
        end_a.synchronize()
        end_b.synchronize()
        a, b = start.elapsed_time(end_a), start.elapsed_time(end_b)
        return max(a, b), a, b

    for _ in range(2):
        once()
    runs = [once() for _ in range(reps)]
    return tuple(statistics.median(r[i] for r in runs) for i in range(3))


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / GB


def pinned_index(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).pin_memory()


def copy_of(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], object]:
    return partial(dst.copy_, src, non_blocking=True)


def show(row: dict) -> None:
    print(
        "  " + json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
    )


class KVBench:
    """One KV layout: a device pool of 4x the transferred tokens and a pinned host area of
    2x (one half backed up into, the other loaded from, so both can run at once)."""

    def __init__(self, name: str, layers: int, heads: int, head_dim: int, tokens: int) -> None:
        self.name, self.layers, self.heads, self.head_dim = name, layers, heads, head_dim
        self.tokens = tokens
        self.dtype = torch.bfloat16
        self.token_bytes = 2 * layers * heads * head_dim * self.dtype.itemsize
        self.dev_slots = 4 * tokens
        self.device_kv = randomize(
            torch.empty(2, layers, self.dev_slots, heads, head_dim, dtype=self.dtype, device="cuda")
        )
        self.dev_bytes = self.device_kv.view(-1).view(torch.uint8)
        self.host_buf = empty_bytes(2 * tokens * self.token_bytes, "cpu", pin=True)
        self.host_buf.copy_(self.dev_bytes[: self.host_buf.numel()])
        print(
            f"== {name}: {layers} layers x {heads} heads x {head_dim} bf16, "
            f"{self.token_bytes} B/token, {tokens * self.token_bytes / GB:.2f} GB per transfer",
            flush=True,
        )

    def pages(self, ps: int, in_order: bool = False) -> None:
        """Set up page size ``ps``: host view, disjoint page sets A (backup) and B (load).
        Device pages are random; host pages are a random permutation, or with
        ``in_order`` consecutive (A = the first n host pages, B = the next n), as a host
        pool hands out pages when it is not fragmented."""
        self.ps = ps
        n = self.n = self.tokens // ps
        self.nbytes = n * ps * self.token_bytes
        shape = (2, self.layers, ps, self.heads, self.head_dim)
        self.host_kv = paged_view(self.host_buf, 2 * n, shape, self.dtype, 0)
        dpages = torch.randperm(self.dev_slots // ps)[: 2 * n]
        hpages = torch.arange(2 * n) if in_order else torch.randperm(2 * n)
        self.d_a, self.d_b = pinned_index(dpages[:n]), pinned_index(dpages[n:])
        self.h_a, self.h_b = pinned_index(hpages[:n]), pinned_index(hpages[n:])

    def backup(self, backend: str, count: int | None = None, **kw) -> Callable[[], object]:
        """A backup of page set A (its first ``count`` pages) with ``backend`` ("auto":
        the default dispatch)."""
        fn = ref.kv_pages_to_host_ref if backend == "naive" else K.kv_pages_to_host
        if backend not in ("naive", "auto"):
            kw["backend"] = backend
        args = (self.device_kv, self.host_kv, self.d_a[:count], self.h_a[:count], self.ps)
        return partial(fn, *args, **kw)

    def load(self, backend: str, count: int | None = None, **kw) -> Callable[[], object]:
        """A load of page set B (its first ``count`` pages) with ``backend``."""
        fn = ref.kv_pages_to_device_ref if backend == "naive" else K.kv_pages_to_device
        if backend not in ("naive", "auto"):
            kw["backend"] = backend
        args = (self.host_kv, self.device_kv, self.h_b[:count], self.d_b[:count], self.ps)
        return partial(fn, *args, **kw)

    def default_backends(self, row: dict) -> None:
        """Which backend the default dispatch picks for the backup and the load."""
        row["default_d2h_is"] = K.kv_transfer_backend(
            self.device_kv, self.host_kv, self.d_a, self.h_a, self.ps, to_host=True
        ).value
        row["default_h2d_is"] = K.kv_transfer_backend(
            self.device_kv, self.host_kv, self.d_b, self.h_b, self.ps, to_host=False
        ).value

    def memcpy_baseline(self, row: dict) -> None:
        nbytes = self.nbytes
        flat_host = self.host_buf[:nbytes]
        flat_dev = self.dev_bytes[self.dev_bytes.numel() - nbytes :]
        row["memcpy_d2h"] = gbps(nbytes, time_ms(copy_of(flat_host, flat_dev), 7))
        row["memcpy_h2d"] = gbps(nbytes, time_ms(copy_of(flat_dev, flat_host), 7))
        other_host = self.host_buf[nbytes : 2 * nbytes]
        memcpy_pair = (copy_of(flat_host, flat_dev), copy_of(self.dev_bytes[:nbytes], other_host))
        self.both(row, "memcpy", *memcpy_pair)

    def measure(self, ps: int) -> dict:
        """Random host pages: every method one way and two ways, with the memcpy baseline."""
        self.pages(ps)
        nbytes = self.nbytes
        row = {"layout": self.name, "page_size": ps, "hosts": "random", "bytes": nbytes}
        self.memcpy_baseline(row)
        self.default_backends(row)
        for backend in ("triton", "copy_engine", "staged", "auto"):
            row[f"{backend}_d2h"] = gbps(nbytes, time_ms(self.backup(backend), 7))
            row[f"{backend}_h2d"] = gbps(nbytes, time_ms(self.load(backend), 7))
        # The naive version runs on a quarter of the pages: it is slow, and its rate (a
        # host-side index_put of a pageable copy) does not improve with size.
        q = max(1, self.n // 4)
        qbytes = q * ps * self.token_bytes
        row["naive_d2h"] = gbps(qbytes, time_ms(self.backup("naive", q), 2, 1))
        row["naive_h2d"] = gbps(qbytes, time_ms(self.load("naive", q), 2, 1))
        for backend in ("triton", "copy_engine", "staged", "auto"):
            self.both(row, backend, self.backup(backend), self.load(backend))
        for backend in ("triton", "staged"):
            row[f"{backend}_d2h_issue_ms"] = issue_ms(self.backup(backend))
            row[f"{backend}_h2d_issue_ms"] = issue_ms(self.load(backend))
        return row

    def measure_in_order(self, ps: int) -> dict:
        """Consecutive host pages (one DMA per staging chunk): Triton, staged and the
        default, one way and two ways."""
        self.pages(ps, in_order=True)
        nbytes = self.nbytes
        row = {"layout": self.name, "page_size": ps, "hosts": "in order", "bytes": nbytes}
        self.memcpy_baseline(row)
        self.default_backends(row)
        for backend in ("staged", "auto"):
            row[f"{backend}_d2h"] = gbps(nbytes, time_ms(self.backup(backend), 7))
            row[f"{backend}_h2d"] = gbps(nbytes, time_ms(self.load(backend), 7))
        for backend in ("triton", "staged", "auto"):
            self.both(row, backend, self.backup(backend), self.load(backend))
        return row

    def staging_sweep(self, ps: int) -> list[dict]:
        """Staged two-way totals over the ring's chunk size and slot count, and with one
        ``cudaMemcpyAsync`` per DMA instead of the batched call."""
        rows = []
        configs = [(32, 3, True), (64, 2, True), (64, 3, True), (128, 2, True)]
        configs += [(64, 2, False)]
        for in_order in (False, True):
            self.pages(ps, in_order)
            for chunk_mib, slots, batched in configs:
                tuning = K.TransferTuning(
                    staging_chunk_bytes=chunk_mib << 20,
                    staging_chunks=slots,
                    staged_batched_dma=batched,
                )
                row = {
                    "layout": self.name,
                    "page_size": ps,
                    "hosts": "in order" if in_order else "random",
                    "chunk_mib": chunk_mib,
                    "slots": slots,
                    "batched": batched,
                }
                kw = {"tuning": tuning}
                self.both(row, "staged", self.backup("staged", **kw), self.load("staged", **kw))
                rows.append(row)
                show(row)
        return rows

    def size_sweep(self, ps: int, sizes_mib=(64, 256, 512)) -> list[dict]:
        """Triton against staged on smaller transfers (consecutive host pages): where the
        staged path's per-chunk cost stops paying."""
        self.pages(ps, in_order=True)
        page_bytes = ps * self.token_bytes
        rows = []
        for mib in sizes_mib:
            count = min(self.n, max(1, (mib << 20) // page_bytes))
            nbytes = count * page_bytes
            row = {"layout": self.name, "page_size": ps, "bytes": nbytes}
            for backend in ("triton", "staged"):
                backup, load = self.backup(backend, count), self.load(backend, count)
                row[f"{backend}_d2h"] = gbps(nbytes, time_ms(backup, 9))
                row[f"{backend}_h2d"] = gbps(nbytes, time_ms(load, 9))
                total, _, _ = time_concurrent_ms(backup, load, 7)
                row[f"{backend}_both"] = gbps(2 * nbytes, total)
            rows.append(row)
            show(row)
        return rows

    def both(self, row: dict, key: str, backup, load, reps: int = 5) -> None:
        """A backup (stream A) and a load (stream B) at once: total and per-direction GB/s."""
        total, a, b = time_concurrent_ms(backup, load, reps)
        row[f"{key}_both"] = gbps(2 * self.nbytes, total)
        row[f"{key}_both_d2h"] = gbps(self.nbytes, a)
        row[f"{key}_both_h2d"] = gbps(self.nbytes, b)

    def concurrency_matrix(self, ps: int) -> list[dict]:
        """Backup and load methods mixed, run at once; which pairing fills both directions."""
        self.pages(ps)
        backups = {
            "triton": {"backend": "triton"},
            "triton 1 prog/SM": {
                "backend": "triton",
                "tuning": K.TransferTuning(programs_per_sm=1),
            },
            "copy engine": {"backend": "copy_engine"},
        }
        loads = {
            "triton": {"backend": "triton"},
            "triton 4 prog/SM 32K": {
                "backend": "triton",
                "tuning": K.TransferTuning(programs_per_sm=4, tile_bytes=32768),
            },
            "copy engine": {"backend": "copy_engine"},
        }
        rows = []
        for b_name, b_kw in backups.items():
            for l_name, l_kw in loads.items():
                if ps == 1 and "copy engine" in (b_name, l_name):
                    continue  # ~7 us of host time per page: far off at one token per page
                row = {"layout": self.name, "page_size": ps, "backup": b_name, "load": l_name}
                self.both(row, "pair", self.backup(**b_kw), self.load(**l_kw))
                rows.append(row)
                show(row)
        return rows

    def sweep(self, ps: int) -> list[dict]:
        """Triton launch parameters at page size ``ps``."""
        self.pages(ps)
        rows = []
        for tile in (8192, 16384, 32768):
            for pps in (1, 2, 4, 8):
                for warps in (4, 8):
                    tuning = K.TransferTuning(tile_bytes=tile, programs_per_sm=pps, num_warps=warps)
                    backup = self.backup("triton", tuning=tuning)
                    load = self.load("triton", tuning=tuning)
                    rows.append(
                        {
                            "layout": self.name,
                            "page_size": ps,
                            "tile_bytes": tile,
                            "programs_per_sm": pps,
                            "num_warps": warps,
                            "d2h": gbps(self.nbytes, time_ms(backup, 5)),
                            "h2d": gbps(self.nbytes, time_ms(load, 5)),
                            "both": gbps(2 * self.nbytes, time_concurrent_ms(backup, load, 3)[0]),
                        }
                    )
        best = max(rows, key=lambda r: r["d2h"] + r["h2d"])
        print(f"  sweep best at page {ps}: {best}", flush=True)
        return rows


def bench_kv(
    results: dict,
    name: str,
    layers: int,
    heads: int,
    head_dim: int,
    tokens: int,
    sweep: bool,
    matrix: bool,
    staging: bool,
) -> None:
    bench = KVBench(name, layers, heads, head_dim, tokens)
    for ps in (1, 16, 64):
        for measure in (bench.measure, bench.measure_in_order):
            try:
                row = measure(ps)
            except Exception:  # one failing configuration must not hide the others
                traceback.print_exc()
                continue
            results["kv"].append(row)
            show(row)
        if matrix:
            results["matrix"] += bench.concurrency_matrix(ps)
        if sweep and ps in (1, 16):
            results["sweep"] += bench.sweep(ps)
    if staging:
        results["staging"] += bench.staging_sweep(16)
        results["sizes"] += bench.size_sweep(16)


def bench_mamba(results: dict) -> None:
    """Hybrid (Qwen3-Next-like) Mamba states: 36 layers, conv [8192, 3], SSM [32, 128, 128]."""
    layers, slots, n, host_n = 36, 24, 8, 16
    conv_shape, ssm_shape = (8192, 3), (32, 128, 128)
    dtype = torch.float32
    conv = randomize(torch.empty(layers, slots, *conv_shape, dtype=dtype, device="cuda"))
    ssm = randomize(torch.empty(layers, slots, *ssm_shape, dtype=dtype, device="cuda"))
    conv_bytes = layers * 8192 * 3 * 4
    ssm_bytes = layers * 32 * 128 * 128 * 4
    page = conv_bytes + ssm_bytes
    buf = empty_bytes(host_n * page, "cpu", pin=True)
    rows = buf.view(host_n, page)
    host_conv = rows[:, :conv_bytes].view(dtype).view(host_n, layers, *conv_shape)
    host_ssm = rows[:, conv_bytes:].view(dtype).view(host_n, layers, *ssm_shape)
    s_idx = pinned_index(torch.randperm(slots)[:n])
    h_idx = pinned_index(torch.randperm(host_n)[:n])
    nbytes = n * page
    print(
        f"== hybrid mamba states: {page / 1e6:.1f} MB per slot, {nbytes / GB:.2f} GB per transfer",
        flush=True,
    )
    dev_flat = ssm.view(-1).view(torch.uint8)[:nbytes]
    row = {"layout": "hybrid mamba", "slots": n, "bytes": nbytes}
    row["memcpy_d2h"] = gbps(nbytes, time_ms(copy_of(buf[:nbytes], dev_flat), 7))
    row["memcpy_h2d"] = gbps(nbytes, time_ms(copy_of(dev_flat, buf[:nbytes]), 7))
    to_host = (conv, ssm, host_conv, host_ssm, s_idx, h_idx)
    to_device = (host_conv, host_ssm, conv, ssm, h_idx, s_idx)
    for key, backend in (("triton", "triton"), ("copy_engine", "copy_engine"), ("auto", None)):
        fn = partial(K.mamba_states_to_host, *to_host, backend=backend)
        row[f"{key}_d2h"] = gbps(nbytes, time_ms(fn, 7))
        fn = partial(K.mamba_states_to_device, *to_device, backend=backend)
        row[f"{key}_h2d"] = gbps(nbytes, time_ms(fn, 7))
    row["naive_d2h"] = gbps(nbytes, time_ms(partial(ref.mamba_states_to_host_ref, *to_host), 2, 1))
    row["naive_h2d"] = gbps(
        nbytes, time_ms(partial(ref.mamba_states_to_device_ref, *to_device), 2, 1)
    )
    results["mamba"].append(row)
    show(row)


def masked_index_select(dst, src, dst_indices, step_indices) -> None:
    """The baseline: a boolean mask, its nonzero (a host sync), index_select and index_copy."""
    mask = step_indices >= 0
    req = mask.nonzero().squeeze(1)
    picked = src.index_select(1, req)
    rows = torch.arange(req.numel(), device=src.device)
    picked = picked[:, rows, step_indices.index_select(0, req)]
    dst.index_copy_(1, dst_indices.index_select(0, req), picked)


def bench_scatters(results: dict, requests: int, ssm_state: tuple[int, ...]) -> None:
    layers, slots, steps = 36, 2 * requests + 64, 4
    dst_idx = torch.randperm(slots)[:requests].cuda()
    step_idx = torch.randint(-1, steps, (requests,)).cuda()
    f32, bf16 = torch.float32, torch.bfloat16
    ssm_dst = randomize(torch.empty(layers, slots, *ssm_state, dtype=f32, device="cuda"))
    ssm_src = randomize(torch.empty(layers, requests, steps, *ssm_state, dtype=f32, device="cuda"))
    state_name = "mamba state [" + ",".join(map(str, ssm_state)) + "] fp32"
    cases = [(state_name, "dense", K.fused_mamba_state_scatter_with_mask, ssm_dst, ssm_src)]
    conv_dim, kernel = 2048, 4
    conv_dst = randomize(
        torch.empty(layers, slots, conv_dim, kernel - 1, dtype=bf16, device="cuda")
    )
    for layout in (K.ConvWindowLayout.DENSE, K.ConvWindowLayout.DEDUPLICATED):
        buf = K.ConvWindowBuffer.allocate(
            layers, requests, steps, conv_dim, kernel, bf16, "cuda", layout
        )
        randomize(buf.storage)
        name = f"conv window [{conv_dim},{kernel - 1}] bf16"
        cases.append(
            (name, layout.value, K.fused_conv_window_scatter_with_mask, conv_dst, buf.view)
        )
    writing = int((step_idx >= 0).sum())
    print(
        f"== spec-decode scatters: {layers} layers, {requests} requests ({writing} writing), "
        f"{steps} draft tokens",
        flush=True,
    )
    for name, source, fused, dst, src in cases:
        args = (dst, src, dst_idx, step_idx)
        a, b = dst.clone(), dst.clone()
        fused(a, src, dst_idx, step_idx)
        masked_index_select(b, src, dst_idx, step_idx)
        fused_ms = time_ms(partial(fused, *args), 20, 3)
        base_ms = time_ms(partial(masked_index_select, *args), 20, 3)
        row = {
            "kernel": name,
            "requests": requests,
            "source": source,
            "fused_us": fused_ms * 1e3,
            "mask_index_select_us": base_ms * 1e3,
            "speedup": base_ms / fused_ms,
            "same_bytes_as_baseline": torch.equal(bits(a), bits(b)),
        }
        results["scatter"].append(row)
        show(row)


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


def machine() -> dict:
    info = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
    }
    try:
        from hicache.kernels.copy_engine import batched_copy_available

        info["batched_dma"] = batched_copy_available()
    except Exception as exc:  # the report says why rather than failing
        info["batched_dma"] = f"unavailable: {exc}"
    try:
        query = "driver_version,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max"
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
        info["nvidia_smi"] = out
    except (OSError, subprocess.SubprocessError):
        info["nvidia_smi"] = "unavailable"
    return info


def pct(x: float, base: float) -> str:
    return f"{x:.1f} ({100 * x / base:.0f}%)"


def table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def print_tables(results: dict) -> None:
    m = results["machine"]
    print(f"\n### {m['gpu']}, {m['date_utc']}, torch {m['torch']}, triton {m['triton']}")
    print(f"nvidia-smi (driver, PCIe gen now, width, gen max): {m['nvidia_smi']}")
    print(f"cudaMemcpyBatchAsync for staged DMAs: {m.get('batched_dma')}")
    methods = ("triton", "copy_engine", "staged", "auto", "naive")
    rows = []
    for r in results["kv"]:
        if r["hosts"] != "random":
            continue
        for d in ("d2h", "h2d"):
            base = r[f"memcpy_{d}"]
            rows.append(
                [r["layout"], r["page_size"], d, f"{base:.1f}"]
                + [pct(r[f"{b}_{d}"], base) for b in methods[:3]]
                + [pct(r[f"auto_{d}"], base) + f" {r[f'default_{d}_is']}"]
                + [pct(r[f"naive_{d}"], base)]
            )
    table(
        "KV page transfers, random host pages, GB/s (percent of a pinned memcpy of the same "
        "bytes, same run)",
        [
            "layout",
            "page",
            "dir",
            "memcpy",
            "triton (UVA)",
            "copy engine",
            "staged",
            "default (picks)",
            "naive torch",
        ],
        rows,
    )
    rows = []
    for r in results["kv"]:
        if r["hosts"] == "random":
            continue
        for d in ("d2h", "h2d"):
            base = r[f"memcpy_{d}"]
            default = pct(r[f"auto_{d}"], base) + f" {r[f'default_{d}_is']}"
            rows.append(
                [
                    r["layout"],
                    r["page_size"],
                    d,
                    f"{base:.1f}",
                    pct(r[f"staged_{d}"], base),
                    default,
                ]
            )
    table(
        "KV page transfers, host pages in order, GB/s",
        ["layout", "page", "dir", "memcpy", "staged", "default (picks)"],
        rows,
    )

    def two_way(r: dict, key: str) -> str:
        if f"{key}_both" not in r:
            return "-"
        return pct(r[f"{key}_both"], r["memcpy_both"]) + (
            f" [{r[f'{key}_both_d2h']:.0f} + {r[f'{key}_both_h2d']:.0f}]"
        )

    rows = [
        [r["layout"], r["page_size"], r["hosts"], f"{r['memcpy_both']:.1f}"]
        + [two_way(r, b) for b in ("triton", "copy_engine", "staged", "auto")]
        + [f"{r['default_d2h_is']} / {r['default_h2d_is']}"]
        for r in results["kv"]
    ]
    table(
        "A backup and a load at once (two streams), total GB/s [backup + load]",
        [
            "layout",
            "page",
            "host pages",
            "memcpy both ways",
            "triton",
            "copy engine",
            "staged",
            "default",
            "default picks",
        ],
        rows,
    )
    rows = [
        [r["layout"], r["page_size"]]
        + [f"{r[f'{b}_{d}_issue_ms']:.2f}" for d in ("d2h", "h2d") for b in ("triton", "staged")]
        for r in results["kv"]
        if "staged_d2h_issue_ms" in r
    ]
    table(
        "Host time to issue one transfer (random host pages), ms",
        ["layout", "page", "d2h triton", "d2h staged", "h2d triton", "h2d staged"],
        rows,
    )
    if results["staging"]:
        rows = [
            [r["page_size"], r["hosts"], r["chunk_mib"], r["slots"], r["batched"]]
            + [f"{r[k]:.1f}" for k in ("staged_both", "staged_both_d2h", "staged_both_h2d")]
            for r in results["staging"]
        ]
        table(
            "Staging ring (llama3-8b), backup and load at once, GB/s",
            ["page", "host pages", "chunk MiB", "slots", "batched DMA", "total", "backup", "load"],
            rows,
        )
    if results["sizes"]:
        rows = [
            [r["page_size"], f"{r['bytes'] / 2**20:.0f} MiB"]
            + [f"{r[f'{b}_{d}']:.1f}" for d in ("d2h", "h2d", "both") for b in ("triton", "staged")]
            for r in results["sizes"]
        ]
        table(
            "Transfer size (llama3-8b, host pages in order), GB/s",
            [
                "page",
                "size",
                "d2h triton",
                "d2h staged",
                "h2d triton",
                "h2d staged",
                "both triton",
                "both staged",
            ],
            rows,
        )
    if results["matrix"]:
        rows = [
            [r["layout"], r["page_size"], r["backup"], r["load"]]
            + [f"{r[k]:.1f}" for k in ("pair_both", "pair_both_d2h", "pair_both_h2d")]
            for r in results["matrix"]
        ]
        table(
            "Backup and load methods mixed, run at once, GB/s",
            ["layout", "page", "backup", "load", "total", "backup", "load"],
            rows,
        )
    rows = []
    for r in results["mamba"]:
        for d in ("d2h", "h2d"):
            base = r[f"memcpy_{d}"]
            rows.append(
                [f"{r['slots']} ({r['bytes'] / GB:.2f} GB)", d, f"{base:.1f}"]
                + [pct(r[f"{b}_{d}"], base) for b in ("triton", "copy_engine", "auto", "naive")]
            )
    table(
        "Mamba state transfers (hybrid), GB/s",
        ["slots", "dir", "memcpy", "triton", "copy engine", "default", "naive torch"],
        rows,
    )
    rows = [
        [
            r["kernel"],
            r["requests"],
            r["source"],
            f"{r['fused_us']:.1f}",
            f"{r['mask_index_select_us']:.1f}",
            f"{r['speedup']:.1f}x",
            r["same_bytes_as_baseline"],
        ]
        for r in results["scatter"]
    ]
    table(
        "Speculative-decoding scatters, microseconds (median of 20)",
        ["kernel", "requests", "source", "fused", "mask + index_select", "speedup", "same bytes"],
        rows,
    )
    if results["sweep"]:
        rows = [
            [r["page_size"], r["tile_bytes"], r["programs_per_sm"], r["num_warps"]]
            + [f"{r[k]:.1f}" for k in ("d2h", "h2d", "both")]
            for r in results["sweep"]
        ]
        table(
            "Triton launch sweep (Llama layout), GB/s",
            ["page", "tile bytes", "programs/SM", "warps", "d2h", "h2d", "both"],
            rows,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=pathlib.Path, default=None, help="folder for kernels_gpu.json"
    )
    parser.add_argument("--checks-only", action="store_true", help="run part 1 only")
    parser.add_argument("--sweep", action="store_true", help="add the launch-parameter sweep")
    parser.add_argument(
        "--matrix", action="store_true", help="add the mixed backup/load method matrix"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this script measures a GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    results: dict = {
        "machine": machine(),
        "kv": [],
        "mamba": [],
        "scatter": [],
        "sweep": [],
        "matrix": [],
        "staging": [],
        "sizes": [],
    }
    print(json.dumps(results["machine"]), flush=True)
    checks = run_checks("cuda")
    results["checks"] = checks.rows
    if not args.checks_only:
        sections = [
            partial(
                bench_kv, results, "llama3-8b", 32, 8, 128, 8192, args.sweep, args.matrix, True
            ),
            partial(bench_kv, results, "hybrid full-attn", 12, 2, 256, 32768, False, False, False),
            partial(bench_mamba, results),
            partial(bench_scatters, results, 32, (8, 128, 128)),
            partial(bench_scatters, results, 256, (8, 64, 64)),
        ]
        for section in sections:
            try:
                section()
            except Exception:
                traceback.print_exc()
            torch.cuda.empty_cache()
    if args.out is not None:  # before the tables, so that a table bug loses no numbers
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernels_gpu.json").write_text(json.dumps(results, indent=1))
    if not args.checks_only:
        print_tables(results)
    print(f"\nchecks: {len(checks.rows) - checks.failures}/{len(checks.rows)} passed")
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.exit(main())
