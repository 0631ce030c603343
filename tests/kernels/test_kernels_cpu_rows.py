"""The CPU row path (``Backend.CPU``, the CPU default): memmove runs or strided item copies.

It must move exactly the bytes the torch reference moves (bit for bit, poisoned outputs,
rows outside the transfer untouched), in one thread and split across threads, for KV
pages and Mamba states, through the functions and through ``PreparedTransfer``; and it
must merge rows that are contiguous on both sides into one memmove.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache import kernels
from hicache.kernels import Backend, PreparedTransfer, TransferTuning, reference
from hicache.kernels.cpu_rows import copy_rows_cpu, row_runs
from hicache.kernels.geometry import kv_row_copy
from tests.kernels.test_kernels_transfer import MambaHostPages, host_pages_view
from tests.support.bits import bits, randomize

LAYERS, HEADS, DIM = 3, 2, 8
# Every transfer split across two threads, however small: the threaded path under test.
THREADED = TransferTuning(cpu_copy_threads=2, cpu_parallel_min_bytes=0)


@pytest.mark.parametrize("tuning", [TransferTuning(cpu_copy_threads=1), THREADED])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_pages_match_the_reference_both_ways(
    tuning: TransferTuning, dtype: torch.dtype, page_size: int
) -> None:
    gen = torch.Generator().manual_seed(page_size + dtype.itemsize)
    device_kv = randomize(torch.empty(2, LAYERS, 12 * page_size, HEADS, DIM, dtype=dtype), gen)
    host_kv = randomize(host_pages_view(10, (2, LAYERS, page_size, HEADS, DIM), dtype), gen)
    # A run of consecutive device pages into consecutive host pages, and scattered ones.
    dev = torch.tensor([2, 3, 4, 9, 0])
    host = torch.tensor([5, 6, 7, 1, 3])

    want_host, got_host = host_kv.clone(), host_kv.clone()
    reference.kv_pages_to_host_ref(device_kv, want_host, dev, host, page_size)
    kernels.kv_pages_to_host(device_kv, got_host, dev, host, page_size, tuning=tuning)
    assert torch.equal(bits(got_host), bits(want_host))

    want_dev, got_dev = device_kv.clone(), device_kv.clone()
    reference.kv_pages_to_device_ref(host_kv, want_dev, host, dev, page_size)
    kernels.kv_pages_to_device(host_kv, got_dev, host, dev, page_size, tuning=tuning)
    assert torch.equal(bits(got_dev), bits(want_dev))


@pytest.mark.parametrize("tuning", [TransferTuning(cpu_copy_threads=1), THREADED])
def test_mamba_states_match_the_reference_both_ways(tuning: TransferTuning) -> None:
    gen = torch.Generator().manual_seed(3)
    conv = randomize(torch.empty(LAYERS, 9, 6, 3), gen)
    ssm = randomize(torch.empty(LAYERS, 9, 4, 5), gen)
    pages = MambaHostPages(7, LAYERS, (6, 3), (4, 5), torch.float32)
    randomize(pages.buffer, gen)
    slots, host = torch.tensor([8, 0, 3]), torch.tensor([2, 6, 0])

    want, got = pages.buffer.clone(), pages.buffer.clone()
    reference.mamba_states_to_host_ref(conv, ssm, *pages.views(want), slots, host)
    kernels.mamba_states_to_host(conv, ssm, *pages.views(got), slots, host, tuning=tuning)
    assert torch.equal(got, want)

    want_c, want_s, got_c, got_s = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    reference.mamba_states_to_device_ref(*pages.views(pages.buffer), want_c, want_s, host, slots)
    kernels.mamba_states_to_device(
        *pages.views(pages.buffer), got_c, got_s, host, slots, tuning=tuning
    )
    assert torch.equal(bits(got_c), bits(want_c)) and torch.equal(bits(got_s), bits(want_s))


def test_prepared_transfer_on_cpu_takes_the_row_path_and_matches() -> None:
    gen = torch.Generator().manual_seed(11)
    device_kv = randomize(torch.empty(2, LAYERS, 8 * 4, HEADS, DIM), gen)
    host_kv = randomize(host_pages_view(6, (2, LAYERS, 4, HEADS, DIM), torch.float32), gen)
    dev, host = [1, 7, 2], [0, 5, 4]
    to_host = PreparedTransfer.kv(device_kv, host_kv, 4, to_host=True, tuning=THREADED)
    assert to_host._choose(to_host.copies[0], np.array([dev, host])) is Backend.CPU
    want = host_kv.clone()
    reference.kv_pages_to_host_ref(device_kv, want, torch.tensor(dev), torch.tensor(host), 4)
    to_host(dev, host)
    assert torch.equal(bits(host_kv), bits(want))


def test_rows_contiguous_on_both_sides_are_one_memmove() -> None:
    """A pool of one page keeps its 2 × layers rows back to back, as a host page does:
    the page is then one memmove. Pages of a larger pool are one memmove per row."""
    one_page = torch.zeros(2, LAYERS, 4, HEADS, DIM)
    host_kv = host_pages_view(3, (2, LAYERS, 4, HEADS, DIM), torch.float32)
    copy = kv_row_copy(one_page, host_kv, torch.tensor([0]), torch.tensor([0]), 4, to_host=True)
    _, _, nbytes = row_runs(copy, np.array([0]), np.array([2]))
    assert nbytes.tolist() == [2 * LAYERS * copy.row_bytes]
    pool = torch.zeros(2, LAYERS, 8 * 4, HEADS, DIM)
    copy = kv_row_copy(pool, host_kv, torch.tensor([0]), torch.tensor([0]), 4, to_host=True)
    _, _, nbytes = row_runs(copy, np.array([2, 3, 4]), np.array([0, 1, 2]))
    assert nbytes.tolist() == [copy.row_bytes] * (3 * 2 * LAYERS)


def test_no_rows_move_nothing() -> None:
    device_kv = torch.ones(2, LAYERS, 8, HEADS, DIM)
    host_kv = host_pages_view(2, (2, LAYERS, 4, HEADS, DIM), torch.float32).zero_()
    copy = kv_row_copy(device_kv, host_kv, torch.tensor([0]), torch.tensor([0]), 4, to_host=True)
    assert copy_rows_cpu(copy, np.empty(0, np.int64), np.empty(0, np.int64)) == 0
    assert not host_kv.any()


@pytest.mark.parametrize("layers", [1, LAYERS])
def test_dense_items_take_memmove_runs_and_others_strided_copies(
    layers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-layer Mamba state is one dense block on both sides: consecutive items merge
    into memmove runs (split across threads). With several layers an item is rows far
    apart in the engine's pool, copied as one strided view. Both match the reference."""
    from hicache.kernels import cpu_rows

    paths: list[str] = []
    strided, runs = cpu_rows.copy_items_strided, cpu_rows.move_runs
    monkeypatch.setattr(
        cpu_rows, "copy_items_strided", lambda *a, **k: paths.append("strided") or strided(*a, **k)
    )
    monkeypatch.setattr(
        cpu_rows, "move_runs", lambda *a, **k: paths.append("memmove") or runs(*a, **k)
    )
    gen = torch.Generator().manual_seed(layers)
    conv = randomize(torch.empty(layers, 9, 6, 3), gen)
    ssm = randomize(torch.empty(layers, 9, 4, 5), gen)
    pages = MambaHostPages(7, layers, (6, 3), (4, 5), torch.float32)
    randomize(pages.buffer, gen)
    slots, host = torch.tensor([2, 3, 4, 0]), torch.tensor([1, 2, 3, 6])
    want, got = pages.buffer.clone(), pages.buffer.clone()
    reference.mamba_states_to_host_ref(conv, ssm, *pages.views(want), slots, host)
    kernels.mamba_states_to_host(conv, ssm, *pages.views(got), slots, host, tuning=THREADED)
    assert torch.equal(got, want)
    assert paths == (["memmove"] * 2 if layers == 1 else ["strided"] * 2)


@pytest.mark.parametrize("tuning", [TransferTuning(cpu_copy_threads=1), THREADED])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_consecutive_sources_move_by_runs_into_any_destinations(
    tuning: TransferTuning, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Device pages 3..9 in a shuffled order into scattered host pages, and back from
    host pages 2..8 into scattered device pages: every page moves by runs (neither a
    strided copy per item nor a memmove per row), bit for bit the reference's; with two
    pages outside the runs beside them, those take the other paths, as exactly."""
    from hicache.kernels import cpu_rows

    page_size = 4
    monkeypatch.setattr(cpu_rows, "PIECE_BYTES", 100)  # threaded: a piece per page
    gen = torch.Generator().manual_seed(5)
    device_kv = randomize(torch.empty(2, LAYERS, 14 * page_size, HEADS, DIM, dtype=dtype), gen)
    host_kv = randomize(host_pages_view(12, (2, LAYERS, page_size, HEADS, DIM), dtype), gen)
    shuffled = torch.randperm(7, generator=gen)
    scattered = torch.randperm(12, generator=gen)[:7]

    def store(dev: torch.Tensor, host: torch.Tensor) -> None:
        want, got = host_kv.clone(), host_kv.clone()
        reference.kv_pages_to_host_ref(device_kv, want, dev, host, page_size)
        kernels.kv_pages_to_host(device_kv, got, dev, host, page_size, tuning=tuning)
        assert torch.equal(bits(got), bits(want))

    def load(host: torch.Tensor, dev: torch.Tensor) -> None:
        want, got = device_kv.clone(), device_kv.clone()
        reference.kv_pages_to_device_ref(host_kv, want, host, dev, page_size)
        kernels.kv_pages_to_device(host_kv, got, host, dev, page_size, tuning=tuning)
        assert torch.equal(bits(got), bits(want))

    with monkeypatch.context() as m:
        for name in ("copy_items_strided", "move_runs"):
            m.setattr(cpu_rows, name, lambda *a, **k: pytest.fail("a run took another path"))
        store(shuffled + 3, scattered)  # the sources: device pages 3..9
        load(shuffled + 2, scattered)  # the sources: host pages 2..8
    free_host = [int(p) for p in torch.arange(12) if p not in scattered][:2]
    store(
        torch.cat([torch.tensor([12, 0]), shuffled + 3]),
        torch.cat([torch.tensor(free_host), scattered]),
    )
    load(
        torch.cat([torch.tensor([11, 0]), shuffled + 2]),
        torch.cat([torch.tensor([12, 13]), scattered]),
    )


def test_the_copy_threads_leave_torchs_thread_count_alone() -> None:
    """torch.set_num_threads is process-wide for every thread that starts its first
    parallel op after it: copy threads that set it to 1 made an engine's later threads,
    and the copies those threads asked for, run on one core. A threaded copy on fresh copy
    threads leaves a new thread the count the process had."""
    import threading

    from hicache.kernels import cpu_rows

    def new_threads_count() -> int:
        got: list[int] = []
        t = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
        t.start()
        t.join()
        return got[0]

    before = new_threads_count()
    pool = cpu_rows.copy_pool(cpu_rows._pool_threads + 1)  # fresh threads, started below
    for f in [pool.submit(lambda: None) for _ in range(cpu_rows._pool_threads)]:
        f.result()
    gen = torch.Generator().manual_seed(8)
    device_kv = randomize(torch.empty(2, LAYERS, 12, HEADS, DIM), gen)
    host_kv = randomize(host_pages_view(12, (2, LAYERS, 1, HEADS, DIM), torch.float32), gen)
    dev, host = torch.randperm(12, generator=gen), torch.randperm(12, generator=gen)
    want = host_kv.clone()
    reference.kv_pages_to_host_ref(device_kv, want, dev, host, 1)
    kernels.kv_pages_to_host(device_kv, host_kv, dev, host, 1, tuning=THREADED)
    assert torch.equal(bits(host_kv), bits(want))
    assert new_threads_count() == before
