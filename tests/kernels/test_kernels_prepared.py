"""PreparedTransfer: the controller's copies between one pair of buffers, checked once.

Every backend it can dispatch to (the torch reference, the Triton kernel under the
interpreter, the staged plan with host memcpys for DMAs) must move the bytes the torch
reference moves, on poisoned outputs; bad indices must raise before anything moves; the
transfer engine must keep one per engine and drop it with the engine's buffers.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from hicache.controller.config import ControllerConfig
from hicache.controller.store.host_pool import HostPool
from hicache.controller.store.transfer_engine import EngineBuffers, TransferEngine
from hicache.kernels import PreparedTransfer, TransferTuning, reference
from hicache.types import ComponentType
from tests.kernels.test_kernels_transfer import MambaHostPages, host_pages_view
from tests.support.bits import bits, randomize
from tests.support.controller import PAGE, Engine, hybrid_layout

LAYERS, HEADS, DIM = 3, 2, 8
FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA


def kv_setup(page_size: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    device_kv = randomize(torch.empty(2, LAYERS, 12 * page_size, HEADS, DIM, dtype=dtype), gen)
    host_kv = randomize(host_pages_view(10, (2, LAYERS, page_size, HEADS, DIM), dtype), gen)
    return gen, device_kv, host_kv


@pytest.mark.parametrize("backend", [None, "torch", "triton", "staged"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_kv_matches_the_reference_both_ways(backend: str | None, page_size: int) -> None:
    gen, device_kv, host_kv = kv_setup(page_size, torch.bfloat16, 7 * page_size)
    kw = {"backend": backend}
    if backend == "staged":  # chunks of 2 pages: the ring's slots are reused
        page_bytes = host_kv[0].numel() * host_kv.element_size()
        kw["tuning"] = TransferTuning(staging_chunk_bytes=2 * page_bytes, staging_chunks=2)
    dev_pages, host_pages = [4, 11, 0, 4, 7], [9, 2, 5, 0, 3]  # device page 4 twice

    backup = PreparedTransfer.kv(device_kv, host_kv, page_size, to_host=True, **kw)
    want = host_kv.clone()
    reference.kv_pages_to_host_ref(
        device_kv, want, torch.tensor(dev_pages), torch.tensor(host_pages), page_size
    )
    before = host_kv.clone()
    backup(dev_pages, host_pages)
    assert torch.equal(bits(host_kv), bits(want))
    assert torch.equal(bits(host_kv[[1, 4, 6, 7, 8]]), bits(before[[1, 4, 6, 7, 8]]))

    # Load into other device pages, from numpy indices this time; same call, many times.
    target = randomize(torch.empty_like(device_kv), gen)
    load = PreparedTransfer.kv(target, host_kv, page_size, to_host=False, **kw)
    want_dev = target.clone()
    back_dev, back_host = np.array([1, 3, 8]), np.array([2, 5, 9], dtype=np.int32)
    reference.kv_pages_to_device_ref(
        host_kv, want_dev, torch.from_numpy(back_host), torch.from_numpy(back_dev), page_size
    )
    for _ in range(2):
        load(back_dev, back_host)
        assert torch.equal(bits(target), bits(want_dev))
    load([], [])  # nothing to move
    assert torch.equal(bits(target), bits(want_dev))


@pytest.mark.parametrize("backend", [None, "triton"])
def test_mamba_states_match_the_reference_both_ways(backend: str | None) -> None:
    gen = torch.Generator().manual_seed(5)
    layers, slots = 3, 7
    conv = randomize(torch.empty(layers, slots, 10, 3, dtype=torch.float16), gen)
    ssm = randomize(torch.empty(layers, slots, 2, 4, 5, dtype=torch.float16), gen)
    host = MambaHostPages(6, layers, (10, 3), (2, 4, 5), torch.float16)
    randomize(host.buffer, gen)
    store = PreparedTransfer.states(
        conv, ssm, *host.views(host.buffer), to_host=True, backend=backend
    )
    want = host.buffer.clone()
    reference.mamba_states_to_host_ref(
        conv, ssm, *host.views(want), torch.tensor([6, 0, 3]), torch.tensor([2, 5, 0])
    )
    store([6, 0, 3], [2, 5, 0])
    assert torch.equal(host.buffer, want)

    conv2, ssm2 = randomize(torch.empty_like(conv), gen), randomize(torch.empty_like(ssm), gen)
    want_conv, want_ssm = conv2.clone(), ssm2.clone()
    load = PreparedTransfer.states(
        conv2, ssm2, *host.views(host.buffer), to_host=False, backend=backend
    )
    load([1, 4, 2], [2, 5, 0])
    reference.mamba_states_to_device_ref(
        *host.views(host.buffer),
        want_conv,
        want_ssm,
        torch.tensor([2, 5, 0]),
        torch.tensor([1, 4, 2]),
    )
    assert torch.equal(bits(conv2), bits(want_conv))
    assert torch.equal(bits(ssm2), bits(want_ssm))
    assert torch.equal(bits(conv2[:, [1, 4, 2]]), bits(conv[:, [6, 0, 3]]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    ("dev", "host", "error", "says"),
    [
        ([0, 12], [0, 1], IndexError, "device pages holds 12, outside the 12"),
        ([0, -1], [0, 1], IndexError, "device pages holds -1"),
        ([0, 1], [0, 10], IndexError, "host pages holds 10, outside the 10"),
        ([0, 1], [0], ValueError, "2 device pages but 1 host pages"),
        ([0, 1.5], [0, 1], TypeError, "integers"),
        ([[0, 1]], [[0, 1]], TypeError, "flat"),
    ],
)
def test_bad_indices_raise_before_anything_moves(backend, dev, host, error, says) -> None:
    _, device_kv, host_kv = kv_setup(4, torch.float32, 3)
    before = host_kv.clone()
    backup = PreparedTransfer.kv(device_kv, host_kv, 4, to_host=True, backend=backend)
    with pytest.raises(error, match=says):
        backup(dev, host)
    assert torch.equal(bits(host_kv), bits(before))


def test_bad_tensors_are_refused_when_prepared() -> None:
    _, device_kv, host_kv = kv_setup(4, torch.float32, 3)
    with pytest.raises(ValueError, match="host_kv must be"):
        PreparedTransfer.kv(device_kv, host_kv, 2, to_host=True)
    with pytest.raises(TypeError, match=r"host_kv is torch\.float16"):
        PreparedTransfer.kv(device_kv, host_kv.half(), 4, to_host=True)
    with pytest.raises(ValueError, match="not one of"):
        PreparedTransfer.kv(device_kv, host_kv, 4, to_host=True, backend="dma")
    conv, ssm = torch.zeros(2, 3, 4, 3), torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="KV pages only"):
        PreparedTransfer.states(
            conv,
            ssm,
            torch.zeros(4, 2, 4, 3),
            torch.zeros(4, 2, 5),
            to_host=True,
            backend="staged",
        )
    with pytest.raises(ValueError, match="host_ssm must be"):
        PreparedTransfer.states(
            conv, ssm, torch.zeros(4, 2, 4, 3), torch.zeros(4, 2, 6), to_host=True
        )


def test_transfer_engine_keeps_one_per_engine_and_drops_it_with_the_buffers() -> None:
    layout = hybrid_layout()
    host = HostPool(layout, PAGE, ControllerConfig(host_pool_bytes=1 << 18))
    transfer = TransferEngine(host)
    engine = Engine(layout, full_slots=64, mamba_slots=8)
    randomize(engine.pools.full.buffer, torch.Generator().manual_seed(1))
    buffers = EngineBuffers.from_pools(engine.pools)
    for comp, dev in ((FULL, [3, 1]), (SWA, [2, 0]), (MAMBA, [5, 6])):
        transfer.to_host(comp, buffers, dev, [0, 1])
    plans = transfer._plans[buffers]
    assert set(plans) == {(FULL, True, None), (SWA, True, None), (MAMBA, True, None)}
    first = plans[(FULL, True, None)]
    transfer.to_host(FULL, buffers, [4], [2])
    assert transfer._plans[buffers][(FULL, True, None)] is first  # prepared once, reused
    full = engine.pools.full.buffer.view(2, len(layout.full_layers), -1, PAGE, 2, 8)
    assert torch.equal(bits(host.kv(FULL)[1]), bits(full[:, :, 1]))  # device page 1 -> host page 1
    assert torch.equal(bits(host.kv(FULL)[2]), bits(full[:, :, 4]))

    # Another engine's buffers (same shapes) get their own; neither outlives its buffers.
    other = EngineBuffers.from_pools(Engine(layout, full_slots=64, mamba_slots=8).pools)
    transfer.to_device(FULL, other, [1], [7])
    assert len(transfer._plans) == 2
    del buffers, plans, first, other
    gc.collect()
    assert len(transfer._plans) == 0


@pytest.mark.parametrize("backend", [None, "torch", "triton"])
def test_a_copy_of_some_layers_moves_those_layers_only(backend: str | None) -> None:
    """A layer-wise load's copies (``layers=(lo, hi)``): each moves its layers of every
    page as the whole-page copy would, and the copies of all groups together move exactly
    what one whole-page copy moves."""
    gen, device_kv, host_kv = kv_setup(4, torch.float16, 11)
    dev_pages, host_pages = [1, 3, 8], [2, 5, 9]
    want = device_kv.clone()
    reference.kv_pages_to_device_ref(
        host_kv, want, torch.tensor(host_pages), torch.tensor(dev_pages), 4
    )
    before = device_kv.clone()
    one = PreparedTransfer.kv(device_kv, host_kv, 4, to_host=False, backend=backend, layers=(1, 2))
    one(dev_pages, host_pages)
    assert torch.equal(bits(device_kv[:, 1]), bits(want[:, 1]))
    for other in (0, 2):  # the other layers are untouched
        assert torch.equal(bits(device_kv[:, other]), bits(before[:, other]))
    for lo, hi in ((0, 1), (2, LAYERS)):
        PreparedTransfer.kv(device_kv, host_kv, 4, to_host=False, backend=backend, layers=(lo, hi))(
            dev_pages, host_pages
        )
    assert torch.equal(bits(device_kv), bits(want))

    layers, slots = 3, 5
    conv = randomize(torch.empty(layers, slots, 6, 3, dtype=torch.float16), gen)
    ssm = randomize(torch.empty(layers, slots, 2, 4, dtype=torch.float16), gen)
    host = MambaHostPages(4, layers, (6, 3), (2, 4), torch.float16)
    randomize(host.buffer, gen)
    want_conv, want_ssm = conv.clone(), ssm.clone()
    host_conv, host_ssm = host.views(host.buffer)
    reference.mamba_states_to_device_ref(
        host_conv, host_ssm, want_conv, want_ssm, torch.tensor([3]), torch.tensor([1])
    )
    for lo, hi in ((0, 2), (2, 3)):
        PreparedTransfer.states(
            conv, ssm, host_conv, host_ssm, to_host=False, backend=backend, layers=(lo, hi)
        )([1], [3])
        assert torch.equal(bits(conv[lo:hi]), bits(want_conv[lo:hi]))
    assert torch.equal(bits(conv), bits(want_conv)) and torch.equal(bits(ssm), bits(want_ssm))


def test_a_layer_range_outside_the_pool_or_staged_is_refused() -> None:
    _, device_kv, host_kv = kv_setup(4, torch.float16, 3)
    for bad in ((0, 0), (2, 1), (-1, 2), (0, LAYERS + 1)):
        with pytest.raises(ValueError, match="layers"):
            PreparedTransfer.kv(device_kv, host_kv, 4, to_host=False, layers=bad)
    with pytest.raises(ValueError, match="whole pages"):
        PreparedTransfer.kv(device_kv, host_kv, 4, to_host=False, backend="staged", layers=(0, 1))


def _layered_tensors(seed: int) -> tuple[torch.Tensor, ...]:
    """Device KV (8 pages, 4 layers), host KV (6 pages), device conv / SSM states (5
    slots, 4 layers) and host states (7 slots), random."""
    g = torch.Generator().manual_seed(seed)
    dev = torch.randn(2, 4, 8 * PAGE, 2, 8, generator=g)
    host = torch.randn(6, 2, 4, PAGE, 2, 8, generator=g)
    conv, ssm = torch.randn(4, 5, 3, 2, generator=g), torch.randn(4, 5, 6, generator=g)
    host_conv, host_ssm = torch.randn(7, 4, 3, 2, generator=g), torch.randn(7, 4, 6, generator=g)
    return dev, host, conv, ssm, host_conv, host_ssm


def _kv_and_state_cases(dev, host, conv, ssm, host_conv, host_ssm) -> list[tuple]:
    """(make a plan of device and host tensors, its device tensors, its host tensors) for
    KV pages and for Mamba states, over :func:`_layered_tensors`' tensors."""
    return [
        (lambda d, h, **kw: PreparedTransfer.kv(d[0], h[0], PAGE, **kw), (dev,), (host,)),
        (
            lambda d, h, **kw: PreparedTransfer.states(d[0], d[1], h[0], h[1], **kw),
            (conv, ssm),
            (host_conv, host_ssm),
        ),
    ]


def test_a_layer_groups_rows_are_the_first_groups_moved_to_its_layers() -> None:
    """A layer-wise load plans its pages' rows once: another group's rows are the first
    group's shifted to that group's layers, equal to what planning them anew gives, for
    KV pages and Mamba states; groups of another size are planned anew (None)."""
    dev, host, conv, ssm, host_conv, host_ssm = _layered_tensors(5)
    makers = [
        lambda layers: PreparedTransfer.kv(dev, host, PAGE, to_host=False, layers=layers),
        lambda layers: PreparedTransfer.states(
            conv, ssm, host_conv, host_ssm, to_host=False, layers=layers
        ),
    ]
    for make in makers:
        first = make((0, 1))
        rows = first.row_dmas([2, 0, 4], [5, 3, 1])
        for lo in (1, 3):
            other = make((lo, lo + 1))
            got = other.shifted_rows(first, rows)
            want = other.row_dmas([2, 0, 4], [5, 3, 1])
            assert got is not None and all(np.array_equal(a, b) for a, b in zip(got, want))
        assert make((1, 3)).shifted_rows(first, rows) is None  # two layers a row grid


@pytest.mark.parametrize("layers", [None, (1, 3)])
def test_run_copies_move_what_the_reference_moves(layers) -> None:
    """Pages that run consecutively on both sides go as one 2-D copy per row of each run
    (``run_copies``): applied row by row here, they give exactly the reference's result,
    whole and narrowed to some layers, for runs up and broken; states too; an index
    outside its tensor is refused."""
    import ctypes

    from hicache.kernels.copy_engine import run_count

    dev, host, conv, ssm, host_conv, host_ssm = _layered_tensors(6)
    cases = _kv_and_state_cases(dev, host, conv, ssm, host_conv, host_ssm)
    device_items, host_items = [1, 2, 3, 0], [2, 3, 4, 0]  # a run of 3, then one
    assert run_count(np.array(device_items), np.array(host_items)) == 2
    for make, device_side, host_side in cases:
        want = [t.clone() for t in device_side]
        make(want, host_side, to_host=False, layers=layers, backend="torch")(
            device_items, host_items
        )
        plan = make(device_side, host_side, to_host=False, layers=layers)
        copies = plan.run_copies(device_items, host_items)
        assert copies is not None
        for dst, dpitch, src, spitch, width, height in copies:
            for r in range(height):
                ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(device_side, want))
        with pytest.raises(IndexError):
            plan.run_copies([2], [99])
    # KV: one copy per row of each run, not per page
    kv = PreparedTransfer.kv(dev, host, PAGE, to_host=False, layers=layers)
    rows = len(kv.row_dmas([0], [0])[0])
    assert len(kv.run_copies(device_items, host_items)) == 2 * rows


@pytest.mark.parametrize("layers", [None, (1, 3)])
def test_row_dmas_move_what_the_reference_moves(layers) -> None:
    """A layer-wise load on a GPU goes out as one batched copy per layer group
    (``row_dmas``): applied byte for byte here, each row's addresses give exactly the
    reference's result for KV pages and Mamba states, whole and narrowed to some layers,
    and an index outside its tensor is refused before any address is made."""
    import ctypes

    dev, host, conv, ssm, host_conv, host_ssm = _layered_tensors(4)
    cases = _kv_and_state_cases(dev, host, conv, ssm, host_conv, host_ssm)
    for make, device_side, host_side in cases:
        want = [t.clone() for t in device_side]
        make(want, host_side, to_host=False, layers=layers, backend="torch")([2, 0], [5, 3])
        plan = make(device_side, host_side, to_host=False, layers=layers)
        for dst, src, n in zip(*(a.tolist() for a in plan.row_dmas([2, 0], [5, 3]))):
            ctypes.memmove(dst, src, n)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(device_side, want))
        with pytest.raises(IndexError):
            plan.row_dmas([2], [99])
