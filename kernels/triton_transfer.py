"""The Triton row-copy kernel behind every KV page and Mamba state transfer.

One launch moves every row of every item (all layers, K and V) straight between the
device pool and the host pages: on a GPU the host side is pinned memory that the kernel
reads or writes through its device-mapped address, so no staging buffer exists. The
grid is persistent (a bounded number of programs loop over the tiles), which keeps a
load and a backup on two streams resident side by side.
"""

from __future__ import annotations

import triton.language as tl

from hicache.kernels.copy_engine import device_pointer
from hicache.kernels.geometry import RowCopy
from hicache.kernels.launch import (
    compiled_runner,
    jit_per_call,
    kernel_for,
    max_programs,
    next_pow2,
    require_device_mapped,
)
from hicache.kernels.tuning import DEFAULT_TUNING, TransferTuning


# What changes from one call to the next is not specialised on (launch.jit_per_call).
@jit_per_call("num_rows", "num_tiles", pointers=("src_items_ptr", "dst_items_ptr"))
def _copy_rows_kernel(
    src_ptr,
    dst_ptr,
    src_items_ptr,
    dst_items_ptr,
    num_rows,
    rows_per_item,
    rows_b,
    row_elems,
    src_item_limit,
    dst_item_limit,
    src_item_stride,
    src_a_stride,
    src_b_stride,
    dst_item_stride,
    dst_a_stride,
    dst_b_stride,
    num_tiles,
    col_tiles,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for tile in tl.range(pid, num_tiles, nprog):
        row_tile = tile // col_tiles
        col_tile = tile % col_tiles
        rows = row_tile * ROWS + tl.arange(0, ROWS)
        cols = col_tile * COLS + tl.arange(0, COLS)
        in_rows = rows < num_rows
        item = rows // rows_per_item
        within = rows % rows_per_item
        a = (within // rows_b).to(tl.int64)
        b = (within % rows_b).to(tl.int64)
        src_item = tl.load(src_items_ptr + item, mask=in_rows, other=-1).to(tl.int64)
        dst_item = tl.load(dst_items_ptr + item, mask=in_rows, other=-1).to(tl.int64)
        # An index outside its tensor skips the row: GPU index tensors are not checked
        # on the host, and a bad one must never turn into a stray write.
        row_ok = (src_item >= 0) & (src_item < src_item_limit)
        row_ok = row_ok & (dst_item >= 0) & (dst_item < dst_item_limit)
        src_row = src_item * src_item_stride + a * src_a_stride + b * src_b_stride
        dst_row = dst_item * dst_item_stride + a * dst_a_stride + b * dst_b_stride
        mask = row_ok[:, None] & (cols < row_elems)[None, :]
        values = tl.load(src_ptr + src_row[:, None] + cols[None, :], mask=mask)
        tl.store(dst_ptr + dst_row[:, None] + cols[None, :], values, mask=mask)


class RowLauncher:
    """Launches of the row-copy kernel for one :class:`RowCopy` and many index slices,
    with everything that does not depend on the indices worked out once (the staged path
    launches it once per chunk, so its host time counts)."""

    def __init__(self, copy: RowCopy, tuning: TransferTuning = DEFAULT_TUNING) -> None:
        src, dst = copy.src.tensor, copy.dst.tensor
        # The device is the GPU side of the copy; the host side must be device-mapped.
        self.device = src.device if src.device.type == "cuda" else dst.device
        for side_name, side in (("source", src), ("destination", dst)):
            require_device_mapped(f"the {side_name} tensor", side, self.device)
        tile_elems = max(1, tuning.tile_bytes // src.element_size())
        self.cols = min(next_pow2(copy.row_elems), next_pow2(tile_elems))
        self.rows = max(1, tile_elems // self.cols)
        self.rows_per_item = copy.rows_a * copy.rows_b
        self.col_tiles = -(-copy.row_elems // self.cols)
        self.max_programs = max_programs(self.device, tuning)
        self.kernel = kernel_for(_copy_rows_kernel, self.device)
        self.num_warps = tuning.num_warps
        self.src, self.dst = src, dst
        # What a launch by addresses passes for the two tensors (for pinned host memory,
        # the address the device reads it at, as Triton's own launch finds it).
        self._addrs = tuple(
            device_pointer(t.data_ptr()) if t.device.type == "cpu" else t.data_ptr()
            for t in (src, dst)
        ) if self.device.type == "cuda" else (0, 0)  # fmt: skip
        self._runner = None  # the compiled variant's launch (launch.compiled_runner)
        self.scalars = (
            self.rows_per_item,
            copy.rows_b,
            copy.row_elems,
            copy.src.num_items,
            copy.dst.num_items,
            copy.src.item_stride,
            copy.src.a_stride,
            copy.src.b_stride,
            copy.dst.item_stride,
            copy.dst.a_stride,
            copy.dst.b_stride,
        )

    def _tiles(self, n_items: int) -> tuple[int, int, int]:
        """A launch over ``n_items`` items: its rows, its tiles and its persistent grid."""
        num_rows = n_items * self.rows_per_item
        num_tiles = -(-num_rows // self.rows) * self.col_tiles
        return num_rows, num_tiles, min(num_tiles, self.max_programs)

    def launch(self, src_items, dst_items, capture: bool = False) -> None:
        """Copy every row of items ``src_items[i] -> dst_items[i]`` (index tensors already
        on the launch device) in one launch on the current stream. ``capture``: keep the
        compiled variant this launch ran for :meth:`launch_addrs` (only for index tensors
        that start 16-byte aligned, as every later launch by addresses must)."""
        n_items = src_items.numel()
        if n_items == 0:
            return
        num_rows, num_tiles, grid = self._tiles(n_items)
        rows_per_item, *rest = self.scalars
        ran = self.kernel[(grid,)](
            self.src,
            self.dst,
            src_items,
            dst_items,
            num_rows,
            rows_per_item,
            *rest,
            num_tiles,
            self.col_tiles,
            ROWS=self.rows,
            COLS=self.cols,
            num_warps=self.num_warps,
        )
        if capture and self._runner is None and self.device.type == "cuda":
            self._runner = compiled_runner(ran)

    def launch_addrs(self, src_items: int, dst_items: int, n_items: int, stream: int) -> bool:
        """:meth:`launch` with the index arrays given by address (pinned, 16-byte aligned,
        ``n_items`` each) on the raw ``stream``, through the compiled variant a captured
        launch chose, without Triton's per-call binding; False (nothing launched) when no
        variant is captured yet or it takes other arguments."""
        run = self._runner
        if not run:
            return False
        if n_items == 0:
            return True
        num_rows, num_tiles, grid = self._tiles(n_items)
        args = (*self._addrs, src_items, dst_items, num_rows, *self.scalars, num_tiles,
                self.col_tiles, self.rows, self.cols)  # fmt: skip
        try:
            run(grid, stream, args)
        except (TypeError, ValueError, SystemError):  # a launcher of other arguments
            self._runner = False
            return False
        return True


def copy_rows(
    copy: RowCopy,
    src_items,
    dst_items,
    tuning: TransferTuning = DEFAULT_TUNING,
) -> None:
    """Copy every row of items ``src_items[i] -> dst_items[i]`` in one launch.

    Runs on the current CUDA stream and returns without waiting; on CPU tensors it runs
    under Triton's interpreter and has finished on return.
    """
    if src_items.numel() == 0:
        return
    launcher = RowLauncher(copy, tuning)
    # The kernel reads the indices as packed arrays: a view (a column of a table) is not.
    src_items = src_items.to(launcher.device, non_blocking=True).contiguous()
    dst_items = dst_items.to(launcher.device, non_blocking=True).contiguous()
    launcher.launch(src_items, dst_items)
