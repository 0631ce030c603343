"""Triton kernels for speculative decoding: masked scatters of Mamba and conv-window state.

A scatter is two launches and no host sync: a claim pass records, per destination slot,
the last request that writes it (an atomic max over request ids), then the copy pass lets
every (request, layer, block) program write only if it owns its slot. That gives the
sequential "last writer wins" result for duplicate slots, and skips requests whose step
is -1 or whose slot or step is out of range, without ever reading the mask on the host.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hicache.kernels.launch import kernel_for
from hicache.kernels.tuning import DEFAULT_TUNING, TransferTuning

_CLAIM_BLOCK = 128
_MAX_GRID_YZ = 65535  # CUDA's limit on grid dims y and z (layers, requests)


@triton.jit
def _claim_kernel(
    claim_ptr,
    dst_idx_ptr,
    step_ptr,
    num_requests,
    num_slots,
    num_steps,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_req = req < num_requests
    slot = tl.load(dst_idx_ptr + req, mask=in_req, other=-1).to(tl.int64)
    step = tl.load(step_ptr + req, mask=in_req, other=-1).to(tl.int64)
    writes = in_req & (step >= 0) & (step < num_steps) & (slot >= 0) & (slot < num_slots)
    safe_slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
    tl.atomic_max(claim_ptr + safe_slot, req, mask=writes)


@triton.jit
def _state_scatter_kernel(
    dst_ptr,
    src_ptr,
    claim_ptr,
    dst_idx_ptr,
    step_ptr,
    num_slots,
    num_steps,
    state_elems,
    dst_layer_stride,
    dst_slot_stride,
    src_layer_stride,
    src_req_stride,
    src_step_stride,
    BLOCK: tl.constexpr,
):
    block = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    req = tl.program_id(2)
    slot = tl.load(dst_idx_ptr + req).to(tl.int64)
    step = tl.load(step_ptr + req).to(tl.int64)
    slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
    step = tl.minimum(tl.maximum(step, 0), num_steps - 1)
    # Only a request that claimed its slot writes; a skipped request never claims one.
    writes = tl.load(claim_ptr + slot) == req
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = tl.where(writes, cols < state_elems, False)
    src = src_ptr + layer * src_layer_stride + req.to(tl.int64) * src_req_stride
    src += step * src_step_stride
    dst = dst_ptr + layer * dst_layer_stride + slot * dst_slot_stride
    tl.store(dst + cols, tl.load(src + cols, mask=mask), mask=mask)


@triton.jit
def _conv_window_scatter_kernel(
    dst_ptr,
    src_ptr,
    claim_ptr,
    dst_idx_ptr,
    step_ptr,
    num_slots,
    num_steps,
    conv_dim,
    dst_layer_stride,
    dst_slot_stride,
    dst_dim_stride,
    dst_col_stride,
    src_layer_stride,
    src_req_stride,
    src_step_stride,
    src_dim_stride,
    src_col_stride,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    block = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    req = tl.program_id(2)
    slot = tl.load(dst_idx_ptr + req).to(tl.int64)
    step = tl.load(step_ptr + req).to(tl.int64)
    slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
    step = tl.minimum(tl.maximum(step, 0), num_steps - 1)
    writes = tl.load(claim_ptr + slot) == req
    flat = block * BLOCK + tl.arange(0, BLOCK)
    mask = tl.where(writes, flat < conv_dim * WIDTH, False)
    # Element (c, k) of step t's window; in the de-duplicated view the step stride is one
    # column, so consecutive steps read overlapping columns of one buffer.
    c = (flat // WIDTH).to(tl.int64)
    k = (flat % WIDTH).to(tl.int64)
    src = src_ptr + layer * src_layer_stride + req.to(tl.int64) * src_req_stride
    src += step * src_step_stride
    dst = dst_ptr + layer * dst_layer_stride + slot * dst_slot_stride
    values = tl.load(src + c * src_dim_stride + k * src_col_stride, mask=mask)
    tl.store(dst + c * dst_dim_stride + k * dst_col_stride, values, mask=mask)


def _claims(
    dst_indices: torch.Tensor, step_indices: torch.Tensor, num_slots: int, num_steps: int
) -> torch.Tensor:
    """Per destination slot, the last request that writes it (-1: none)."""
    device = dst_indices.device
    claim = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
    n = dst_indices.numel()
    grid = (-(-n // _CLAIM_BLOCK),)
    kernel_for(_claim_kernel, device)[grid](
        claim, dst_indices, step_indices, n, num_slots, num_steps, BLOCK=_CLAIM_BLOCK
    )
    return claim


def _prepare(
    dst: torch.Tensor, src: torch.Tensor, dst_indices: torch.Tensor, step_indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    layers, requests = src.shape[0], src.shape[1]
    if requests == 0 or dst.shape[1] == 0 or src.shape[2] == 0 or layers == 0:
        return None
    if requests > _MAX_GRID_YZ or layers > _MAX_GRID_YZ:
        raise ValueError(
            f"a scatter launch takes at most {_MAX_GRID_YZ} requests and layers, got "
            f"{requests} and {layers}; split the batch"
        )
    # The kernels read the indices as packed arrays: a view (a column of a table) is not.
    dst_indices = dst_indices.to(dst.device, non_blocking=True).contiguous()
    step_indices = step_indices.to(dst.device, non_blocking=True).contiguous()
    claim = _claims(dst_indices, step_indices, dst.shape[1], src.shape[2])
    return claim, dst_indices, step_indices


def _block(dst: torch.Tensor, elems: int, tuning: TransferTuning) -> int:
    """Elements per program: the tuned byte budget, at most the state rounded up to a
    power of two, at least 16."""
    return min(
        max(16, tuning.scatter_block_bytes // dst.element_size()),
        1 << max(4, (elems - 1).bit_length()),
    )


def state_scatter(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_indices: torch.Tensor,
    step_indices: torch.Tensor,
    tuning: TransferTuning = DEFAULT_TUNING,
) -> None:
    """Triton ``fused_mamba_state_scatter_with_mask`` (arguments already checked).

    Each (layer, slot) state of ``dst`` and each (layer, request, step) state of ``src``
    must be dense.
    """
    prepared = _prepare(dst, src, dst_indices, step_indices)
    if prepared is None:
        return
    claim, dst_indices, step_indices = prepared
    state_elems = math.prod(dst.shape[2:])
    block = _block(dst, state_elems, tuning)
    grid = (-(-state_elems // block), src.shape[0], src.shape[1])
    kernel_for(_state_scatter_kernel, dst.device)[grid](
        dst,
        src,
        claim,
        dst_indices,
        step_indices,
        dst.shape[1],
        src.shape[2],
        state_elems,
        dst.stride(0),
        dst.stride(1),
        src.stride(0),
        src.stride(1),
        src.stride(2),
        BLOCK=block,
        num_warps=tuning.num_warps,
    )


def conv_window_scatter(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_indices: torch.Tensor,
    step_indices: torch.Tensor,
    tuning: TransferTuning = DEFAULT_TUNING,
) -> None:
    """Triton ``fused_conv_window_scatter_with_mask`` (arguments already checked).

    ``src`` may have any strides, which is what lets it read the de-duplicated view.
    """
    prepared = _prepare(dst, src, dst_indices, step_indices)
    if prepared is None:
        return
    claim, dst_indices, step_indices = prepared
    conv_dim, width = dst.shape[2], dst.shape[3]
    elems = conv_dim * width
    block = _block(dst, elems, tuning)
    grid = (-(-elems // block), src.shape[0], src.shape[1])
    kernel_for(_conv_window_scatter_kernel, dst.device)[grid](
        dst,
        src,
        claim,
        dst_indices,
        step_indices,
        dst.shape[1],
        src.shape[2],
        conv_dim,
        *dst.stride(),
        *src.stride(),
        WIDTH=width,
        BLOCK=block,
        num_warps=tuning.num_warps,
    )
