"""Index inputs the copy functions must get right or refuse: index views that are not
packed (a column of a table), indices of a type torch reads as a mask, destinations named
twice, and Mamba pools whose conv and SSM parts disagree. Each moved wrong bytes without an
error before; the Triton paths run under Triton's interpreter on CPU tensors."""

from __future__ import annotations

import pytest
import torch

import hicache.kernels as kernels
from hicache.controller.store.local import LocalController
from hicache.controller_api import ControllerError, PageRef
from hicache.kernels import PreparedTransfer, reference
from tests.support.controller import FULL, PAGE, Engine, controller_config, hybrid_layout


def test_kv_pages_to_host_reads_a_column_of_an_index_table_as_its_values():
    g = torch.Generator().manual_seed(1)
    device_kv = torch.randn(2, 2, 6 * 2, 2, 4, generator=g)
    table = torch.tensor([[4, 1], [2, 5], [0, 3]])  # (device page, host page) rows
    dev, hp = table[:, 0], table[:, 1]
    assert not dev.is_contiguous()
    want = torch.zeros(6, 2, 2, 2, 2, 4)
    reference.kv_pages_to_host_ref(device_kv, want, dev.contiguous(), hp.contiguous(), 2)
    for backend in ("triton", "torch"):
        host = torch.zeros_like(want)
        kernels.kv_pages_to_host(device_kv, host, dev, hp, 2, backend=backend)
        assert torch.equal(host, want), backend


def test_kv_pages_to_device_staged_reads_a_strided_slice_as_its_values():
    g = torch.Generator().manual_seed(11)
    host = torch.randn(4, 2, 2, 2, 2, 4, generator=g)
    dev = torch.arange(8)[::3]  # pages 0, 3, 6
    hp = torch.tensor([1, 2, 3])
    want = torch.zeros(2, 2, 8 * 2, 2, 4)
    reference.kv_pages_to_device_ref(host, want, hp, dev.contiguous(), 2)
    device_kv = torch.zeros_like(want)
    kernels.kv_pages_to_device(host, device_kv, hp, dev, 2, backend="staged")
    assert torch.equal(device_kv, want)


def test_mamba_copies_and_scatter_read_index_views_as_their_values():
    g = torch.Generator().manual_seed(3)
    hconv = torch.randn(4, 2, 3, 2, generator=g)
    hssm = torch.randn(4, 2, 4, generator=g)
    slots = torch.arange(8)[1::3]  # slots 1, 4, 7
    pages = torch.tensor([3, 0, 2])
    want_c, want_s = torch.zeros(2, 8, 3, 2), torch.zeros(2, 8, 4)
    reference.mamba_states_to_device_ref(hconv, hssm, want_c, want_s, pages, slots.contiguous())
    conv, ssm = torch.zeros_like(want_c), torch.zeros_like(want_s)
    kernels.mamba_states_to_device(hconv, hssm, conv, ssm, pages, slots, backend="triton")
    assert torch.equal(conv, want_c) and torch.equal(ssm, want_s)

    dst = torch.randn(2, 6, 3, 4, generator=g)
    src = torch.randn(2, 3, 2, 3, 4, generator=g)
    table = torch.tensor([[5, 0], [1, 1], [3, 0]])  # (slot, accepted step) per request
    want = dst.clone()
    reference.fused_mamba_state_scatter_with_mask_ref(
        want, src, table[:, 0].contiguous(), table[:, 1].contiguous()
    )
    kernels.fused_mamba_state_scatter_with_mask(
        dst, src, table[:, 0], table[:, 1], backend="triton"
    )
    assert torch.equal(dst, want)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.bool, torch.float32])
def test_indices_of_another_type_are_refused(dtype):
    device_kv = torch.randn(2, 2, 6 * 2, 2, 4)
    host = torch.zeros(6, 2, 2, 2, 2, 4)
    before = host.clone()
    for backend in ("torch", "triton"):
        with pytest.raises(TypeError, match="int32 or int64"):
            kernels.kv_pages_to_host(
                device_kv,
                host,
                torch.tensor([1, 2, 0]).to(dtype),
                torch.tensor([0, 1, 2]).to(dtype),
                2,
                backend=backend,
            )
    assert torch.equal(host, before)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_destination_named_twice_is_refused_before_anything_moves(backend):
    g = torch.Generator().manual_seed(5)
    host = torch.randn(3, 2, 2, 2, 2, 4, generator=g)
    device_kv = torch.zeros(2, 2, 4 * 2, 2, 4)
    with pytest.raises(ValueError, match="twice"):
        kernels.kv_pages_to_device(
            host, device_kv, torch.tensor([0, 1]), torch.tensor([2, 2]), 2, backend=backend
        )
    with pytest.raises(ValueError, match="twice"):
        kernels.kv_pages_to_host(
            device_kv, host, torch.tensor([0, 1]), torch.tensor([1, 1]), 2, backend=backend
        )
    prepared = PreparedTransfer.kv(device_kv, host, 2, to_host=False, backend=backend)
    with pytest.raises(ValueError, match="twice"):
        prepared([3, 3], [0, 1])
    assert not device_kv.any(), "a refused copy moved bytes"
    prepared([3, 2], [0, 1])  # distinct destinations, one source twice: fine
    assert torch.equal(device_kv[:, :, 6:8], host[0])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prepared_states_refuse_conv_and_ssm_pools_of_different_sizes(backend):
    conv, ssm = torch.zeros(2, 8, 3, 2), torch.zeros(2, 4, 4)
    hconv, hssm = torch.zeros(4, 2, 3, 2), torch.zeros(4, 2, 4)
    with pytest.raises(ValueError, match="same layers and slots"):
        PreparedTransfer.states(conv, ssm, hconv, hssm, to_host=True, backend=backend)


def test_the_controller_refuses_two_pages_named_into_one_device_page(tmp_path):
    layout = hybrid_layout()
    engine = Engine(layout)
    ctl = LocalController(controller_config(tmp_path))
    ctl.register(layout, PAGE, engine.pools)
    try:
        chain = engine.write_chain(range(2 * PAGE))
        assert ctl.backup(chain.refs([FULL])).wait(10.0)
        slot = engine.place(chain.hashes[:1], chain.parents[:1]).full_pages[0]
        refs = [
            PageRef(FULL, chain.hashes[0], chain.parents[0], slot),
            PageRef(FULL, chain.hashes[1], chain.parents[1], slot),
        ]
        pin = ctl.pin([r.key for r in refs], 30.0)
        assert pin is not None
        with pytest.raises(ControllerError, match="two different pages"):
            ctl.load(refs, pin, 10.0)
        with pytest.raises(ControllerError, match="two different pages"):
            ctl.backup(refs)
        ctl.unpin(pin)
        ctl.check_invariants()
    finally:
        ctl.close()
