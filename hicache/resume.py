"""How much of a prompt a set of tiers can *resume*: every component's match rule applied to
where its pages are, not just the longest run of KV pages.

The rules are the tree's (docs/ARCHITECTURE.md §3): a prefix of ``n`` pages resumes when

* FULL: pages ``0 .. n-1`` are all there;
* SWA: the pages holding the last ``sliding_window`` tokens of the prefix are all there
  (``ceil(sliding_window / page_size)`` pages ending at page ``n-1``, fewer when the prefix
  is shorter than the window);
* MAMBA: the state at the end of page ``n-1`` is there.

A component the model does not have is left out. The sidecar's ``score`` verb applies this
to its index, and :mod:`hicache.integrations.router` to the KV events of several sidecars,
so both answer the same number for the same residency.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from hicache.types import ComponentType

__all__ = ["resumable_pages", "window_pages"]


def window_pages(sliding_window: int | None, page_size: int) -> int:
    """Pages an SWA match needs at its end: ``ceil(sliding_window / page_size)``."""
    if sliding_window is None:
        return 0
    return math.ceil(sliding_window / page_size)


def resumable_pages(
    rows: Mapping[ComponentType, Sequence[int]],
    held: Callable[[int], bool],
    swa_window_pages: int = 0,
) -> int:
    """The longest prefix, in pages, that every component in ``rows`` can resume.

    ``rows``: per component, one value per page of the prompt (a presence, a tier mask…);
    ``held(value)`` says whether that page counts. FULL must be in ``rows``;
    ``swa_window_pages`` (see :func:`window_pages`) is needed when SWA is. Mutates nothing.
    """
    full = rows[ComponentType.FULL]
    n = 0
    while n < len(full) and held(full[n]):
        n += 1
    swa = rows.get(ComponentType.SWA)
    mamba = rows.get(ComponentType.MAMBA)
    if swa is not None and swa_window_pages < 1:
        raise ValueError("an SWA component needs its window (sliding_window) to be scored")
    # SWA pages held in an unbroken run ending at each page.
    run = []
    if swa is not None:
        length = 0
        for i in range(n):
            length = length + 1 if held(swa[i]) else 0
            run.append(length)
    while n > 0:
        end = n - 1
        if (swa is None or run[end] >= min(n, swa_window_pages)) and (
            mamba is None or held(mamba[end])
        ):
            return n
        n -= 1
    return 0
