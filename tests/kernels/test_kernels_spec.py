"""Speculative-decoding scatters and the de-duplicated conv-window layout: Triton
(interpreted on CPU) vs torch reference vs a plain Python loop, bit for bit."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import hicache.kernels as kernels
from hicache.kernels import ConvWindowBuffer, ConvWindowLayout, reference
from tests.support.bits import bits, randomize

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def loop_scatter(dst, src, dst_indices, step_indices) -> None:
    """The contract, written as the plainest loop."""
    slots, steps = dst.shape[1], src.shape[2]
    for i, (d, s) in enumerate(zip(dst_indices.tolist(), step_indices.tolist())):
        if 0 <= s < steps and 0 <= d < slots:
            dst[:, d] = src[:, i, s]


def random_requests(requests: int, slots: int, steps: int, gen: torch.Generator):
    """Slots with duplicates and out-of-range entries; steps covering -1, 0, D-1 and D."""
    dst = torch.randint(0, slots, (requests,), generator=gen)
    dst[1] = dst[0]  # a duplicate: the later writing request must win
    dst[2] = slots  # out of range above
    dst[3] = -2  # out of range below
    step = torch.randint(0, steps, (requests,), generator=gen)
    step[4], step[5], step[6], step[7] = -1, 0, steps - 1, steps
    step[0] = 0
    return dst, step


def three_scatters(fn_triton, fn_ref, dst, src, dst_indices, step_indices):
    outs = []
    for fn in (fn_triton, fn_ref, loop_scatter):
        out = dst.clone()
        fn(out, src, dst_indices, step_indices)
        outs.append(out)
    return outs


@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba_state_scatter_matches_reference_and_loop(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(dtype.itemsize)
    layers, slots, requests, steps, state = 3, 9, 12, 4, (2, 5, 3)
    dst = randomize(torch.empty(layers, slots, *state, dtype=dtype), gen)
    src = randomize(torch.empty(layers, requests, steps, *state, dtype=dtype), gen)
    dst_indices, step_indices = random_requests(requests, slots, steps, gen)

    outs = three_scatters(
        lambda *a: kernels.fused_mamba_state_scatter_with_mask(*a, backend="triton"),
        reference.fused_mamba_state_scatter_with_mask_ref,
        dst,
        src,
        dst_indices,
        step_indices,
    )
    for out in outs[:2]:
        assert torch.equal(bits(out), bits(outs[2]))
    # Requests 0 and 1 (at least) write the same slot; the last of its writers wins.
    slot = int(dst_indices[0])
    writers = [
        i
        for i, (d, s) in enumerate(zip(dst_indices.tolist(), step_indices.tolist()))
        if d == slot and 0 <= s < steps
    ]
    assert len(writers) >= 2
    last = writers[-1]
    assert torch.equal(bits(outs[0][:, slot]), bits(src[:, last, step_indices[last]]))
    # Slots no request writes keep their poison.
    written = {d for d, s in zip(dst_indices.tolist(), step_indices.tolist()) if 0 <= d < slots}
    written &= {d for d, s in zip(dst_indices.tolist(), step_indices.tolist()) if 0 <= s < steps}
    kept = [s for s in range(slots) if s not in written]
    assert kept
    assert torch.equal(bits(outs[0][:, kept]), bits(dst[:, kept]))


def test_scatter_with_every_request_skipped_changes_nothing() -> None:
    gen = torch.Generator().manual_seed(11)
    dst = randomize(torch.empty(2, 4, 6), gen)
    src = randomize(torch.empty(2, 3, 5, 6), gen)
    before = dst.clone()
    kernels.fused_mamba_state_scatter_with_mask(
        dst, src, torch.tensor([0, 1, 7]), torch.tensor([-1, -1, 2]), backend="triton"
    )
    assert torch.equal(bits(dst), bits(before))


def window_stream(layers, requests, steps, conv_dim, kernel, dtype, gen):
    """A de-duplicated buffer filled with random columns, and its dense equivalent."""
    dedup = ConvWindowBuffer.allocate(
        layers, requests, steps, conv_dim, kernel, dtype, "cpu", ConvWindowLayout.DEDUPLICATED
    )
    randomize(dedup.storage, gen)
    dense = ConvWindowBuffer.allocate(
        layers, requests, steps, conv_dim, kernel, dtype, "cpu", ConvWindowLayout.DENSE
    )
    dense.store_windows(dedup.view)
    return dedup, dense


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("steps", "kernel"), [(4, 4), (3, 2), (5, 3)])
def test_conv_window_scatter_dense_and_deduplicated_give_identical_bytes(
    dtype: torch.dtype, steps: int, kernel: int
) -> None:
    gen = torch.Generator().manual_seed(100 * steps + kernel + dtype.itemsize)
    layers, slots, requests, conv_dim = 2, 10, 9, 7
    dedup, dense = window_stream(layers, requests, steps, conv_dim, kernel, dtype, gen)
    dst = randomize(torch.empty(layers, slots, conv_dim, kernel - 1, dtype=dtype), gen)
    dst_indices, step_indices = random_requests(requests, slots, steps, gen)

    results = []
    for src in (dense.view, dedup.view):
        results += three_scatters(
            lambda *a: kernels.fused_conv_window_scatter_with_mask(*a, backend="triton"),
            reference.fused_conv_window_scatter_with_mask_ref,
            dst,
            src,
            dst_indices,
            step_indices,
        )
    for out in results[1:]:
        assert torch.equal(bits(out), bits(results[0]))
    assert not torch.equal(bits(results[0]), bits(dst))
    # Step t's window is columns t .. t+K-2 of the request's buffer.
    i = 6
    want = dedup.storage[:, i, :, step_indices[i] : step_indices[i] + kernel - 1]
    assert torch.equal(bits(results[0][:, dst_indices[i]]), bits(want))


@pytest.mark.parametrize(("steps", "kernel"), [(4, 4), (3, 4), (8, 2), (5, 3), (1, 4)])
def test_deduplicated_buffer_holds_the_predicted_fraction_of_dense_bytes(
    steps: int, kernel: int
) -> None:
    shape = dict(layers=3, slots=5, draft_tokens=steps, conv_dim=24, conv_kernel=kernel)
    dense = ConvWindowBuffer.allocate(
        **shape, dtype=torch.bfloat16, device="cpu", layout=ConvWindowLayout.DENSE
    )
    dedup = ConvWindowBuffer.allocate(
        **shape, dtype=torch.bfloat16, device="cpu", layout=ConvWindowLayout.DEDUPLICATED
    )
    ratio = Fraction(
        dedup.storage.untyped_storage().nbytes(), dense.storage.untyped_storage().nbytes()
    )
    assert ratio == Fraction(steps + kernel - 2, steps * (kernel - 1))
    assert dedup.nbytes == dedup.storage.untyped_storage().nbytes()
    if steps == kernel == 4:
        assert ratio == Fraction(1, 2)
    assert dedup.view.shape == dense.view.shape == (3, 5, steps, 24, kernel - 1)


def test_store_windows_round_trips_through_the_deduplicated_view() -> None:
    gen = torch.Generator().manual_seed(2)
    layers, slots, steps, conv_dim, kernel = 2, 3, 5, 4, 4
    # Windows of a real linear draft: each step shifts in one new column.
    columns = randomize(torch.empty(layers, slots, conv_dim, steps + kernel - 2), gen)
    windows = columns.unfold(3, kernel - 1, 1).permute(0, 1, 3, 2, 4).contiguous()
    buf = ConvWindowBuffer.allocate(
        layers, slots, steps, conv_dim, kernel, torch.float32, "cpu", ConvWindowLayout.DEDUPLICATED
    )
    buf.store_windows(windows)
    assert torch.equal(bits(buf.storage), bits(columns))
    assert torch.equal(bits(buf.view.contiguous()), bits(windows))


def test_layout_choice_follows_draft_shape_and_device() -> None:
    choose = kernels.choose_conv_window_layout
    assert choose(1, "cuda") is ConvWindowLayout.DEDUPLICATED
    assert choose(0, "cuda:0") is ConvWindowLayout.DEDUPLICATED
    assert choose(2, "cuda") is ConvWindowLayout.DENSE
    assert choose(1, "cpu") is ConvWindowLayout.DENSE
    buf = ConvWindowBuffer.allocate(2, 2, 4, 8, 4, torch.float32, "cpu", draft_topk=1)
    assert buf.layout is ConvWindowLayout.DENSE


def test_scatter_arguments_are_checked() -> None:
    dst = torch.zeros(2, 4, 3, 3)
    src = torch.zeros(2, 5, 4, 3, 3)
    ok = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError, match="one entry per request of src"):
        kernels.fused_conv_window_scatter_with_mask(dst, src, ok[:4], ok)
    with pytest.raises(ValueError, match="does not match dst"):
        kernels.fused_conv_window_scatter_with_mask(dst, torch.zeros(2, 5, 4, 3, 2), ok, ok)
    with pytest.raises(TypeError, match=r"src is torch\.float16"):
        kernels.fused_mamba_state_scatter_with_mask(dst, src.half(), ok, ok)
    with pytest.raises(ValueError, match="no copy-engine backend"):
        kernels.fused_mamba_state_scatter_with_mask(dst, src, ok, ok, backend="copy_engine")
    with pytest.raises(ValueError, match="conv_kernel >= 2"):
        ConvWindowBuffer.allocate(1, 1, 4, 8, 1, torch.float32, "cpu")
