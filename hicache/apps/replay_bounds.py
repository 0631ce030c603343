"""Offline bounds of a prefix cache on a trace: the infinite cache and the optimum.

A small simulator over page ids that shares no code with the cache: a request is a chain
of page ids (page ``i`` of a chain always has the same parent, page ``i - 1``), it hits
the longest prefix of its chain that is cached, and after it is served its whole chain is
cached (the pages it missed are inserted). The cache holds at most ``capacity`` pages and
is always prefix-closed (a page is cached only with its parent), so eviction takes leaves.

The optimum evicts, when room is needed for the pages a request inserts, the evictable
leaf whose next use is farthest in the future (pages of the request being served are held).
A parent is used by every request that uses its child, so its next use is never later than
its child's: the farthest leaf is also the farthest page of the whole cache, which makes
this Belady's rule and therefore exact for this model. Hit counts are in pages.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

_NEVER = 1 << 62  # next use of a page that is never requested again


def infinite_hits(chains: Sequence[np.ndarray]) -> int:
    """Pages hit by a cache that never evicts: the leading pages of each chain seen before."""
    seen: set[int] = set()
    hits = 0
    for chain in chains:
        pages = chain.tolist()
        k = 0
        while k < len(pages) and pages[k] in seen:
            k += 1
        hits += k
        seen.update(pages[k:])
    return hits


def _next_uses(chains: Sequence[np.ndarray]) -> list[list[int]]:
    """For each request and position, the index of the next request using that page."""
    upcoming: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in chains]
    for i in range(len(chains) - 1, -1, -1):
        pages = chains[i].tolist()
        out[i] = [upcoming.get(p, _NEVER) for p in pages]
        for p in pages:
            upcoming[p] = i
    return out


def optimal_hits(chains: Sequence[np.ndarray], capacity_pages: int) -> int:
    """Pages hit by the offline optimum (Belady over evictable leaves) with room for
    ``capacity_pages`` pages. Raises ValueError when a chain is longer than the capacity,
    since such a request cannot be served at all."""
    if capacity_pages < 1:
        raise ValueError(f"capacity_pages must be >= 1, got {capacity_pages}")
    next_use = _next_uses(chains)
    cached: set[int] = set()
    nu: dict[int, int] = {}  # next use of each cached page (valid heap item's key)
    children: dict[int, int] = {}  # cached children of each cached page
    parent: dict[int, int | None] = {}
    heap: list[tuple[int, int]] = []  # (-next use, page) of leaves; stale items skipped
    hits = 0
    for i, chain in enumerate(chains):
        pages = chain.tolist()
        n = len(pages)
        if n > capacity_pages:
            raise ValueError(
                f"request {i} needs {n} pages but the capacity is {capacity_pages} pages; "
                "raise the capacity or shorten the trace"
            )
        k = 0
        while k < n and pages[k] in cached:
            k += 1
        hits += k
        uses = next_use[i]
        held = set(pages[:k])
        for j in range(k):
            nu[pages[j]] = uses[j]
        if k and children[pages[k - 1]] == 0:
            heapq.heappush(heap, (-uses[k - 1], pages[k - 1]))
        need = len(cached) + (n - k) - capacity_pages
        skipped: list[tuple[int, int]] = []
        while need > 0:
            item = heapq.heappop(heap)
            page = item[1]
            if page not in cached or children[page] or nu[page] != -item[0]:
                continue  # stale: evicted, got a child, or used since it was pushed
            if page in held:
                skipped.append(item)
                continue
            cached.discard(page)
            del nu[page], children[page]
            up = parent[page]
            if up is not None:
                children[up] -= 1
                if children[up] == 0:
                    heapq.heappush(heap, (-nu[up], up))
            need -= 1
        for item in skipped:
            heapq.heappush(heap, item)
        prev = pages[k - 1] if k else None
        for j in range(k, n):
            p = pages[j]
            cached.add(p)
            nu[p] = uses[j]
            children[p] = 0
            parent[p] = prev
            if prev is not None:
                children[prev] += 1
            prev = p
        if n > k:
            heapq.heappush(heap, (-uses[n - 1], pages[n - 1]))
        if len(heap) > 4 * len(cached) + 1024:
            heap = [e for e in heap if e[1] in cached and not children[e[1]] and nu[e[1]] == -e[0]]
            heapq.heapify(heap)
    return hits
