"""Stores an engine copies itself (store/engine_stores.py): host pages handed out by
``begin_store`` are invisible until ``commit_store``, and come back whole when the store
is given up, expires, or its engine goes."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from hicache.controller.store.engine_stores import HELD, NO_ROOM
from hicache.controller.store.host_pool import FRAME_BYTES
from hicache.controller_api import P_HOST, ControllerError
from tests.support.controller import (
    FULL,
    Engine,
    load_into,
    registered_controller,
)


def _write(ctl, chain_bytes: dict, pages: list[int]) -> None:
    """The engine's one copy: each FULL page's bytes into the host page it was handed."""
    host = ctl.store._host[FULL].buffer
    for i, page in enumerate(pages):
        data = np.frombuffer(chain_bytes[FULL, i], dtype=np.uint8)
        host[page, FRAME_BYTES : FRAME_BYTES + data.size] = torch.from_numpy(data.copy())


def _free_host_pages(ctl) -> int:
    return ctl.store._host[FULL].free_pages


def _on_host(ctl, chain) -> list[bool]:
    rows = ctl.lookup(chain.hashes, [FULL]).presence[FULL]
    return [int(p) == P_HOST for p in rows]


def test_a_committed_store_is_served_exactly_and_only_after_the_commit(tmp_path):
    layout, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(list(range(16)))
    want = engine.snapshot(chain)
    free = _free_host_pages(ctl)

    store_id, pages = ctl.begin_store(chain.refs([FULL]), 30.0)
    ctl.check_invariants()
    assert min(pages) >= 0 and _free_host_pages(ctl) == free - len(pages)
    assert _on_host(ctl, chain) == [False] * 4  # handed out, not visible
    _write(ctl, want, pages)
    assert ctl.commit_store(store_id, True) == 4
    ctl.check_invariants()

    assert _on_host(ctl, chain) == [True] * 4
    reader = Engine(layout, seed=7)
    ctl.register(layout, 4, reader.pools, engine_id="reader")
    got = load_into(ctl, reader, chain, components=(FULL,), engine_id="reader")
    loaded = {k: v for k, v in reader.snapshot(got).items() if k[0] is FULL}
    assert loaded == {k: v for k, v in want.items() if k[0] is FULL}
    ctl.check_invariants()
    assert ctl.flush(10.0)
    ctl.check_invariants(deep=True)


def test_pages_held_already_are_not_handed_out_and_a_full_pool_says_so(tmp_path):
    _, engine, ctl = registered_controller(tmp_path, host_pool_bytes=64 << 10)
    chain = engine.write_chain(list(range(16)))
    pool_pages = _free_host_pages(ctl)
    store_id, pages = ctl.begin_store(chain.refs([FULL]), 30.0)
    _write(ctl, engine.snapshot(chain), [p for p in pages if p >= 0])
    ctl.commit_store(store_id, True)
    # On disk now, so evictable: without the flush whether the next store or the last
    # one takes these pages would race the disk writer.
    assert ctl.flush(10.0)

    _, again = ctl.begin_store(chain.refs([FULL]), 30.0)
    assert again == [HELD] * 4
    big = engine.write_chain(list(range(100, 100 + 4 * 100)))  # more pages than the pool
    _, many = ctl.begin_store(big.refs([FULL]), 30.0)  # every host page handed out
    handed = [p for p in many if p >= 0]
    assert NO_ROOM in many and sorted(handed) == list(range(pool_pages))  # the first chain's too
    late = engine.write_chain(list(range(1000, 1016)))
    _, none = ctl.begin_store(late.refs([FULL]), 30.0)
    assert none == [NO_ROOM] * 4  # nothing handed out is taken back for another store
    ctl.check_invariants()


@pytest.mark.parametrize("how", ["given_up", "expired", "engine_gone"])
def test_a_store_that_is_not_committed_leaves_nothing_behind(tmp_path, how):
    _, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(list(range(16)))
    free = _free_host_pages(ctl)
    store_id, pages = ctl.begin_store(chain.refs([FULL]), 0.05 if how == "expired" else 30.0)
    _write(ctl, engine.snapshot(chain), pages)

    if how == "given_up":
        assert ctl.commit_store(store_id, False) == 0
    elif how == "expired":
        time.sleep(0.1)
        assert ctl.commit_store(store_id, True) == 0  # too late: never published
    else:
        ctl.unregister("local")  # the sidecar does this when an engine's lease lapses

    ctl.check_invariants()
    assert _free_host_pages(ctl) == free
    assert _on_host(ctl, chain) == [False] * 4
    assert ctl.lookup(chain.hashes, [FULL]).presence[FULL].tolist() == [0] * 4
    ctl.check_invariants(deep=True)


def test_only_the_engine_that_was_handed_the_pages_commits_them(tmp_path):
    layout, engine, ctl = registered_controller(tmp_path)
    other = Engine(layout, seed=3)
    ctl.register(layout, 4, other.pools, engine_id="other")
    chain = engine.write_chain(list(range(16)))
    store_id, _ = ctl.begin_store(chain.refs([FULL]), 30.0)
    with pytest.raises(ControllerError, match="belongs to engine"):
        ctl.commit_store(store_id, True, engine_id="other")
    assert ctl.commit_store(store_id, False) == 0
    assert ctl.commit_store(store_id, True) == 0  # once only
    ctl.check_invariants()
