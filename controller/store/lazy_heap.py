"""Helpers of the lazy min-heaps that order evictions (the page index's, a tenant's).

An item is ``(order key, seq, entry)``; it is live while its entry is indexed and the
entry's newest item in that tier (``entry.heap_key[tier]`` is its key and seq); the others
are stale, skipped when popped, and removed by :func:`sweep` and :func:`compact`."""

from __future__ import annotations

import heapq

SWEEP_ITEMS = 4  # heap items checked for staleness per push, once a heap has grown


def sweep(heap: list, pos: int, tier: int) -> int:
    """Look at the ``SWEEP_ITEMS`` items of ``heap`` from ``pos`` (a cursor that cycles
    through it) and remove the stale ones; returns where the next sweep starts. A push
    makes at most one item stale, so a heap swept at each push past 1.5 items per entry
    shrinks a little with every push and never needs :func:`compact`."""
    for _ in range(SWEEP_ITEMS):
        if pos >= len(heap):
            pos = 0
        _, seq, e = heap[pos]
        key = e.heap_key[tier]
        if e.attached and key is not None and key[1] == seq:
            pos += 1
        else:
            remove_at(heap, pos)  # the item moved into ``pos`` is looked at next
    return pos


def compact(heap: list, tier: int) -> None:
    """Drop every stale item of ``heap`` at once and heapify what is left."""
    live = [it for it in heap if it[2].attached and it[2].heap_key[tier] == it[:2]]
    heap[:] = live
    heapq.heapify(heap)


def remove_at(heap: list, i: int) -> None:
    """Remove ``heap[i]`` and restore the heap property (the last item takes its place and
    moves down, or up, to where it belongs)."""
    last = heap.pop()
    n = len(heap)
    if i == n:
        return
    pos = i
    while True:
        child = 2 * pos + 1
        if child >= n:
            break
        if child + 1 < n and heap[child + 1] < heap[child]:
            child += 1
        if not heap[child] < last:
            break
        heap[pos] = heap[child]
        pos = child
    if pos == i:
        while pos > 0:
            parent = (pos - 1) // 2
            if not last < heap[parent]:
                break
            heap[pos] = heap[parent]
            pos = parent
    heap[pos] = last
