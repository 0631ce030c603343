"""Speculative conv-window storage for the Mamba pool: dense or de-duplicated.

During verification of ``D`` draft tokens a Mamba layer produces one conv window per
draft step: ``K-1`` columns of ``conv_dim`` values. Step ``t``'s window is step
``t-1``'s shifted by one column, so consecutive windows share ``K-2`` columns. The
de-duplicated layout stores those columns once, one ``[conv_dim, D+K-2]`` buffer per
(layer, slot), and exposes the windows through an ``as_strided`` view of logical shape
``[layers, slots, D, conv_dim, K-1]`` whose step stride is one column: step ``t``'s
window is columns ``t .. t+K-2``. The view is read-only in spirit (its elements alias);
writers fill the physical buffer, e.g. with :meth:`ConvWindowBuffer.store_windows`.

The de-duplicated layout is used only for linear drafts (top-k <= 1) on CUDA: a tree
draft's steps do not form one chain of shifted windows, and the CPU path keeps the plain
layout that every torch op handles.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ConvWindowLayout(enum.Enum):
    DENSE = "dense"
    DEDUPLICATED = "deduplicated"


def choose_conv_window_layout(draft_topk: int, device: torch.device | str) -> ConvWindowLayout:
    """De-duplicated for a linear draft (``draft_topk <= 1``) on CUDA, dense otherwise."""
    if draft_topk <= 1 and torch.device(device).type == "cuda":
        return ConvWindowLayout.DEDUPLICATED
    return ConvWindowLayout.DENSE


@dataclass(frozen=True)
class ConvWindowBuffer:
    """Conv windows of every draft step for ``slots`` speculative slots of every layer.

    ``storage`` is the allocated tensor (what memory accounting charges: :attr:`nbytes`);
    ``view`` is the logical ``[layers, slots, draft_tokens, conv_dim, K-1]`` tensor the
    scatter kernels read.
    """

    layout: ConvWindowLayout
    storage: torch.Tensor
    view: torch.Tensor

    @classmethod
    def allocate(
        cls,
        layers: int,
        slots: int,
        draft_tokens: int,
        conv_dim: int,
        conv_kernel: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layout: ConvWindowLayout | None = None,
        draft_topk: int = 1,
    ) -> ConvWindowBuffer:
        """Allocate zeroed storage; ``layout=None`` picks it by draft shape and device."""
        if min(layers, slots, draft_tokens, conv_dim) < 1 or conv_kernel < 2:
            raise ValueError(
                f"conv-window buffer needs layers, slots, draft_tokens, conv_dim >= 1 and "
                f"conv_kernel >= 2, got {layers}, {slots}, {draft_tokens}, {conv_dim}, "
                f"{conv_kernel}"
            )
        if layout is None:
            layout = choose_conv_window_layout(draft_topk, device)
        width = conv_kernel - 1
        if layout is ConvWindowLayout.DENSE:
            storage = torch.zeros(
                (layers, slots, draft_tokens, conv_dim, width), dtype=dtype, device=device
            )
            return cls(layout, storage, storage)
        columns = draft_tokens + conv_kernel - 2
        storage = torch.zeros((layers, slots, conv_dim, columns), dtype=dtype, device=device)
        view = storage.as_strided(
            (layers, slots, draft_tokens, conv_dim, width),
            (slots * conv_dim * columns, conv_dim * columns, 1, columns, 1),
            storage.storage_offset(),
        )
        return cls(layout, storage, view)

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated for the buffer."""
        return self.storage.untyped_storage().nbytes()

    def store_windows(self, windows: torch.Tensor) -> None:
        """Write dense windows ``[layers, slots, D, conv_dim, K-1]`` into the buffer.

        In the de-duplicated layout, step 0 supplies columns ``0 .. K-2`` and every later
        step only its newest column; windows that are not shifted copies of each other
        cannot be represented there, which is why tree drafts use the dense layout.
        """
        if tuple(windows.shape) != tuple(self.view.shape):
            raise ValueError(
                f"windows must be {tuple(self.view.shape)}, got {tuple(windows.shape)}"
            )
        if self.layout is ConvWindowLayout.DENSE:
            self.storage.copy_(windows)
            return
        width = windows.shape[-1]
        self.storage[..., :width].copy_(windows[:, :, 0])
        self.storage[..., width:].copy_(windows[:, :, 1:, :, -1].permute(0, 1, 3, 2))
