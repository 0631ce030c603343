"""Torch reference versions of every transfer kernel: the CPU path and the test oracle.

Layouts (see docs/architecture.md):

* device KV pool: ``[2, layers, slots, heads, head_dim]`` (K then V); a device page ``p``
  is slots ``p*page_size ... p*page_size + page_size - 1``;
* host KV pages: ``[host_pages, 2, layers, page_size, heads, head_dim]`` — one page of one
  component is one contiguous buffer across all layers (page-first);
* device Mamba pool: conv ``[layers, slots, conv_dim, K-1]``, SSM ``[layers, slots, *S]``;
* host Mamba pages: conv ``[host_pages, layers, conv_dim, K-1]`` and SSM
  ``[host_pages, layers, *S]``, possibly strided views into one byte buffer per page.
"""

from __future__ import annotations

import torch


def _device_page_view(device_kv: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[2, L, slots, H, D]`` viewed as ``[2, L, pages, page_size, H, D]``."""
    two, layers, slots, heads, dim = device_kv.shape
    return device_kv.view(two, layers, slots // page_size, page_size, heads, dim)


def kv_pages_to_host_ref(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_pages: torch.Tensor,
    host_pages: torch.Tensor,
    page_size: int,
) -> None:
    """``host_kv[host_pages[i]] = device page device_pages[i]`` (all layers, K and V)."""
    src = _device_page_view(device_kv, page_size)[:, :, device_pages.to(device_kv.device)]
    # [2, L, n, ps, H, D] -> [n, 2, L, ps, H, D]
    host_kv[host_pages.to(host_kv.device)] = src.permute(2, 0, 1, 3, 4, 5).to(host_kv.device)


def kv_pages_to_device_ref(
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    host_pages: torch.Tensor,
    device_pages: torch.Tensor,
    page_size: int,
) -> None:
    """Device page ``device_pages[i]`` = ``host_kv[host_pages[i]]`` (all layers, K and V)."""
    src = host_kv[host_pages.to(host_kv.device)].to(device_kv.device)  # [n, 2, L, ps, H, D]
    view = _device_page_view(device_kv, page_size)
    view[:, :, device_pages.to(device_kv.device)] = src.permute(1, 2, 0, 3, 4, 5)


def mamba_states_to_host_ref(
    conv: torch.Tensor,
    ssm: torch.Tensor,
    host_conv: torch.Tensor,
    host_ssm: torch.Tensor,
    slots: torch.Tensor,
    host_pages: torch.Tensor,
) -> None:
    """``host_*[host_pages[i]] = state of slot slots[i]`` (all Mamba layers)."""
    s = slots.to(conv.device)
    h = host_pages.to(host_conv.device)
    host_conv[h] = conv[:, s].transpose(0, 1).to(host_conv.device)
    host_ssm[h] = ssm[:, s].transpose(0, 1).to(host_ssm.device)


def mamba_states_to_device_ref(
    host_conv: torch.Tensor,
    host_ssm: torch.Tensor,
    conv: torch.Tensor,
    ssm: torch.Tensor,
    host_pages: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """State of slot ``slots[i]`` = ``host_*[host_pages[i]]`` (all Mamba layers)."""
    h = host_pages.to(host_conv.device)
    s = slots.to(conv.device)
    conv[:, s] = host_conv[h].transpose(0, 1).to(conv.device)
    ssm[:, s] = host_ssm[h].transpose(0, 1).to(ssm.device)


def scatter_targets_ref(
    dst_indices: torch.Tensor, step_indices: torch.Tensor, num_slots: int, num_steps: int
) -> torch.Tensor:
    """The slot each request writes in a masked scatter, or -1 where it writes nothing.

    A request writes when ``0 <= step < num_steps`` and ``0 <= dst < num_slots``; when
    several such requests name the same slot, the last one wins (as in a Python loop over
    the requests), so the result never depends on thread scheduling.
    """
    dst = dst_indices.to(torch.int64)
    step = step_indices.to(dst.device, torch.int64)
    valid = (step >= 0) & (step < num_steps) & (dst >= 0) & (dst < num_slots)
    n = dst.numel()
    order = torch.arange(n, device=dst.device)
    later_same = (dst[:, None] == dst[None, :]) & valid[None, :] & (order[None, :] > order[:, None])
    winner = valid & ~later_same.any(dim=1)
    return torch.where(winner, dst, torch.full_like(dst, -1))


def fused_mamba_state_scatter_with_mask_ref(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_indices: torch.Tensor,
    step_indices: torch.Tensor,
) -> None:
    """``dst[:, dst_indices[i]] = src[:, i, step_indices[i]]`` for every request that writes.

    ``dst`` is ``[layers, slots, *state]``, ``src`` is ``[layers, requests, draft_tokens,
    *state]``. Requests with a negative step, a step past the draft or a slot outside
    ``dst`` leave ``dst`` untouched; of duplicates, the last writing request wins.
    """
    targets = scatter_targets_ref(dst_indices, step_indices, dst.shape[1], src.shape[2])
    req = torch.nonzero(targets >= 0).squeeze(1)
    steps = step_indices.to(targets.device, torch.int64)[req]
    dst[:, targets[req].to(dst.device)] = src[:, req.to(src.device), steps.to(src.device)]


def fused_conv_window_scatter_with_mask_ref(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_indices: torch.Tensor,
    step_indices: torch.Tensor,
) -> None:
    """The conv-window scatter: same contract as the Mamba state scatter.

    ``dst`` is ``[layers, slots, conv_dim, K-1]``; ``src`` is ``[layers, requests,
    draft_tokens, conv_dim, K-1]``, dense or the de-duplicated strided view.
    """
    fused_mamba_state_scatter_with_mask_ref(dst, src, dst_indices, step_indices)
