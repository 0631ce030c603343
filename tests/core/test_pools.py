"""Device pools and their page allocators."""

import numpy as np
import pytest
import torch

from hicache import CacheConfig, ConfigError, DevicePools, ModelLayout
from hicache.pools import PageAllocator
from hicache.types import PoolExhaustedError, SlotStateError


def hybrid_layout() -> ModelLayout:
    return ModelLayout(
        ("full", "swa", "mamba", "full"),
        num_kv_heads=2,
        head_dim=8,
        conv_dim=6,
        conv_kernel=4,
        ssm_state_shape=(2, 3, 4),
    )


def test_alloc_free_round_trip_restores_counts():
    alloc = PageAllocator(num_pages=8, page_size=4, name="full")
    pages = alloc.alloc_pages(3)
    assert alloc.available() == 5 * 4
    assert alloc.is_allocated(pages)
    alloc.free_pages(pages)
    assert alloc.available() == 32
    assert alloc.allocated_pages().size == 0


def test_double_free_and_foreign_free_raise_and_change_nothing():
    alloc = PageAllocator(num_pages=4, page_size=2, name="full")
    pages = alloc.alloc_pages(2)
    alloc.free_pages(pages[:1])
    with pytest.raises(SlotStateError):
        alloc.free_pages(pages)  # pages[0] is already free
    assert alloc.available_pages() == 3
    with pytest.raises(SlotStateError):
        alloc.free_pages(np.array([pages[1], pages[1]]))
    with pytest.raises(SlotStateError):
        alloc.free_pages(np.array([99]))
    assert alloc.available_pages() == 3


def test_exhaustion_raises_without_allocating():
    alloc = PageAllocator(num_pages=2, page_size=16, name="full")
    with pytest.raises(PoolExhaustedError):
        alloc.alloc_pages(3)
    assert alloc.available_pages() == 2


def test_alloc_slots_is_page_granular():
    alloc = PageAllocator(num_pages=8, page_size=4, name="full")
    slots = alloc.alloc_slots(6)
    assert slots.size == 6
    assert alloc.available_pages() == 6
    assert alloc.check_whole_pages(slots[:4])
    alloc.free_slots(slots)  # frees the part-used second page too
    assert alloc.available_pages() == 8


@pytest.mark.parametrize("page_size", [2, 3, 16])
def test_check_whole_pages_agrees_with_its_definition(page_size):
    """Each page's slots must be its own first slot (page-aligned) plus 0..page_size-1:
    checked against that rule written out page by page, on whole pages and on pages
    with one slot moved, two slots swapped, a shifted run, or random slots."""
    alloc = PageAllocator(num_pages=64, page_size=page_size, name="full")
    rng = np.random.default_rng(page_size)

    def by_definition(slots):
        if slots.size % page_size:
            return False
        for start in range(0, slots.size, page_size):
            page = slots[start : start + page_size].tolist()
            if page[0] % page_size or page != list(range(page[0], page[0] + page_size)):
                return False
        return True

    verdicts = set()
    for trial in range(600):
        pages = rng.permutation(64)[: int(rng.integers(1, 6))]
        slots = alloc.pages_to_slots(pages)
        kind = trial % 5
        if kind == 1:
            slots[rng.integers(slots.size)] += int(rng.integers(1, 4)) * rng.choice([-1, 1])
        elif kind == 2:
            i, j = rng.choice(slots.size, size=2, replace=False)
            slots[[i, j]] = slots[[j, i]]
        elif kind == 3:
            slots = slots + int(rng.integers(1, page_size))
        elif kind == 4:
            slots = rng.integers(0, 64 * page_size, slots.size)
        want = by_definition(slots)
        assert alloc.check_whole_pages(slots) == want, (slots, want)
        verdicts.add(want)
    assert verdicts == {True, False}


def test_pools_for_hybrid_layout_have_the_right_shapes():
    layout = hybrid_layout()
    cfg = CacheConfig(page_size=4, sliding_window=8, full_slots=64, swa_slots=32, mamba_slots=5)
    pools = DevicePools.allocate(layout, cfg)
    assert pools.full.buffer.shape == (2, 2, 64, 2, 8)
    assert pools.swa.buffer.shape == (2, 1, 32, 2, 8)
    assert pools.mamba.conv.shape == (1, 5, 6, 3)
    assert pools.mamba.ssm.shape == (1, 5, 2, 3, 4)
    assert pools.free_counts() == {"full": 64, "swa": 32, "mamba": 5}
    a, b = pools.mamba.alloc_state(), pools.mamba.alloc_state()
    pools.mamba.conv[:, a] = 3.0
    pools.mamba.copy_state(a, b)
    assert torch.equal(pools.mamba.conv[:, b], pools.mamba.conv[:, a])


def test_config_errors_name_the_problem():
    with pytest.raises(ConfigError, match="sliding_window"):
        DevicePools.allocate(hybrid_layout(), CacheConfig(page_size=4, full_slots=64))
    with pytest.raises(ConfigError, match="page_size"):
        CacheConfig(page_size=0)
    with pytest.raises(ConfigError, match="write_policy"):
        CacheConfig(write_policy="sometimes")
    with pytest.raises(ConfigError, match="full-attention"):
        ModelLayout(("mamba",), conv_dim=4, conv_kernel=4, ssm_state_shape=(4,))


def test_shared_memory_pools_are_visible_by_name():
    from multiprocessing import shared_memory

    layout = hybrid_layout()
    cfg = CacheConfig(
        page_size=4, sliding_window=8, full_slots=16, mamba_slots=2, shared_memory=True
    )
    pools = DevicePools.allocate(layout, cfg)
    try:
        pools.full.buffer[0, 0, 3] = 1.5
        info = pools.shared_tensors()["full"]
        seg = shared_memory.SharedMemory(name=info["shm_name"])
        count = int(np.prod(info["shape"]))
        view = torch.frombuffer(seg.buf, dtype=torch.bfloat16, count=count).view(info["shape"])
        assert bytes(seg.buf[2 * count :]) == info["key"]  # the key follows the tensor
        assert view[0, 0, 3].eq(1.5).all()
        del view
        seg.close()
    finally:
        pools.close()


def test_layout_fingerprint_separates_layouts():
    a = hybrid_layout()
    b = ModelLayout.from_dict({**a.to_dict(), "head_dim": 16})
    assert a.fingerprint(16) != b.fingerprint(16)
    assert a.fingerprint(16) != a.fingerprint(64)
    assert ModelLayout.from_dict(a.to_dict()).fingerprint(16) == a.fingerprint(16)


def test_swa_pages_follow_full_pages():
    layout = hybrid_layout()
    cfg = CacheConfig(page_size=4, sliding_window=8, full_slots=32, swa_slots=12, mamba_slots=2)
    pools = DevicePools.allocate(layout, cfg)
    pages = pools.alloc_kv_pages(3)
    assert pools.free_counts() == {"full": 20, "swa": 0, "mamba": 2}
    # No SWA page left: the FULL allocation is rolled back too.
    with pytest.raises(PoolExhaustedError):
        pools.alloc_kv_pages(1)
    assert pools.full.available() == 20
    slots = pools.full.pages_to_slots(pages)
    swa = pools.swa_slots_of(slots)
    assert (swa >= 0).all() and np.unique(swa).size == swa.size
    assert pools.free_swa_of(pages[:2]) == 8
    assert (pools.swa_slots_of(slots[:8]) == -1).all()
    assert (pools.swa_slots_of(slots[8:]) == swa[8:]).all()
    pools.alloc_swa_for(pages[:1])
    pools.free_kv_pages(pages)
    assert pools.free_counts() == {"full": 32, "swa": 12, "mamba": 2}


def test_mamba_pool_speculative_buffers_commit_accepted_steps():
    from hicache.kernels import (
        ConvWindowLayout,
        fused_conv_window_scatter_with_mask,
        fused_mamba_state_scatter_with_mask,
    )

    layout = hybrid_layout()
    cfg = CacheConfig(
        page_size=4,
        sliding_window=8,
        full_slots=16,
        mamba_slots=4,
        speculative_draft_tokens=3,
        speculative_slots=2,
    )
    pools = DevicePools.allocate(layout, cfg)
    mamba = pools.mamba
    # On the CPU the conv windows keep the dense layout; memory counts every buffer.
    assert mamba.spec_conv.layout is ConvWindowLayout.DENSE
    assert mamba.spec_conv.view.shape == (1, 2, 3, 6, 3)
    assert mamba.spec_ssm.shape == (1, 2, 3, 2, 3, 4)
    base = (mamba.conv.numel() + mamba.ssm.numel()) * 4
    assert mamba.nbytes == base + mamba.spec_conv.nbytes + mamba.spec_ssm.numel() * 4
    mamba.spec_conv.storage.copy_(torch.randn(mamba.spec_conv.storage.shape))
    mamba.spec_ssm.copy_(torch.randn(mamba.spec_ssm.shape))
    before = mamba.conv.clone()
    dst = torch.tensor([3, 1])
    steps = torch.tensor([2, -1])  # request 0 accepted 3 drafts, request 1 none
    fused_conv_window_scatter_with_mask(mamba.conv, mamba.spec_conv.view, dst, steps)
    fused_mamba_state_scatter_with_mask(mamba.ssm, mamba.spec_ssm, dst, steps)
    assert torch.equal(mamba.conv[:, 3], mamba.spec_conv.view[:, 0, 2])
    assert torch.equal(mamba.ssm[:, 3], mamba.spec_ssm[:, 0, 2])
    assert torch.equal(mamba.conv[:, 1], before[:, 1])
