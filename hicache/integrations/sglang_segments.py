"""Where an SGLang host page's bytes sit in its pool, as segments the engine copies itself.

hicache stores an SGLang page as the pool's flat data page (``get_data_page(i,
flat=True)``). With a local sidecar whose host pages are mapped here, the backend copies
those bytes between SGLang's host pool and the sidecar's host page directly, one copy
(:class:`hicache.integrations.engine_blocks.EngineBlocks`), instead of through staging
pages. That needs, for every part of a page, where it lies in the pool's memory: the part
of page ``p`` is a fixed set of byte runs shifted by ``p`` times a fixed stride.

Nothing here knows SGLang's layouts by name: the parts of a page are the views SGLang's
own pool gives for it (``get_data_page(i, flat=False)``, or the per-tensor views of a
pool whose page spans several tensors, such as the Mamba pool), decomposed into runs
contiguous in memory. A pool whose pages are not such views, or whose pages are not
evenly spaced, gets ``None`` and keeps the staging path.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch

from hicache.integrations.engine_blocks import BlockSegment

log = logging.getLogger("hicache.integrations.sglang")

Run = tuple[int, int]  # (byte offset in the storage, bytes)


def view_runs(view: torch.Tensor) -> list[Run]:
    """The byte runs of ``view``, contiguous in memory, in its flat (row-major) order."""
    item = view.element_size()
    dims = [(n, s) for n, s in zip(view.shape, view.stride()) if n != 1]
    inner, span = 1, 1  # elements merged into one run from the innermost dimension
    while dims and dims[-1][1] == span:
        n, _ = dims.pop()
        inner *= n
        span *= n
    base = view.storage_offset()
    runs = []
    for index in itertools.product(*(range(n) for n, _ in dims)):
        start = base + sum(i * s for i, (_, s) in zip(index, dims))
        runs.append((start * item, inner * item))
    return _merged(runs)


def _merged(runs: list[Run]) -> list[Run]:
    out: list[Run] = []
    for start, n in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((start, n))
    return out


def _parts(pool: Any) -> Callable[[int], list[torch.Tensor]] | None:
    """How to get the views that make up the page at token index ``i``, in the order its
    flat data page lists their bytes; None when the pool offers no views."""
    storages = _pool_storages(pool)
    try:
        whole = pool.get_data_page(0, flat=False)
    except Exception:
        whole = None
    if isinstance(whole, torch.Tensor) and _storage_ptr(whole) in storages:
        return lambda i: [pool.get_data_page(i, flat=False)]
    per_tensor = getattr(pool, "_iter_page_tensors", None)
    if callable(per_tensor):
        return lambda i: list(per_tensor(i))
    return None


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _pool_storages(pool: Any) -> set[int]:
    """The storages of every tensor the pool holds as an attribute (or in a list of them)."""
    found = set()
    for value in vars(pool).values():
        for t in value if isinstance(value, list | tuple) else (value,):
            if isinstance(t, torch.Tensor):
                found.add(_storage_ptr(t))
    return found


def page_segments(pool: Any, page_bytes: int) -> tuple[list[BlockSegment], int] | None:
    """The segments of ``pool``'s pages — block ``p`` of each segment's tensor is page
    ``p`` (token index ``p * page_size``) — and the number of pages; None when the pool's
    pages are not evenly spaced views of its memory (the caller keeps the staging path)."""
    ps = int(getattr(pool, "page_size", 1) or 1)
    pages = int(getattr(pool, "size", 0) or 0) // ps
    parts_of = _parts(pool)
    if parts_of is None or pages < 2:
        return None
    storages = _pool_storages(pool)
    try:
        first, second, last = (parts_of(p * ps) for p in (0, 1, pages - 1))
    except Exception as exc:  # a layout whose views cannot be taken page by page
        log.info("hicache: %s pages are not views (%s); staging path", type(pool).__name__, exc)
        return None
    if not (len(first) == len(second) == len(last)) or not first:
        return None
    segments: list[BlockSegment] = []
    dst = 0
    for a, b, z in zip(first, second, last):
        if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in (a, b, z)):
            return None
        if _storage_ptr(a) not in storages or not (
            _storage_ptr(a) == _storage_ptr(b) == _storage_ptr(z)
        ):
            return None
        runs_a, runs_b, runs_z = view_runs(a), view_runs(b), view_runs(z)
        if not runs_a or len(runs_a) != len(runs_b) or len(runs_a) != len(runs_z):
            return None
        stride = runs_b[0][0] - runs_a[0][0]
        if stride <= 0:
            return None
        storage = a.untyped_storage()
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        for (sa, na), (sb, nb), (sz, nz) in zip(runs_a, runs_b, runs_z):
            if (na, nb, nz) != (na, na, na) or sb - sa != stride or sz - sa != stride * (pages - 1):
                return None
            if sz + nz > storage.nbytes():
                return None
            rows = torch.as_strided(whole, (pages, na), (stride, 1), sa)
            segments.append(BlockSegment(rows, 0, na, dst))
            dst += na
    if dst != page_bytes:
        return None
    return segments, pages
