"""On a CUDA device: the tree over CUDA device pools and a LocalController with a pinned
host pool and LMDB, prefixes backed up and loaded back while other copies run on the
controller's streams; bytes equal. Run on a GPU machine with ``pytest -m gpu``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache import Request
from hicache.config import PrefetchPolicy
from hicache.controller.config import ControllerConfig
from hicache.controller.store.local import LocalController
from tests.support.cache import MIXES, MarkerEngine, make_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PS = 16


def seq(n: int, base: int = 0) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 17 + base) % 1999 + 1


@pytest.mark.parametrize("mix", list(MIXES))
def test_cuda_pools_back_up_and_load_back_bit_exact(mix, tmp_path):
    ctrl = LocalController(
        ControllerConfig(host_pool_bytes=64 << 20, disk_path=tmp_path, disk_budget_bytes=256 << 20)
    )
    cache = make_cache(
        mix,
        page_size=PS,
        window=40,
        full_slots=PS * 512,
        controller=ctrl,
        device="cuda",
        prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
    )
    engine = MarkerEngine(cache)
    prompts = [seq(8 * PS, base=b * 101) for b in range(8)]
    for p in prompts:
        engine.run(p)  # write-through backups stream while later requests compute
    cache.flush_backups()
    assert ctrl.flush(60.0)
    cache.evict(full_tokens=10**9)
    cache.pools.full.buffer.fill_(-1)
    # Load every prefix back while the next one's backup of new data is in flight.
    for i, p in enumerate(prompts):
        req = Request(i)
        m = cache.match_prefix(p, req=req)
        assert m.host_hit_len == p.size
        assert cache.load_back(m.load_node, req=req)
        engine.verify_prefix(req, p, req.prefix_len)
        tail = np.concatenate([p, seq(2 * PS, base=7 + i)])
        engine.compute(req, tail, tail.size)
        cache.cache_finished_req(req)
    cache.flush_backups()
    cache.check_invariants()
    ctrl.check_invariants()
    # And from disk after a restart of the controller.
    cache.reset()
    ctrl.close()
    ctrl = LocalController(
        ControllerConfig(host_pool_bytes=64 << 20, disk_path=tmp_path, disk_budget_bytes=256 << 20)
    )
    cache = make_cache(
        mix,
        page_size=PS,
        window=40,
        full_slots=PS * 512,
        controller=ctrl,
        device="cuda",
        prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
    )
    engine = MarkerEngine(cache)
    for p in prompts:
        req = engine.start(p)
        assert req.prefix_len == p.size
        cache.cache_finished_req(req)
    cache.check_invariants()
    ctrl.close()


def test_a_backup_behind_a_busy_stream_keeps_its_pages_past_a_flush_timeout(tmp_path):
    """The engine's stream is busy for about half a second when a prefix is backed up:
    the copy waits on it. A flush that times out meanwhile must leave the prefix's nodes
    locked (the copy would read whatever reused its pages), and once the copy has run the
    host holds the prefix's own bytes."""
    ctrl = LocalController(ControllerConfig(host_pool_bytes=64 << 20, disk_path=None))
    cache = make_cache("full", page_size=PS, full_slots=PS * 64, controller=ctrl, device="cuda")
    engine = MarkerEngine(cache)
    a = seq(4 * PS, base=3)
    req = engine.start(a)
    engine.compute(req, a, a.size)
    torch.cuda._sleep(1_000_000_000)  # about 0.5 s of GPU time on the engine's stream
    cache.cache_finished_req(req)  # write-through: the backup's copy waits on the stream
    cache.flush_backups(timeout_s=0.01)
    cache.check_invariants()
    assert cache.backups.pending, "the backup finished although its copy could not have run yet"
    cache.evict(full_tokens=10**9)
    cache.check_invariants()
    assert cache.match_prefix(a).prefix_len == a.size, "pages freed under a pending copy"
    torch.cuda.synchronize()
    cache.flush_backups()
    assert not cache.backups.pending
    cache.evict(full_tokens=10**9)
    cache.pools.full.buffer.fill_(-1)
    cache.check_invariants()
    again = Request("again")
    m = cache.match_prefix(a, req=again)
    assert m.host_hit_len == a.size
    assert cache.load_back(m.load_node, req=again)
    engine.verify_prefix(again, a, again.prefix_len)
    cache.cache_finished_req(again)
    cache.check_invariants()
    ctrl.close()
