"""A helper of the lazy min-heaps that order evictions (the page index's, a tenant's)."""

from __future__ import annotations


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
