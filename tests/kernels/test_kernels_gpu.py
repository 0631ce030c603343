"""The transfer kernels on a real GPU: run with ``pytest -m gpu`` on a CUDA machine.

The checks themselves live in benchmarks/gpu_kernels.py (one implementation, used by the
benchmark before it measures anything); here they run under pytest.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernels.py"


def _gpu_kernels_script():
    spec = importlib.util.spec_from_file_location("gpu_kernels", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_kernel_matches_the_reference_on_cuda() -> None:
    torch.manual_seed(1)
    checks = _gpu_kernels_script().run_checks("cuda")
    failed = [row for row in checks.rows if not row["ok"]]
    assert not failed, failed


def test_default_backend_round_trips_pinned_pages() -> None:
    import hicache.kernels as kernels

    device_kv = torch.randn(2, 4, 256, 8, 128, device="cuda").bfloat16()
    host_kv = torch.empty(8, 2, 4, 16, 8, 128, dtype=torch.bfloat16).pin_memory()
    pages, host_pages = torch.tensor([3, 9, 15]), torch.tensor([7, 0, 4])
    kernels.kv_pages_to_host(device_kv, host_kv, pages, host_pages, 16)
    poison = torch.randn_like(device_kv)
    target = poison.clone()
    kernels.kv_pages_to_device(host_kv, target, host_pages, pages, 16)
    torch.cuda.synchronize()
    paged = target.view(2, 4, 16, 16, 8, 128)
    original = device_kv.view(2, 4, 16, 16, 8, 128)
    assert torch.equal(paged[:, :, pages.cuda()], original[:, :, pages.cuda()])
    others = torch.ones(16, dtype=torch.bool)
    others[pages] = False
    untouched = poison.view(2, 4, 16, 16, 8, 128)[:, :, others.cuda()]
    assert torch.equal(paged[:, :, others.cuda()], untouched)


def test_large_transfer_of_consecutive_host_pages_is_staged_and_exact() -> None:
    """128 MiB of pages whose host ids are consecutive: the default dispatch stages it."""
    import hicache.kernels as kernels

    device_kv = torch.randn(2, 8, 4096, 8, 128, device="cuda").bfloat16()  # 32 KiB/token
    pages = torch.randperm(256)[:128]  # pages of 16 tokens: 512 KiB each, 64 MiB
    host_kv = torch.empty(256, 2, 8, 16, 8, 128, dtype=torch.bfloat16).pin_memory()
    host_pages = torch.arange(64, 192)
    tuning = kernels.TransferTuning(staged_min_transfer_bytes=32 << 20)
    args = (device_kv, host_kv, pages, host_pages, 16)
    assert kernels.kv_transfer_backend(*args, to_host=True, tuning=tuning) is (
        kernels.Backend.STAGED
    )
    kernels.kv_pages_to_host(*args, tuning=tuning)
    target = torch.randn_like(device_kv)
    back = torch.randperm(256)[:128]
    kernels.kv_pages_to_device(host_kv, target, host_pages, back, 16, tuning=tuning)
    torch.cuda.synchronize()
    paged = target.view(2, 8, 256, 16, 8, 128)
    original = device_kv.view(2, 8, 256, 16, 8, 128)
    assert torch.equal(paged[:, :, back.cuda()], original[:, :, pages.cuda()])


def test_warming_a_prepared_transfer_moves_nothing_and_later_copies_are_exact() -> None:
    """``PreparedTransfer.warm`` (what a sidecar runs when an engine registers) launches the
    kernels of both directions over rows that name no item: neither side changes, and the
    copies that follow move the right bytes."""
    from hicache.kernels import PreparedTransfer

    device_kv = torch.randn(2, 4, 256, 8, 128, device="cuda").bfloat16()
    host_kv = torch.randn(8, 2, 4, 16, 8, 128).bfloat16().pin_memory()
    before_dev, before_host = device_kv.clone(), host_kv.clone()
    load = PreparedTransfer.kv(device_kv, host_kv, 16, to_host=False, backend="triton")
    backup = PreparedTransfer.kv(device_kv, host_kv, 16, to_host=True, backend="triton")
    for plan in (load, backup):
        plan.warm()
    torch.cuda.synchronize()
    assert torch.equal(device_kv, before_dev) and torch.equal(host_kv, before_host)
    backup([3, 9], [7, 0])  # device items, then host pages
    load([15], [7])
    torch.cuda.synchronize()
    paged = device_kv.view(2, 4, 16, 16, 8, 128)
    assert torch.equal(paged[:, :, 15], before_dev.view(2, 4, 16, 16, 8, 128)[:, :, 3])
    assert torch.equal(host_kv[0].cuda(), paged[:, :, 9])


def test_segment_copies_queued_behind_a_busy_stream_read_their_own_indices() -> None:
    """A segment copy's kernel reads its block and page ids from a pinned buffer, which a
    later copy writes again only after the earlier kernel ran: thirty copies queued behind
    a stream held busy (more than there are buffers) each move their own pages."""
    from hicache.kernels.segments import Segment, SegmentCopy

    blocks, row = 64, 4096
    tensors = [torch.randint(0, 256, (blocks, row), dtype=torch.uint8, device="cuda")
               for _ in range(3)]  # fmt: skip
    segs = [Segment(t, 0, row, i * row) for i, t in enumerate(tensors)]
    pages = torch.zeros(blocks, 3 * row, dtype=torch.uint8).pin_memory()
    copy = SegmentCopy(segs, pages)
    events = []
    torch.cuda._sleep(200_000_000)  # the current stream busy for a while
    for i in range(30):
        events.append(copy.start([i, i + 30], [63 - i, 33 - i], to_host=True))
    for ev in events:
        ev.synchronize()
    host = pages.cuda().view(blocks, 3, row)
    for i in range(30):
        for b, p in ((i, 63 - i), (i + 30, 33 - i)):
            assert all(torch.equal(host[p, k], tensors[k][b]) for k in range(3)), (i, b, p)


def test_prepared_copies_queued_behind_a_busy_stream_read_their_own_indices() -> None:
    """The same for a prepared transfer (the load-back's kernel): forty loads of one page
    each, queued behind a busy stream, land each in its own device page."""
    from hicache.kernels import PreparedTransfer

    host_kv = torch.randn(48, 2, 2, 16, 4, 64).bfloat16().pin_memory()
    device_kv = torch.zeros(2, 2, 48 * 16, 4, 64, device="cuda").bfloat16()
    load = PreparedTransfer.kv(device_kv, host_kv, 16, to_host=False, backend="triton")
    torch.cuda._sleep(200_000_000)
    for i in range(40):
        load([i], [47 - i])
    torch.cuda.synchronize()
    paged = device_kv.view(2, 2, 48, 16, 4, 64)
    for i in range(40):
        assert torch.equal(paged[:, :, i].cpu(), host_kv[47 - i]), i


def _variants(kernel) -> int:
    """How many variants of a Triton kernel are compiled (or loaded) in this process."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


def test_warmed_prepared_transfers_launch_by_address_and_compile_nothing_more() -> None:
    """After ``warm()``, KV pages and Mamba states move both ways, in copies of odd and
    even lengths, through the variant the warm-up captured (launched by address on a raw
    stream: ``RowLauncher.launch_addrs``), compiling nothing more, the bytes exact; and a
    copy on another raw stream than the caller's runs there."""
    from hicache.kernels import PreparedTransfer
    from hicache.kernels.triton_transfer import _copy_rows_kernel

    gen = torch.Generator().manual_seed(5)
    device_kv = torch.randn(2, 3, 64 * 16, 4, 64, generator=gen).bfloat16().cuda()
    host_kv = torch.zeros(64, 2, 3, 16, 4, 64, dtype=torch.bfloat16).pin_memory()
    conv = torch.randn(3, 40, 6, 5, generator=gen).cuda()
    ssm = torch.randn(3, 40, 4, 7, generator=gen).cuda()
    host_conv = torch.zeros(40, 3, 6, 5).pin_memory()
    host_ssm = torch.zeros(40, 3, 4, 7).pin_memory()
    plans = {
        "kv": [PreparedTransfer.kv(device_kv, host_kv, 16, to_host=t) for t in (True, False)],
        "states": [
            PreparedTransfer.states(conv, ssm, host_conv, host_ssm, to_host=t)
            for t in (True, False)
        ],
    }
    for backup, load in plans.values():
        backup.warm()
        load.warm()
    torch.cuda.synchronize()
    before = _variants(_copy_rows_kernel)
    other = torch.cuda.Stream()
    for n in (1, 2, 3, 7, 19):  # from items 0-19 through host pages into items 20-39
        src = torch.randperm(20, generator=gen)[:n].tolist()
        mid = torch.randperm(40, generator=gen)[:n].tolist()
        dst = (20 + torch.randperm(20, generator=gen)[:n]).tolist()
        for backup, load in plans.values():
            backup(src, mid)
            if n % 2:  # the load on another stream, after the backup
                other.wait_stream(torch.cuda.current_stream())
                load(dst, mid, other.cuda_stream)
                torch.cuda.current_stream().wait_stream(other)
            else:
                load(dst, mid)
        torch.cuda.synchronize()
        paged = device_kv.view(2, 3, 64, 16, 4, 64)
        for s, d in zip(src, dst):
            assert torch.equal(paged[:, :, d], paged[:, :, s]), (n, s, d)
            assert torch.equal(conv[:, d], conv[:, s]) and torch.equal(ssm[:, d], ssm[:, s])
    assert _variants(_copy_rows_kernel) == before
    for backup, load in plans.values():
        assert all(launcher._runner for launcher in backup._launchers + load._launchers)
