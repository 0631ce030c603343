"""The Triton kernel behind :class:`hicache.kernels.segments.SegmentCopy` (imported only
when a segment copy runs the kernel: the CPU path needs no Triton).

Each row is one segment of one item (a block and its host page); a program moves a tile
of a row's words per loop step, reading the engine's tensor (addressed from one base
pointer plus the segment's offset, so separate allocations share one launch) and writing
the host page through its device-mapped address, or the reverse. An item whose block or
page is outside its tensor is skipped, never written.
"""

from __future__ import annotations

import triton.language as tl

from hicache.kernels.launch import jit_per_call


# What changes from one call to the next (how many rows and tiles, where the index arrays
# start) is not specialised on (launch.jit_per_call): a vLLM worker's loads and stores of
# every size share one compiled variant, where Triton's default compiled (or loaded) a
# new one on the step's path whenever a size first crossed "divisible by 16" or "equal to
# 1". The page stride and segment table stay specialised: they are fixed per copy.
@jit_per_call("num_rows", "num_tiles", pointers=("block_ptr", "page_ptr"))
def copy_segments_kernel(
    dev_ptr,
    host_ptr,
    block_ptr,
    page_ptr,
    seg_base_ptr,
    seg_stride_ptr,
    seg_dst_ptr,
    seg_len_ptr,
    num_rows,
    num_segs,
    page_stride,
    block_limit,
    page_limit,
    num_tiles,
    col_tiles,
    TO_HOST: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    VEC: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for tile in tl.range(pid, num_tiles, nprog):
        row_tile = tile // col_tiles
        col_tile = tile % col_tiles
        rows = row_tile * ROWS + tl.arange(0, ROWS)
        cols = col_tile * COLS + tl.arange(0, COLS)
        in_rows = rows < num_rows
        item = rows // num_segs
        seg = rows % num_segs
        block = tl.load(block_ptr + item, mask=in_rows, other=-1).to(tl.int64)
        page = tl.load(page_ptr + item, mask=in_rows, other=-1).to(tl.int64)
        ok = in_rows & (block >= 0) & (block < block_limit) & (page >= 0) & (page < page_limit)
        base = tl.load(seg_base_ptr + seg, mask=in_rows, other=0)
        stride = tl.load(seg_stride_ptr + seg, mask=in_rows, other=0)
        dst = tl.load(seg_dst_ptr + seg, mask=in_rows, other=0)
        length = tl.load(seg_len_ptr + seg, mask=in_rows, other=0)
        # Every segment's base, stride, offset and length and the page stride are
        # multiples of VEC words (the caller checks): said here, the compiler moves 16
        # bytes per access rather than one 8-byte word (loaded from the table, they are
        # otherwise unknown to it).
        length = tl.multiple_of(length, VEC)
        dev_row = tl.multiple_of(base + block * stride, VEC)
        host_row = tl.multiple_of(page * page_stride + dst, VEC)
        mask = ok[:, None] & (cols[None, :] < length[:, None])
        if TO_HOST:
            values = tl.load(dev_ptr + dev_row[:, None] + cols[None, :], mask=mask)
            tl.store(host_ptr + host_row[:, None] + cols[None, :], values, mask=mask)
        else:
            values = tl.load(host_ptr + host_row[:, None] + cols[None, :], mask=mask)
            tl.store(dev_ptr + dev_row[:, None] + cols[None, :], values, mask=mask)
