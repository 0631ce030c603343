"""Triton copy kernels with torch reference versions (imported as hicache.kernels).

Every function here checks its arguments, then dispatches: on CUDA tensors to the fast
path (Triton, the copy engines, or for large KV transfers the staged path, where
measured faster; see :mod:`hicache.kernels.tuning`), on CPU tensors to one memmove per
run of rows (:mod:`hicache.kernels.cpu_rows`). ``backend=`` overrides the choice;
``Backend.TORCH`` runs the torch reference, ``Backend.TRITON`` on CPU tensors runs
Triton's interpreter and ``Backend.STAGED`` its plan with host memcpys for the DMAs,
which is how the tests compare them with the reference on a machine without a GPU. GPU
work runs on (or is waited for by) the current CUDA stream and returns without waiting.

A caller that copies between the same tensors many times (the controller) builds a
:class:`PreparedTransfer` once instead: the same dispatch and bytes, with the tensor checks
and launchers done up front (:mod:`hicache.kernels.prepared`).

Layouts are those of :mod:`hicache.kernels.reference`.
"""

from __future__ import annotations

import torch

from hicache.kernels import reference
from hicache.kernels.cpu_rows import merge_runs, move_runs
from hicache.kernels.geometry import (
    RowCopy,
    RowSide,
    kv_row_copy,
    mamba_index_pair,
    scatter_shapes,
    state_row_copy,
)
from hicache.kernels.prepared import PreparedTransfer
from hicache.kernels.segments import Segment, SegmentCopy
from hicache.kernels.spec_buffers import (
    ConvWindowBuffer,
    ConvWindowLayout,
    choose_conv_window_layout,
)
from hicache.kernels.tuning import DEFAULT_TUNING, Backend, TransferTuning, parse_backend

__all__ = [
    "Backend",
    "ConvWindowBuffer",
    "ConvWindowLayout",
    "PreparedTransfer",
    "Segment",
    "SegmentCopy",
    "TransferTuning",
    "choose_conv_window_layout",
    "fused_conv_window_scatter_with_mask",
    "fused_mamba_state_scatter_with_mask",
    "kv_pages_to_device",
    "kv_pages_to_host",
    "kv_transfer_backend",
    "mamba_states_to_device",
    "mamba_states_to_host",
    "merge_runs",
    "move_runs",
]

BackendArg = Backend | str | None


def _transfer(
    copy: RowCopy,
    src_items: torch.Tensor,
    dst_items: torch.Tensor,
    backend: BackendArg,
    tuning: TransferTuning,
    to_host: bool,
) -> Backend:
    """Run one row copy on the chosen backend, or return ``Backend.TORCH`` for the caller
    to run the reference (which moves all tensors of a transfer at once)."""
    device = (copy.src if to_host else copy.dst).tensor.device
    chosen = parse_backend(backend)
    if chosen is None:
        if device.type != "cuda":
            chosen = _cpu_or_reference(src_items, dst_items)
        else:
            chosen = tuning.auto_backend(copy.item_bytes, to_host)
    if chosen is Backend.TORCH:
        return chosen
    if chosen is Backend.CPU:
        if device.type == "cuda":
            raise ValueError("backend='cpu' needs CPU tensors; use 'triton' or 'copy_engine'")
        from hicache.kernels.cpu_rows import copy_rows_cpu

        copy_rows_cpu(
            copy,
            src_items,
            dst_items,
            threads=tuning.cpu_copy_threads,
            parallel_min_bytes=tuning.cpu_parallel_min_bytes,
        )
        return chosen
    if chosen is Backend.STAGED:
        raise ValueError(
            "backend='staged' moves KV pages only; use 'triton' or 'copy_engine' for Mamba states"
        )
    if chosen is Backend.COPY_ENGINE:
        if device.type != "cuda":
            raise ValueError("backend='copy_engine' needs CUDA tensors; use 'torch' or 'triton'")
        from hicache.kernels.copy_engine import copy_rows_copy_engine

        copy_rows_copy_engine(copy, src_items, dst_items)
    else:
        from hicache.kernels.triton_transfer import copy_rows

        copy_rows(copy, src_items, dst_items, tuning)
    return chosen


def _cpu_or_reference(src_items: torch.Tensor, dst_items: torch.Tensor) -> Backend:
    """The default for CPU tensors: the memmove path, whose indices the argument checks
    have range-checked (they check CPU indices only), else the reference."""
    if src_items.device.type == "cpu" and dst_items.device.type == "cpu":
        return Backend.CPU
    return Backend.TORCH


def _staged_dma_bytes(
    copy: RowCopy, host: RowSide, device_pages: torch.Tensor, host_pages: torch.Tensor
) -> int:
    """Mean bytes per host-side DMA if this transfer were staged; 0 where the default
    does not stage it (indices on the GPU, pageable host memory)."""
    if host_pages.device.type != "cpu" or device_pages.device.type != "cpu":
        return 0
    from hicache.kernels.staged import mean_dma_bytes

    return mean_dma_bytes(copy, host, host_pages.numpy())


def _kv_backend(
    copy: RowCopy,
    device_pages: torch.Tensor,
    host_pages: torch.Tensor,
    backend: BackendArg,
    tuning: TransferTuning,
    to_host: bool,
) -> Backend:
    chosen = parse_backend(backend)
    if chosen is not None:
        return chosen
    dev, host = (copy.src, copy.dst) if to_host else (copy.dst, copy.src)
    if dev.tensor.device.type != "cuda":
        return _cpu_or_reference(device_pages, host_pages)
    transfer_bytes = host_pages.numel() * copy.item_bytes
    dma_bytes = 0
    if transfer_bytes >= tuning.staged_min_transfer_bytes:
        dma_bytes = _staged_dma_bytes(copy, host, device_pages, host_pages)
    return tuning.auto_backend(
        copy.item_bytes, to_host, transfer_bytes=transfer_bytes, dma_bytes=dma_bytes
    )


def _kv_transfer(
    copy: RowCopy,
    device_pages: torch.Tensor,
    host_pages: torch.Tensor,
    backend: BackendArg,
    tuning: TransferTuning,
    to_host: bool,
) -> Backend:
    chosen = _kv_backend(copy, device_pages, host_pages, backend, tuning, to_host)
    if chosen is Backend.STAGED:
        from hicache.kernels.staged import kv_staged

        kv_staged(copy, device_pages, host_pages, to_host, tuning)
        return chosen
    src_items, dst_items = (device_pages, host_pages) if to_host else (host_pages, device_pages)
    return _transfer(copy, src_items, dst_items, chosen, tuning, to_host)


def kv_transfer_backend(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_pages: torch.Tensor,
    host_pages: torch.Tensor,
    page_size: int,
    *,
    to_host: bool,
    tuning: TransferTuning = DEFAULT_TUNING,
) -> Backend:
    """The backend :func:`kv_pages_to_host` (``to_host=True``) or
    :func:`kv_pages_to_device` would pick without ``backend=`` for these arguments
    (checked as they would check them); moves nothing."""
    copy = kv_row_copy(device_kv, host_kv, device_pages, host_pages, page_size, to_host=to_host)
    return _kv_backend(copy, device_pages, host_pages, None, tuning, to_host)


def kv_pages_to_host(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_pages: torch.Tensor,
    host_pages: torch.Tensor,
    page_size: int,
    *,
    backend: BackendArg = None,
    tuning: TransferTuning = DEFAULT_TUNING,
) -> None:
    """``host_kv[host_pages[i]] = device page device_pages[i]`` (all layers, K and V).

    ``device_kv`` is ``[2, layers, slots, heads, head_dim]``, ``host_kv`` is
    ``[host_pages, 2, layers, page_size, heads, head_dim]`` (pinned on a GPU machine).
    Raises IndexError for a CPU index outside its tensor; on a GPU the host bytes are
    complete only once the current stream has passed this point.
    """
    copy = kv_row_copy(device_kv, host_kv, device_pages, host_pages, page_size, to_host=True)
    if _kv_transfer(copy, device_pages, host_pages, backend, tuning, True) is Backend.TORCH:
        reference.kv_pages_to_host_ref(device_kv, host_kv, device_pages, host_pages, page_size)


def kv_pages_to_device(
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    host_pages: torch.Tensor,
    device_pages: torch.Tensor,
    page_size: int,
    *,
    backend: BackendArg = None,
    tuning: TransferTuning = DEFAULT_TUNING,
) -> None:
    """Device page ``device_pages[i]`` = ``host_kv[host_pages[i]]`` (all layers, K and V).

    The inverse of :func:`kv_pages_to_host`; the device slots of other pages are untouched.
    """
    copy = kv_row_copy(device_kv, host_kv, device_pages, host_pages, page_size, to_host=False)
    if _kv_transfer(copy, device_pages, host_pages, backend, tuning, False) is Backend.TORCH:
        reference.kv_pages_to_device_ref(host_kv, device_kv, host_pages, device_pages, page_size)


def mamba_states_to_host(
    conv: torch.Tensor,
    ssm: torch.Tensor,
    host_conv: torch.Tensor,
    host_ssm: torch.Tensor,
    slots: torch.Tensor,
    host_pages: torch.Tensor,
    *,
    backend: BackendArg = None,
    tuning: TransferTuning = DEFAULT_TUNING,
) -> None:
    """``host_*[host_pages[i]] = state of slot slots[i]`` (conv and SSM, all Mamba layers).

    ``conv [layers, slots, conv_dim, K-1]``, ``ssm [layers, slots, *S]``; the host tensors
    are ``[host_pages, layers, ...]`` and may be strided views into one buffer per page.
    """
    mamba_index_pair(slots, host_pages)
    conv_copy = state_row_copy("conv", conv, host_conv, slots, host_pages, to_host=True)
    ssm_copy = state_row_copy("ssm", ssm, host_ssm, slots, host_pages, to_host=True)
    if _transfer(conv_copy, slots, host_pages, backend, tuning, True) is Backend.TORCH:
        reference.mamba_states_to_host_ref(conv, ssm, host_conv, host_ssm, slots, host_pages)
        return
    _transfer(ssm_copy, slots, host_pages, backend, tuning, True)


def mamba_states_to_device(
    host_conv: torch.Tensor,
    host_ssm: torch.Tensor,
    conv: torch.Tensor,
    ssm: torch.Tensor,
    host_pages: torch.Tensor,
    slots: torch.Tensor,
    *,
    backend: BackendArg = None,
    tuning: TransferTuning = DEFAULT_TUNING,
) -> None:
    """State of slot ``slots[i]`` = ``host_*[host_pages[i]]`` (conv and SSM, all layers)."""
    mamba_index_pair(slots, host_pages)
    conv_copy = state_row_copy("conv", conv, host_conv, slots, host_pages, to_host=False)
    ssm_copy = state_row_copy("ssm", ssm, host_ssm, slots, host_pages, to_host=False)
    if _transfer(conv_copy, host_pages, slots, backend, tuning, False) is Backend.TORCH:
        reference.mamba_states_to_device_ref(host_conv, host_ssm, conv, ssm, host_pages, slots)
        return
    _transfer(ssm_copy, host_pages, slots, backend, tuning, False)


def _pick_scatter(backend: BackendArg, device: torch.device) -> Backend:
    chosen = parse_backend(backend)
    if chosen in (Backend.COPY_ENGINE, Backend.STAGED):
        name = "copy-engine" if chosen is Backend.COPY_ENGINE else "staged"
        raise ValueError(f"the scatters have no {name} backend; use 'torch' or 'triton'")
    if chosen is None:
        return Backend.TRITON if device.type == "cuda" else Backend.TORCH
    return chosen


def fused_mamba_state_scatter_with_mask(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_indices: torch.Tensor,
    step_indices: torch.Tensor,
    *,
    backend: BackendArg = None,
    tuning: TransferTuning = DEFAULT_TUNING,
) -> None:
    """For each request ``i`` with ``step_indices[i] >= 0``:
    ``dst[:, dst_indices[i]] = src[:, i, step_indices[i]]``.

    ``dst [layers, slots, *state]``, ``src [layers, requests, draft_tokens, *state]``. A
    request with step -1, a step ``>= draft_tokens`` or a slot outside ``dst`` is skipped
    (``dst`` untouched there); when requests share a slot, the last writing one wins. No
    host sync on a GPU.
    """
    scatter_shapes(dst, src, dst_indices, step_indices)
    if _pick_scatter(backend, dst.device) is Backend.TORCH:
        reference.fused_mamba_state_scatter_with_mask_ref(dst, src, dst_indices, step_indices)
        return
    from hicache.kernels.geometry import inner_contiguous
    from hicache.kernels.triton_spec import state_scatter

    if not inner_contiguous(dst, 2) or not inner_contiguous(src, 3):
        raise ValueError(
            "the Triton state scatter needs each state dense in dst and src; pass "
            "backend='torch' for other strides"
        )
    state_scatter(dst, src, dst_indices, step_indices, tuning)


def fused_conv_window_scatter_with_mask(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_indices: torch.Tensor,
    step_indices: torch.Tensor,
    *,
    backend: BackendArg = None,
    tuning: TransferTuning = DEFAULT_TUNING,
) -> None:
    """The masked scatter for conv windows: same contract as
    :func:`fused_mamba_state_scatter_with_mask`.

    ``dst [layers, slots, conv_dim, K-1]``; ``src [layers, requests, draft_tokens,
    conv_dim, K-1]``, dense or :attr:`ConvWindowBuffer.view` of a de-duplicated buffer
    (both give identical bytes).
    """
    scatter_shapes(dst, src, dst_indices, step_indices, state_dims=2)
    if _pick_scatter(backend, dst.device) is Backend.TORCH:
        reference.fused_conv_window_scatter_with_mask_ref(dst, src, dst_indices, step_indices)
        return
    from hicache.kernels.triton_spec import conv_window_scatter

    conv_window_scatter(dst, src, dst_indices, step_indices, tuning)
