"""The host pool: page-first layout, sizing by weights, free list, residency."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from hicache.controller.config import ControllerConfig, HostPinning
from hicache.controller.store.host_pool import FRAME_BYTES, HostPool, host_page_counts
from hicache.kernels import reference
from hicache.types import ComponentType, ConfigError, SlotStateError
from tests.support.controller import PAGE, Engine, hybrid_layout

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA


def test_page_counts_follow_the_weights_and_fit_the_budget():
    layout = hybrid_layout()
    cfg = ControllerConfig(host_pool_bytes=1 << 20, host_weight_swa=0.5, host_weight_mamba=0.25)
    counts = host_page_counts(layout, PAGE, cfg)
    assert counts[SWA] == pytest.approx(counts[FULL] * 0.5, abs=1)
    assert counts[MAMBA] == pytest.approx(counts[FULL] * 0.25, abs=1)
    pool = HostPool(layout, PAGE, cfg)
    payload = sum(p.num_pages * p.page_bytes for p in pool.components.values())
    assert (1 << 20) - 2 * sum(layout.page_bytes(c, PAGE) for c in layout.components) < payload
    assert payload <= 1 << 20
    # Frames (LMDB header room, 128-byte alignment) come on top, and are reported.
    frames = sum(p.num_pages * (p.row_bytes - p.page_bytes) for p in pool.components.values())
    assert pool.resident_bytes == payload + frames
    assert all(p.row_bytes % FRAME_BYTES == 0 for p in pool.components.values())


def test_too_small_a_budget_names_the_component_and_the_minimum():
    with pytest.raises(ConfigError, match=r"MAMBA.*raise host_pool_bytes"):
        host_page_counts(hybrid_layout(), PAGE, ControllerConfig(host_pool_bytes=1000))


def test_kv_pages_are_one_contiguous_run_of_bytes_in_the_reference_layout():
    layout = hybrid_layout()
    pool = HostPool(layout, PAGE, ControllerConfig(host_pool_bytes=1 << 18))
    kv = pool.kv(FULL)
    assert kv.shape[1:] == (2, 2, PAGE, 2, 8) and kv.dtype == layout.dtype
    kv[3] = torch.arange(kv[3].numel(), dtype=torch.float32).view(kv[3].shape).to(kv.dtype)
    row = pool[FULL].row(3)
    assert row.nbytes == layout.page_bytes(FULL, PAGE)
    assert np.array_equal(row, kv[3].contiguous().view(torch.uint8).reshape(-1).numpy())
    assert (kv.data_ptr() - pool[FULL].buffer.data_ptr()) % FRAME_BYTES == 0
    assert kv.stride(0) * 2 == pool[FULL].row_bytes
    frame = pool[FULL].frame(3)
    assert np.shares_memory(frame, row) and np.array_equal(frame[-row.nbytes :], row)


def test_mamba_pages_hold_conv_then_ssm_bytes():
    layout = hybrid_layout()
    pool = HostPool(layout, PAGE, ControllerConfig(host_pool_bytes=1 << 18))
    conv, ssm = pool.conv(), pool.ssm()
    assert conv.shape[1:] == (1, 6, 3) and ssm.shape[1:] == (1, 2, 3, 4)
    conv[2] = 1.0
    ssm[2] = 2.0
    row = pool[MAMBA].row(2).view(np.float32)
    n_conv = math.prod(conv.shape[1:])
    assert np.all(row[:n_conv] == 1.0) and np.all(row[n_conv:] == 2.0)
    assert row.size == n_conv + math.prod(ssm.shape[1:])


def test_reference_kernels_round_trip_through_the_views():
    layout = hybrid_layout()
    engine = Engine(layout)
    chain = engine.write_chain(range(3 * PAGE), mamba_every=3)
    before = engine.snapshot(chain)
    pool = HostPool(layout, PAGE, ControllerConfig(host_pool_bytes=1 << 18))
    dev = torch.tensor(chain.full_pages)
    host = torch.tensor([5, 0, 7])
    reference.kv_pages_to_host_ref(engine.pools.full.buffer, pool.kv(FULL), dev, host, PAGE)
    slot = torch.tensor([chain.mamba_slots[2]])
    mamba = engine.pools.mamba
    reference.mamba_states_to_host_ref(
        mamba.conv, mamba.ssm, pool.conv(), pool.ssm(), slot, torch.tensor([1])
    )
    engine.scribble(chain)
    reference.kv_pages_to_device_ref(pool.kv(FULL), engine.pools.full.buffer, host, dev, PAGE)
    reference.mamba_states_to_device_ref(
        pool.conv(), pool.ssm(), mamba.conv, mamba.ssm, torch.tensor([1]), slot
    )
    after = engine.snapshot(chain)
    for key in after:
        if key[0] is not SWA:
            assert after[key] == before[key], key


def test_alloc_free_and_double_free():
    pool = HostPool(hybrid_layout(), PAGE, ControllerConfig(host_pool_bytes=1 << 16))
    full = pool[FULL]
    pages = [full.alloc() for _ in range(full.num_pages)]
    assert full.alloc() is None and full.free_pages == 0
    assert pool.used_bytes >= full.num_pages * full.page_bytes
    full.free(pages[0])
    with pytest.raises(SlotStateError):
        full.free(pages[0])
    with pytest.raises(SlotStateError):
        full.free(full.num_pages)
    full.check_invariants(set(pages[1:]))
    with pytest.raises(AssertionError, match="leaked"):
        full.check_invariants(set(pages[2:]))


def test_residency_reports_pinned_apart_from_resident():
    pool = HostPool(hybrid_layout(), PAGE, ControllerConfig(host_pool_bytes=1 << 16))
    stats = pool.stats()
    assert stats["resident_bytes"] == pool.resident_bytes > 0
    expected_pinned = pool.resident_bytes if torch.cuda.is_available() else 0
    assert stats["pinned_bytes"] == expected_pinned
    assert stats["used_bytes"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works with CUDA")
def test_pinned_policy_without_cuda_is_a_clear_error():
    with pytest.raises(ConfigError, match="pin"):
        HostPool(
            hybrid_layout(),
            PAGE,
            ControllerConfig(host_pool_bytes=1 << 16, host_pinning=HostPinning.PINNED),
        )


def test_shared_pages_are_memfd_memory_that_populate_faults_in_whole():
    from hicache.controller.store.host_pool import SharedPages, populate

    pages, row = 96, 1 << 20  # 96 MiB: several populate chunks
    shared = SharedPages("test", pages, row, HostPinning.PAGEABLE)
    assert os.fstat(shared.fd).st_blocks == 0, "nothing faulted in before the populate"
    populate(shared.buffer.data_ptr(), pages * row)
    assert os.fstat(shared.fd).st_blocks * 512 >= pages * row
    assert not shared.buffer.any(), "fresh pages read as zeros"
    # The same memory, seen through the descriptor (what an engine maps).
    shared.buffer[3, 7] = 42
    assert os.pread(shared.fd, 1, 3 * row + 7) == b"\x2a"


def _resident_pages(address: int, nbytes: int) -> int:
    """Pages of ``[address, address + nbytes)`` (rounded out to whole pages) in memory."""
    import ctypes
    import mmap

    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    n = -(-(address + nbytes - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(start, n * mmap.PAGESIZE, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec)


@pytest.mark.parametrize("shared", [False, True])
def test_a_prefaulted_pool_is_resident_before_its_first_use(shared):
    layout = hybrid_layout()
    cfg = ControllerConfig(host_pool_bytes=8 << 20, host_shared=shared, host_populate=True)
    for p in HostPool(layout, PAGE, cfg).components.values():
        nbytes = p.num_pages * p.row_bytes
        # Private memory need not start on a page boundary: all but that first page.
        assert _resident_pages(p.buffer.data_ptr(), nbytes) * 4096 >= nbytes - 4096
    lazy = HostPool(layout, PAGE, ControllerConfig(host_pool_bytes=8 << 20, host_shared=True))
    p = lazy[FULL]
    assert _resident_pages(p.buffer.data_ptr(), p.num_pages * p.row_bytes) == 0


def test_a_shared_pool_serves_as_a_private_one():
    layout = hybrid_layout()
    cfg = ControllerConfig(host_pool_bytes=1 << 20, host_shared=True)
    pool, private = HostPool(layout, PAGE, cfg), HostPool(layout, PAGE, ControllerConfig(1 << 20))
    for comp, p in pool.components.items():
        assert p.shared is not None and p.num_pages == private[comp].num_pages
        assert os.fstat(p.shared.fd).st_size >= p.num_pages * p.row_bytes
    assert pool.kv(FULL).shape == private.kv(FULL).shape
    assert pool.ssm().shape == private.ssm().shape
