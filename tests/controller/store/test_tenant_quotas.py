"""Per-tenant quotas of host and disk bytes (controller/store/tenants.py, tenant_ops.py):
a tenant over its quota evicts its own least recently used pages, never another
tenant's; a page that cannot fit is not stored (counted), and nothing is served wrong."""

from __future__ import annotations

import pytest

from hicache.controller.config import ControllerConfig, parse_tenant_quotas
from hicache.controller.store.local import LocalController
from hicache.controller_api import Presence
from hicache.types import ConfigError, Tier
from tests.support.controller import FULL, PAGE, Engine, assert_same_bytes, hybrid_layout, load_into
from tests.support.controller import controller_config as _config


def _controller(tmp_path, **overrides) -> tuple[Engine, LocalController]:
    engine = Engine(hybrid_layout())
    ctl = LocalController(_config(tmp_path, **overrides))
    ctl.register(engine.layout, PAGE, engine.pools)
    return engine, ctl


def _page_bytes(ctl: LocalController) -> int:
    return ctl.store.host_page_bytes()[FULL]


def _store(ctl, engine, seed: int, pages: int, tenant: str | None) -> object:
    """A chain of ``pages`` FULL pages backed up as ``tenant``'s; the chain."""
    chain = engine.write_chain(range(seed * 1000, seed * 1000 + pages * PAGE))
    ok = ctl.backup(chain.refs((FULL,)), tenant=tenant).wait(10.0)
    ctl.check_invariants()
    return chain, ok


def _full_bytes(engine, chain) -> dict:
    return {k: v for k, v in engine.snapshot(chain).items() if k[0] is FULL}


def _where(ctl, chain) -> list[int]:
    return ctl.lookup(chain.hashes, [FULL]).presence[FULL].tolist()


def _tenant(ctl, name: str) -> dict:
    return ctl.stats()["tenants"]["top"][name]


def test_a_flooding_tenant_evicts_its_own_pages_on_host_never_another_tenants(tmp_path):
    engine, probe = _controller(tmp_path / "probe", disk_path=None)
    page = _page_bytes(probe)
    probe.close()
    engine, ctl = _controller(
        tmp_path,
        disk_path=None,
        host_pool_bytes=64 * page,  # room for every tenant's quota: only quotas evict
        tenant_host_quota_bytes=6 * page,
        tenant_quotas=["quiet:host=none"],
    )
    quiet, ok = _store(ctl, engine, 1, 5, "quiet")
    assert ok
    before = _full_bytes(engine, quiet)
    chains = []
    for seed in range(2, 22):  # 20 chains of 2 pages: 40 pages against a quota of 6
        chain, ok = _store(ctl, engine, seed, 2, "flood")
        assert ok, "within its quota, evicting its own"
        chains.append(chain)
        flood = _tenant(ctl, "flood")
        assert flood["host_bytes"] <= 6 * page
    assert _where(ctl, quiet) == [Presence.HOST] * 5
    # Its least recently used went first: the last three chains stay, whole.
    assert [_where(ctl, c) for c in chains[-3:]] == [[Presence.HOST] * 2] * 3
    assert all(_where(ctl, c) == [Presence.ABSENT] * 2 for c in chains[:-3])
    flood = _tenant(ctl, "flood")
    assert flood["quota_evicted"]["host"] == 40 - 6
    assert flood["evicted"]["host"] == 40 - 6 and flood["host_quota_bytes"] == 6 * page
    assert _tenant(ctl, "quiet")["evicted"]["host"] == 0
    assert ctl.stats()["failures"]["tenant_quota"] == 0
    engine.scribble(quiet)
    target = load_into(ctl, engine, quiet, components=(FULL,))
    assert_same_bytes(_full_bytes(engine, target), before)
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_tenant_over_its_disk_quota_deletes_its_own_pages_from_lmdb(tmp_path):
    engine, ctl = _controller(tmp_path)
    page = _page_bytes(ctl)
    ctl.close()
    engine, ctl = _controller(
        tmp_path / "2", tenant_disk_quota_bytes=4 * page, tenant_quotas=["quiet:disk=none"]
    )
    quiet, _ = _store(ctl, engine, 1, 6, "quiet")
    chains = [_store(ctl, engine, seed, 2, "flood")[0] for seed in range(2, 12)]
    assert ctl.flush(30.0)
    ctl.check_invariants(deep=True)  # LMDB holds exactly what the index says
    ledger = _tenant(ctl, "flood")
    assert ledger["disk_bytes"] == 4 * page
    assert ledger["quota_evicted"]["disk"] == 20 - 4
    assert _tenant(ctl, "quiet")["disk_bytes"] == 6 * page
    stored = ctl.store.tiers_of([k for c in chains for k in c.page_keys((FULL,))])
    assert sum(Tier.DISK in t for t in stored) == 4
    assert all(Tier.DISK in t for t in ctl.store.tiers_of(quiet.page_keys((FULL,))))
    ctl.close()


def test_a_page_that_cannot_fit_its_tenants_quota_is_not_stored_and_counted(tmp_path):
    engine, ctl = _controller(tmp_path, disk_path=None)
    page = _page_bytes(ctl)
    ctl.close()
    engine, ctl = _controller(
        tmp_path, disk_path=None, tenant_quotas=["tiny:host=1", "pinned:host=" + str(3 * page)]
    )
    chain, ok = _store(ctl, engine, 1, 2, "tiny")
    assert not ok, "a page larger than the quota is never held"
    assert _where(ctl, chain) == [Presence.ABSENT] * 2
    assert ctl.stats()["failures"]["tenant_quota"] == 2

    # A tenant whose pages are all pinned cannot make room: the new page is refused, and
    # no other tenant's page goes instead.
    held, ok = _store(ctl, engine, 2, 3, "pinned")
    other, _ = _store(ctl, engine, 3, 3, None)
    pin = ctl.pin(held.page_keys((FULL,)), 30.0)
    more, ok = _store(ctl, engine, 4, 1, "pinned")
    assert not ok and _where(ctl, more) == [Presence.ABSENT]
    assert _where(ctl, held) == [Presence.HOST] * 3 and _where(ctl, other) == [Presence.HOST] * 3
    assert _tenant(ctl, "pinned")["quota_refused"]["host"] == 1
    ctl.unpin(pin)
    more, ok = _store(ctl, engine, 5, 1, "pinned")
    assert ok and _where(ctl, held) == [Presence.HOST] * 2 + [Presence.ABSENT]
    ctl.check_invariants()
    ctl.close()


def test_an_engines_own_store_and_a_disk_read_keep_the_quota(tmp_path):
    engine, ctl = _controller(tmp_path)
    page = _page_bytes(ctl)
    ctl.close()
    engine, ctl = _controller(tmp_path / "2", tenant_host_quota_bytes=3 * page)
    old, _ = _store(ctl, engine, 1, 3, "a")
    assert ctl.flush(30.0)
    # An engine's own store of two more pages: room made from its own oldest pages.
    chain = engine.write_chain(range(5000, 5000 + 2 * PAGE))
    store_id, pages = ctl.begin_store(chain.refs((FULL,)), 30.0, tenant="a")
    assert min(pages) >= 0
    assert ctl.commit_store(store_id, True) == 2
    ctl.check_invariants()
    assert _where(ctl, old) == [Presence.HOST, Presence.DISK, Presence.DISK]
    assert _tenant(ctl, "a")["host_bytes"] == 3 * page
    # Reading its disk pages back to host makes room from its own pages again (once
    # their writes to disk, which hold them, are done).
    assert ctl.flush(30.0)
    assert load_into(ctl, engine, old, components=(FULL,))
    assert _tenant(ctl, "a")["host_bytes"] <= 3 * page
    ctl.check_invariants(deep=True)
    ctl.close()


def test_without_quotas_tenants_are_only_counted(tmp_path):
    engine, ctl = _controller(tmp_path, disk_path=None, tenant_metrics_top_k=3)
    page = _page_bytes(ctl)
    for i in range(12):
        _store(ctl, engine, i + 1, 1 + i % 4, f"t{i}")
        ctl.lookup(engine.write_chain(range(90_000 + i * 8, 90_008 + i * 8)).hashes, [FULL],
                   tenant=f"t{i}")  # fmt: skip
    report = ctl.stats()["tenants"]
    assert report["tenants"] == 12 and len(report["top"]) == 3
    assert all(t["host_quota_bytes"] is None for t in report["top"].values())
    assert all(t["host_bytes"] == 4 * page for t in report["top"].values())  # the biggest
    stored = sum(t["stored"]["host"] for t in report["top"].values())
    assert stored + report["other"]["stored"]["host"] == sum(1 + i % 4 for i in range(12))
    misses = sum(t["lookup"]["miss"] for t in report["top"].values())
    assert misses + report["other"]["lookup"]["miss"] == 12 * 2
    ctl.check_invariants()
    ctl.close()


def test_tenant_quota_settings_are_checked():
    assert parse_tenant_quotas(["a:host=1KiB", "a:disk=none", "b:c:disk=2MiB"]) == {
        "a": {Tier.HOST: 1024, Tier.DISK: None},
        "b:c": {Tier.DISK: 2 << 20},
    }
    for bad in ("a", "a:host", "a:ram=1GiB", ":host=1GiB", "a:host=0", "a:host=lots"):
        with pytest.raises(ConfigError, match="tenant_quotas"):
            ControllerConfig(tenant_quotas=[bad])
    with pytest.raises(ConfigError, match="tenant_host_quota_bytes"):
        ControllerConfig(tenant_host_quota_bytes=0)
    with pytest.raises(ConfigError, match="tenant_metrics_top_k"):
        ControllerConfig(tenant_metrics_top_k=-1)


def test_after_a_restart_a_tenants_pages_are_its_own_again_once_it_looks_them_up(tmp_path):
    """Pages found on disk at start belong to no tenant; a lookup of their tenant (the only
    one whose requests name their hashes) makes them its own, and its quota holds again:
    its next store evicts its oldest pages, another tenant's stay."""
    engine, ctl = _controller(tmp_path / "probe", disk_path=None)
    page = _page_bytes(ctl)
    ctl.close()
    quota = dict(tenant_disk_quota_bytes=6 * page, tenant_quotas=["b:disk=none"])
    engine, ctl = _controller(tmp_path, **quota)
    mine, _ = _store(ctl, engine, 1, 6, "a")
    theirs, _ = _store(ctl, engine, 2, 6, "b")
    assert ctl.flush(30.0)
    ctl.close()

    ctl = LocalController(_config(tmp_path, **quota))
    ctl.register(engine.layout, PAGE, engine.pools)
    assert ctl.stats()["tenants"]["tenants"] == 0  # restored pages: no tenant's
    assert ctl.lookup(mine.hashes, [FULL], tenant="a").leading(FULL) == 6
    ctl.check_invariants()
    assert _tenant(ctl, "a")["disk_bytes"] == 6 * page
    newer, ok = _store(ctl, engine, 3, 2, "a")
    assert ok and ctl.flush(30.0)
    ctl.check_invariants(deep=True)
    assert _tenant(ctl, "a")["disk_bytes"] == 6 * page
    assert _tenant(ctl, "a")["quota_evicted"]["disk"] == 2
    on_disk = [Tier.DISK in t for t in ctl.store.tiers_of(mine.page_keys((FULL,)))]
    assert on_disk == [True] * 4 + [False] * 2  # its oldest went: the chain's tail
    assert all(Tier.DISK in t for t in ctl.store.tiers_of(theirs.page_keys((FULL,))))
    ctl.close()
