"""A load-back that fills an SWA tombstone marks the node's SWA as backed only when the
node's FULL pages are marked backed: their backup may have reported failure (a chunked
backup whose later part failed keeps the parts copied before it), and ARCHITECTURE §3
says aux data on a tier implies FULL data on that tier. (It marked it backed anyway.)"""

from __future__ import annotations

import numpy as np

from hicache import ComponentType, Request
from hicache.config import WritePolicy
from hicache.controller_api import CompletedTransfer
from tests.support.cache import MarkerEngine, make_cache
from tests.support.fake_controller import FakeController

PS = 4


class PartlyFailingBackups(FakeController):
    """Every backup copies its pages but reports failure: wait() is True only when every
    page is held, and a backup whose last part failed holds the parts before it."""

    def backup(self, refs, ready_event=None, tenant=None):
        super().backup(refs, ready_event, tenant)
        return CompletedTransfer(False)


def test_load_back_into_swa_tombstone_keeps_aux_backed_only_with_full():
    cache = make_cache(
        "full+swa",
        page_size=PS,
        window=PS,
        controller=PartlyFailingBackups(),
        write_policy=WritePolicy.WRITE_THROUGH,
    )
    engine = MarkerEngine(cache)
    tokens = (np.arange(2 * PS, dtype=np.int64) * 7) % 97 + 1
    engine.run(tokens, chunk=PS)  # nodes A=[0,4), B=[4,8); backups "failed", pages held
    cache.flush_backups()
    cache.check_invariants()
    swa = cache.tree.by_type[ComponentType.SWA]
    a = cache.match_prefix(tokens).last_node.parent
    assert a.end == PS and not a.data[0].backed
    cache.evict(swa_tokens=PS)  # A (internal, least recently used): SWA tombstone
    assert a.data[swa.idx].value is None and a.data[0].value is not None
    req = Request("r")
    m = cache.match_prefix(tokens[:PS], req=req)
    assert m.prefix_len == 0 and m.load_node is a
    assert cache.load_back(a, req=req)
    engine.verify_prefix(req, tokens, PS)
    cache.check_invariants()
    assert not a.data[swa.idx].backed
