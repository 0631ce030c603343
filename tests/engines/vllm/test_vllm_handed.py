"""Which host pages a worker copies from under the scheduler's pin (vllm_worker._handed):
its own TP rank's share of the pin's pages, by the load's key order, and none at all where
a page is not on host or the pin is about to lapse."""

from __future__ import annotations

import time
from types import SimpleNamespace

from hicache.integrations.engine_blocks import HandedPages
from hicache.integrations.vllm_manager import HiCacheLoadSpec
from hicache.integrations.vllm_worker import HANDED_MARGIN_S, HiCacheOffloadingWorker


def _spec(pages: list[int], ttl_s: float = 30.0) -> HiCacheLoadSpec:
    spec = HiCacheLoadSpec([b"k0", b"k1", b"k2"])  # the keys only count here
    spec.handed = HandedPages(7, 99, time.monotonic() + ttl_s, tuple(pages))
    return spec


def _handed(rank: int, spec: HiCacheLoadSpec, pairs: list) -> HandedPages | None:
    worker = SimpleNamespace(rank=rank)  # _handed reads only the worker's rank
    return HiCacheOffloadingWorker._handed(worker, spec, pairs)


# Pages rank-major as the scheduler pinned them: rank 0's keys k0..k2, then rank 1's.
TWO_RANKS = [10, 11, 12, 20, 21, 22]
PAIRS = [(2, 0, 5), (0, 0, 6)]  # (key index, group position, block): k2 then k0


def test_each_rank_copies_its_own_pages_in_the_order_of_its_blocks() -> None:
    spec = _spec(TWO_RANKS)
    assert _handed(0, spec, PAIRS).host_pages == (12, 10)
    mine = _handed(1, spec, PAIRS)
    assert mine.host_pages == (22, 20)
    assert (mine.pin_id, mine.instance) == (7, 99)


def test_a_page_off_host_a_pin_near_its_end_or_a_short_list_hands_nothing() -> None:
    assert _handed(1, _spec([10, 11, 12, 20, 21, -1]), PAIRS) is None  # k2 of rank 1: disk
    assert _handed(0, _spec([10, 11, 12, 20, 21, -1]), PAIRS) is not None  # rank 0's are in
    assert _handed(0, _spec(TWO_RANKS, ttl_s=HANDED_MARGIN_S / 2), PAIRS) is None
    assert _handed(2, _spec(TWO_RANKS), PAIRS) is None  # a rank the pin did not cover
    assert _handed(0, HiCacheLoadSpec([b"k0"]), [(0, 0, 1)]) is None  # not answered yet
