"""A controller killed with SIGKILL mid-write loses nothing it had flushed.

A child process backs up chains whose page bytes are a function of their hashes, calls
``flush()`` after each and reports the chain; the parent kills it at an arbitrary
moment (writes still queued), reopens the same folder and loads every reported chain
back bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.controller.store.local import LocalController
from hicache.keys import namespace_hash, page_hashes
from tests.support.controller import FULL, PAGE, SWA, Engine, controller_config, hybrid_layout

REPO = Path(__file__).resolve().parents[3]

CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from pathlib import Path
    from tests.controller.store.test_controller_crash import fill_by_hash, chain_tokens
    from tests.support.controller import FULL, SWA, PAGE, Engine, controller_config, hybrid_layout
    from hicache.controller.store.local import LocalController
    from hicache.keys import namespace_hash, page_hashes

    layout = hybrid_layout()
    engine = Engine(layout)
    ctl = LocalController(controller_config(Path({tmp!r}), disk_sync=True))
    ctl.register(layout, PAGE, engine.pools)
    fp = layout.fingerprint(PAGE)
    for k in range(10_000):
        hashes = page_hashes(chain_tokens(k), fp, PAGE)
        chain = engine.place(hashes, [namespace_hash(fp, None), *hashes[:-1]])
        fill_by_hash(engine, chain)
        assert ctl.backup(chain.refs((FULL, SWA))).wait(10.0)
        ctl.flush()
        print(k, flush=True)
        engine.pools.free_kv_pages(chain.full_pages)
    """
)


def chain_tokens(k: int) -> list[int]:
    return [k * 1000 + t for t in range(4 * PAGE)]


def _page_bytes(page_hash: bytes, view: torch.Tensor) -> torch.Tensor:
    seed = int.from_bytes(page_hash[:8], "little")
    raw = np.random.default_rng(seed).integers(0, 256, view.numel() * view.element_size())
    return torch.from_numpy(raw.astype(np.uint8)).view(view.dtype).view(view.shape)


def fill_by_hash(engine: Engine, chain) -> None:
    """Write into ``chain``'s device pages the bytes its hashes determine."""
    for (comp, i), views in engine._regions(chain).items():
        for v in views:
            v.copy_(_page_bytes(chain.hashes[i] + bytes((int(comp),)), v))


@pytest.mark.slow
def test_sigkill_keeps_every_flushed_page(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(repo=str(REPO), tmp=str(tmp_path))],
        stdout=subprocess.PIPE,
        text=True,
    )
    reported = []
    for line in child.stdout:
        reported.append(int(line))
        if len(reported) == 25:
            os.kill(child.pid, signal.SIGKILL)
            break
    child.wait()
    assert len(reported) == 25, "the child died before it reported 25 chains"

    layout = hybrid_layout()
    engine = Engine(layout, seed=3)
    ctl = LocalController(controller_config(tmp_path))
    ctl.register(layout, PAGE, engine.pools)  # the dead child's lock is gone with it
    fp = layout.fingerprint(PAGE)
    for k in reported:
        hashes = page_hashes(chain_tokens(k), fp, PAGE)
        parents = [namespace_hash(fp, None), *hashes[:-1]]
        target = engine.place(hashes, parents)
        refs = target.refs((FULL, SWA))
        pin = ctl.pin([r.key for r in refs], 30.0)
        assert pin is not None, f"chain {k} was flushed before the kill but is gone"
        assert ctl.load(refs, pin, 10.0)
        ctl.unpin(pin)
        for (comp, i), views in engine._regions(target).items():
            for v in views:
                want = _page_bytes(hashes[i] + bytes((int(comp),)), v)
                assert torch.equal(v.view(torch.uint8), want.view(torch.uint8)), (k, comp, i)
        engine.pools.free_kv_pages(np.array(target.full_pages))
    ctl.check_invariants(deep=True)
    ctl.close()
