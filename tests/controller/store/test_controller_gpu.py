"""The controller with CUDA device pools: pinned host pages, streams, ready events."""

from __future__ import annotations

import pytest
import torch

from hicache import CacheConfig, DevicePools
from hicache.controller.store.local import LocalController
from hicache.controller_api import Presence
from hicache.keys import namespace_hash, page_hashes
from tests.support.controller import (
    ALL,
    FULL,
    PAGE,
    Engine,
    _random_like,
    assert_same_bytes,
    controller_config,
    hybrid_layout,
    load_into,
)

pytestmark = pytest.mark.gpu


class CudaEngine(Engine):
    """An Engine whose pools live on the GPU."""

    def __init__(self, layout, seed: int = 0) -> None:
        super().__init__(layout, seed=seed)
        cfg = CacheConfig(
            page_size=PAGE, sliding_window=8, full_slots=1024, mamba_slots=64, device="cuda"
        )
        self.pools = DevicePools.allocate(layout, cfg)


def _setup(tmp_path, **overrides):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    layout = hybrid_layout()
    engine = CudaEngine(layout)
    ctl = LocalController(controller_config(tmp_path, **overrides))
    ctl.register(layout, PAGE, engine.pools)
    return layout, engine, ctl


def test_host_pages_are_pinned_on_a_gpu_machine(tmp_path):
    _, _, ctl = _setup(tmp_path)
    host = ctl.stats()["host"]
    assert host["pinned_bytes"] == host["resident_bytes"] > 0
    ctl.close()


@pytest.mark.parametrize("chunk", [64 << 20, 1], ids=["one-part", "part-per-page"])
def test_backup_waits_for_the_ready_event_then_loads_back_bit_for_bit(tmp_path, chunk):
    # With a part per page, every part's copy must wait for the event, and the handle for
    # every part.
    _, engine, ctl = _setup(tmp_path, backup_chunk_bytes=chunk)
    chain = engine.place(*_hashes(engine, 8), mamba_at=[7])
    views = [v for vs in engine._regions(chain).values() for v in vs]
    fresh = [_random_like(v, engine.gen).cuda() for v in views]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # the forward pass is still writing the KV...
        for v, f in zip(views, fresh):
            v.copy_(f)
        ready = torch.cuda.Event()
        ready.record(side)
    handle = ctl.backup(chain.refs(), ready_event=ready)  # ...so the copy must wait
    assert handle.wait(30.0) and handle.done()
    torch.cuda.synchronize()
    before = engine.snapshot(chain)
    assert before[FULL, 0] == fresh[0].contiguous().view(torch.uint8).cpu().numpy().tobytes()
    engine.scribble(chain)
    assert ctl.lookup(chain.hashes, ALL).leading(FULL, Presence.HOST) == 8
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), before)
    ctl.check_invariants(deep=True)
    ctl.close()


def test_restart_on_gpu_loads_from_disk(tmp_path):
    layout, engine, ctl = _setup(tmp_path)
    chain = engine.place(*_hashes(engine, 6), mamba_at=[5])
    engine.scribble(chain)
    before = engine.snapshot(chain)
    assert ctl.backup(chain.refs()).wait(30.0)
    ctl.close()
    ctl = LocalController(controller_config(tmp_path))
    ctl.register(layout, PAGE, engine.pools)
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), before)
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_whole_load_as_2d_copies_over_runs_of_pages_is_exact(tmp_path, monkeypatch):
    """``TransferEngine.load_runs``: where a load's pages run on both sides, its copy goes
    as 2-D copies on the copy engines (counted here), not the kernel; bytes as before."""
    import hicache.controller.store.transfer_engine as te

    issued: list[int] = []
    real = te.issue_2d_copies
    monkeypatch.setattr(te.TransferEngine, "load_runs", True)
    monkeypatch.setattr(
        te, "issue_2d_copies", lambda plan, s: (issued.append(len(plan)), real(plan, s))
    )
    _, engine, ctl = _setup(tmp_path)
    chain = engine.place(*_hashes(engine, 16), mamba_at=[15])
    engine.scribble(chain)
    before = engine.snapshot(chain)
    assert ctl.backup(chain.refs()).wait(30.0)
    assert_same_bytes(engine.snapshot(load_into(ctl, engine, chain)), before)
    assert issued, "no load went as 2-D copies"
    ctl.check_invariants(deep=True)
    ctl.close()


def _hashes(engine: Engine, pages: int):
    hashes = page_hashes(list(range(pages * PAGE)), engine.fingerprint, PAGE)
    return hashes, [namespace_hash(engine.fingerprint, None), *hashes[:-1]]
