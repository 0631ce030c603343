"""How a transfer's tensors are cut into contiguous rows, and the checks on its arguments.

Every transfer copies *items* (KV pages, Mamba state slots). One item is ``A × B``
*rows* of ``row_elems`` contiguous elements on both sides: for KV ``A = 2`` (K, V) and
``B = layers``, and a row is one page of one layer (``page_size × heads × head_dim``);
for a Mamba state ``A = 1``, ``B = layers`` and a row is one layer's state. A side of the
copy is a tensor plus the strides, in elements, of the item, A and B indices. Both the
Triton kernel and the copy-engine path consume this description.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowSide:
    """One side of a row copy: row ``(item, a, b)`` starts at element
    ``item * item_stride + a * a_stride + b * b_stride`` of ``tensor``."""

    tensor: torch.Tensor
    item_stride: int
    a_stride: int
    b_stride: int
    num_items: int


@dataclass(frozen=True)
class RowCopy:
    """Source and destination sides plus the row grid they share."""

    src: RowSide
    dst: RowSide
    rows_a: int
    rows_b: int
    row_elems: int

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.src.tensor.element_size()

    @property
    def item_bytes(self) -> int:
        """Bytes of one item (a KV page across all layers, or one state of a slot)."""
        return self.rows_a * self.rows_b * self.row_bytes


def inner_contiguous(t: torch.Tensor, first_dim: int) -> bool:
    """True when dims ``first_dim..`` of ``t`` are laid out densely, row-major."""
    expected = 1
    for d in range(t.dim() - 1, first_dim - 1, -1):
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def index_tensor(name: str, idx: torch.Tensor) -> torch.Tensor:
    """``idx`` as a 1-D integer tensor; raises TypeError/ValueError saying what is wrong."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor of indices, got {type(idx).__name__}")
    if idx.dtype not in (torch.int32, torch.int64):
        # uint8 would index as a boolean mask in torch; floats and bools are no indices.
        raise TypeError(f"{name} must hold integers (int32 or int64), got {idx.dtype}")
    if idx.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(idx.shape)}")
    return idx


def check_distinct(name: str, idx: torch.Tensor) -> None:
    """Raise ValueError when a CPU index tensor of destinations names one entry twice (it
    would receive a blend of two sources). GPU indices are not read back (see below)."""
    if idx.device.type != "cpu" or idx.numel() < 2:
        return
    if torch.unique(idx).numel() != idx.numel():
        raise ValueError(f"{name} names a destination twice; each receives one source")


def check_in_range(name: str, idx: torch.Tensor, limit: int, what: str) -> None:
    """Raise IndexError when a CPU index tensor names an entry outside ``[0, limit)``.

    Indices already on a GPU are not read back here (that would stall the stream); the
    Triton kernels skip out-of-range rows instead of touching memory they do not own.
    """
    if idx.device.type != "cpu" or idx.numel() == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise IndexError(
            f"{name} holds {bad}, outside the {limit} {what}; pass ids handed out by the "
            f"pool that owns the tensor"
        )


def _same_lengths(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.numel() != b.numel():
        raise ValueError(
            f"{a_name} has {a.numel()} entries but {b_name} has {b.numel()}; they pair up "
            f"one to one"
        )


def kv_row_copy(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_pages: torch.Tensor,
    host_pages: torch.Tensor,
    page_size: int,
    to_host: bool,
    whole_pages: bool = True,
) -> RowCopy:
    """Check a KV page transfer's arguments and describe it as rows.

    ``device_kv`` is ``[2, layers, slots, heads, head_dim]`` and ``host_kv`` is
    ``[host_pages, 2, layers, page_size, heads, head_dim]`` (a strided view into a larger
    buffer is fine as long as each page's ``[2, layers, page_size, heads, head_dim]`` block
    is dense). With ``whole_pages`` False only each row (one layer of a page) must be
    dense: a copy of some of the layers, over both tensors narrowed to them.
    """
    if device_kv.dim() != 5 or device_kv.shape[0] != 2:
        raise ValueError(
            f"device_kv must be [2, layers, slots, heads, head_dim], got {tuple(device_kv.shape)}"
        )
    _, layers, slots, heads, dim = device_kv.shape
    if page_size < 1 or slots % page_size:
        raise ValueError(f"page_size={page_size} must be >= 1 and divide the pool's {slots} slots")
    want = (2, layers, page_size, heads, dim)
    if host_kv.dim() != 6 or tuple(host_kv.shape[1:]) != want:
        raise ValueError(
            f"host_kv must be [host_pages, {', '.join(map(str, want))}] to match device_kv, "
            f"got {tuple(host_kv.shape)}"
        )
    if host_kv.dtype != device_kv.dtype:
        raise TypeError(f"host_kv is {host_kv.dtype} but device_kv is {device_kv.dtype}")
    if not inner_contiguous(device_kv, 2):
        raise ValueError("device_kv must be dense in its [slots, heads, head_dim] dims")
    if not inner_contiguous(host_kv, 1 if whole_pages else 3):
        raise ValueError("each host_kv page must be one dense [2, layers, page_size, ...] block")
    device_pages = index_tensor("device_pages", device_pages)
    host_pages = index_tensor("host_pages", host_pages)
    _same_lengths("device_pages", device_pages, "host_pages", host_pages)
    check_in_range("device_pages", device_pages, slots // page_size, "device pages")
    check_in_range("host_pages", host_pages, host_kv.shape[0], "host pages")
    if to_host:
        check_distinct("host_pages", host_pages)
    else:
        check_distinct("device_pages", device_pages)
    dev = RowSide(
        device_kv,
        page_size * device_kv.stride(2),
        device_kv.stride(0),
        device_kv.stride(1),
        slots // page_size,
    )
    host = RowSide(
        host_kv, host_kv.stride(0), host_kv.stride(1), host_kv.stride(2), host_kv.shape[0]
    )
    row_elems = page_size * heads * dim
    if to_host:
        return RowCopy(dev, host, 2, layers, row_elems)
    return RowCopy(host, dev, 2, layers, row_elems)


def state_row_copy(
    name: str,
    state: torch.Tensor,
    host_state: torch.Tensor,
    slots: torch.Tensor,
    host_pages: torch.Tensor,
    to_host: bool,
) -> RowCopy:
    """Check one Mamba state transfer (conv or SSM) and describe it as rows.

    ``state`` is ``[layers, slots, *S]``, ``host_state`` is ``[host_pages, layers, *S]``;
    each slot's and each host page's per-layer state must be dense.
    """
    if state.dim() < 3:
        raise ValueError(f"{name} must be [layers, slots, *state], got {tuple(state.shape)}")
    layers, num_slots, *shape = state.shape
    want = (layers, *shape)
    if tuple(host_state.shape[1:]) != want:
        raise ValueError(
            f"host_{name} must be [host_pages, {', '.join(map(str, want))}] to match {name}, "
            f"got {tuple(host_state.shape)}"
        )
    if host_state.dtype != state.dtype:
        raise TypeError(f"host_{name} is {host_state.dtype} but {name} is {state.dtype}")
    if not inner_contiguous(state, 2) or not inner_contiguous(host_state, 2):
        raise ValueError(f"each {name} state (one layer, one slot) must be dense on both sides")
    check_in_range("slots", slots, num_slots, "state slots")
    check_in_range("host_pages", host_pages, host_state.shape[0], "host pages")
    check_distinct("host_pages" if to_host else "slots", host_pages if to_host else slots)
    dev = RowSide(state, state.stride(1), 0, state.stride(0), num_slots)
    host = RowSide(host_state, host_state.stride(0), 0, host_state.stride(1), host_state.shape[0])
    row_elems = math.prod(shape)
    if to_host:
        return RowCopy(dev, host, 1, layers, row_elems)
    return RowCopy(host, dev, 1, layers, row_elems)


def mamba_index_pair(slots: torch.Tensor, host_pages: torch.Tensor) -> None:
    """Check the index tensors of a Mamba state transfer."""
    index_tensor("slots", slots)
    index_tensor("host_pages", host_pages)
    _same_lengths("slots", slots, "host_pages", host_pages)


def scatter_shapes(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_indices: torch.Tensor,
    step_indices: torch.Tensor,
    state_dims: int | None = None,
) -> None:
    """Check a masked scatter: ``dst [layers, slots, *S]``, ``src [layers, requests, D, *S]``."""
    if dst.dim() < 3 or src.dim() != dst.dim() + 1:
        raise ValueError(
            f"dst must be [layers, slots, *state] and src [layers, requests, draft_tokens, "
            f"*state], got {tuple(dst.shape)} and {tuple(src.shape)}"
        )
    if state_dims is not None and dst.dim() != 2 + state_dims:
        raise ValueError(f"dst must have {state_dims} state dims, got shape {tuple(dst.shape)}")
    if src.shape[0] != dst.shape[0] or tuple(src.shape[3:]) != tuple(dst.shape[2:]):
        raise ValueError(
            f"src {tuple(src.shape)} does not match dst {tuple(dst.shape)} in layers or state"
        )
    if src.dtype != dst.dtype:
        raise TypeError(f"src is {src.dtype} but dst is {dst.dtype}")
    if src.device != dst.device:
        raise ValueError(f"src is on {src.device} but dst is on {dst.device}")
    index_tensor("dst_indices", dst_indices)
    index_tensor("step_indices", step_indices)
    if dst_indices.numel() != src.shape[1] or step_indices.numel() != src.shape[1]:
        raise ValueError(
            f"dst_indices ({dst_indices.numel()}) and step_indices ({step_indices.numel()}) "
            f"need one entry per request of src ({src.shape[1]})"
        )
