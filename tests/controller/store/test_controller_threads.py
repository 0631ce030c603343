"""Several engines back up, look up and load concurrently through one controller.

Page contents are a function of the page hash, so any engine can check any load. Small
host and disk tiers keep host evictions, disk reads and disk evictions going while the
threads race; afterwards the controller must be consistent and hold nothing.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from hicache.controller.store.local import LocalController
from hicache.keys import namespace_hash, page_hashes
from tests.support.controller import (
    FULL,
    PAGE,
    SWA,
    Chain,
    Engine,
    controller_config,
    hybrid_layout,
)


def _bytes_of(page_hash: bytes, view: torch.Tensor) -> torch.Tensor:
    seed = int.from_bytes(page_hash[:8], "little")
    raw = np.random.default_rng(seed).integers(0, 256, view.numel() * view.element_size())
    return torch.from_numpy(raw.astype(np.uint8)).view(view.dtype).view(view.shape)


def _views(engine: Engine, chain: Chain, i: int):
    full, swa = chain.full_pages[i], chain.swa_pages[i]
    return (
        engine.pools.full.buffer[:, :, full * PAGE : (full + 1) * PAGE],
        engine.pools.swa.buffer[:, :, swa * PAGE : (swa + 1) * PAGE],
    )


def _worker(ctl, engine: Engine, engine_id: str, prefixes, seed: int, errors: list) -> None:
    rng = random.Random(seed)
    session = ctl.session(engine_id)
    session.register(engine.layout, PAGE, engine.pools)
    fp = engine.layout.fingerprint(PAGE)
    try:
        for _ in range(60):
            tokens = rng.choice(prefixes)
            hashes = page_hashes(tokens, fp, PAGE)
            parents = [namespace_hash(fp, None), *hashes[:-1]]
            chain = engine.place(hashes, parents)
            try:
                if rng.random() < 0.5:
                    for i, h in enumerate(hashes):
                        for v in _views(engine, chain, i):
                            v.copy_(_bytes_of(h, v))
                    session.backup(chain.refs((FULL, SWA))).wait(10.0)
                    continue
                lookup = session.lookup(hashes, [FULL, SWA])
                n = min(lookup.leading(FULL), lookup.leading(SWA))
                if n == 0:
                    continue
                refs = [r for r in chain.refs((FULL, SWA)) if r.page_hash in hashes[:n]]
                pin = session.pin([r.key for r in refs], 30.0)
                if pin is None:
                    continue  # evicted since the lookup: a miss
                try:
                    if not session.load(refs, pin, 10.0):
                        continue
                finally:
                    session.unpin(pin)
                for i in range(n):
                    for v in _views(engine, chain, i):
                        if not torch.equal(
                            v.view(torch.uint8), _bytes_of(hashes[i], v).view(torch.uint8)
                        ):
                            errors.append(f"{engine_id}: page {i} of a loaded chain differs")
            finally:
                engine.pools.free_kv_pages(np.array(chain.full_pages))
    except Exception as exc:  # surfaced by the main thread
        errors.append(f"{engine_id}: {exc!r}")


@pytest.mark.parametrize(
    "direct, way", [(True, "disk_to_device"), (False, "disk_to_host")]
)  # disk pages read straight into the engines' CPU slots, or into host pages
def test_concurrent_engines_keep_the_controller_consistent(tmp_path, direct, way):
    layout = hybrid_layout()
    page_value = 512 + 256
    ctl = LocalController(
        controller_config(
            tmp_path,
            host_pool_bytes=48 * (page_value + 42),
            disk_budget_bytes=120 * (page_value + 150),
            reader_threads=3,
            disk_load_direct=direct,
        )
    )
    prefixes = [list(range(k, k + 6 * PAGE)) for k in range(0, 24000, 1000)]
    prefixes += [p[: 3 * PAGE] + [7] * (3 * PAGE) for p in prefixes[:6]]  # shared heads
    errors: list[str] = []
    threads = [
        threading.Thread(
            target=_worker, args=(ctl, Engine(layout, seed=i), f"e{i}", prefixes, i, errors)
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    ctl.check_invariants(deep=True)
    stats = ctl.stats()
    assert stats["pins_active"] == 0
    assert all(e.busy == 0 and e.pins == 0 for e in ctl.store._index)
    # The tiers were under pressure: pages moved every way.
    assert stats["evictions"]["host"]["full"] > 0
    assert stats["evictions"]["disk"]["full"] > 0
    assert stats["transfer"][way]["pages"] > 0
    assert stats["load"]["ok"] > 0
    ctl.close()
