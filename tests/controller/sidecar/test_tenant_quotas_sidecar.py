"""Per-tenant quotas in ``hicache serve``, with real processes: a sidecar and two engine
processes (``UnifiedRadixCache`` over a ``SidecarController``) whose requests name their
tenants (``request_namespace``). The flooding tenant's quota holds on host and disk and it
evicts its own pages; the quiet tenant keeps every page, loaded back byte for byte. The
metrics name at most ``tenant_metrics_top_k`` tenants plus ``__other__``."""

from __future__ import annotations

import shutil
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from hicache import request_namespace
from hicache.controller.config import ControllerConfig
from hicache.controller.store.local import LocalController
from hicache.controller.wire.protocol import Verb
from hicache.keys import page_hashes
from hicache.types import ComponentType, Tier
from tests.support.cache import make_layout
from tests.support.sidecar import EngineProc, Sidecar, layout_file, short_tmpdir, wait_for

MIX = "full"
PAGE = 4
FULL = ComponentType.FULL
QUIET = list(range(10_000, 10_000 + 6 * PAGE))  # 6 pages
FLOODS = 24  # prompts of 2 pages each from the flooder
HOST_QUOTA_PAGES, DISK_QUOTA_PAGES = 8, 12
TOP_K = 2


def flood_prompt(i: int) -> list[int]:
    return list(range(20_000 + 100 * i, 20_000 + 100 * i + 2 * PAGE))


def tenants(admin) -> dict:
    return admin.call(Verb.STATS)["tenants"]


def writes_done(admin) -> bool:
    return admin.call(Verb.STATS)["disk"]["pending_writes"] == 0


def scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_a_tenants_quota_holds_under_a_flood_from_another_tenant():
    work = short_tmpdir("tq")
    layout = make_layout(MIX)
    page = layout.page_bytes(FULL, PAGE)
    args = [
        "--layout-file", str(layout_file(work, MIX, PAGE)),
        "--tenant-host-quota-bytes", str(HOST_QUOTA_PAGES * page),
        "--tenant-disk-quota-bytes", str(DISK_QUOTA_PAGES * page),
        "--set", f"tenant_metrics_top_k={TOP_K}",
    ]  # fmt: skip
    env = {"HICACHE_TENANT_QUOTAS": "quiet:host=none,quiet:disk=none"}
    quiet_ns, flood_ns = request_namespace(None, "quiet"), request_namespace(None, "flood")
    try:
        with Sidecar(work, args=args, env=env, metrics=True) as sidecar:
            admin = sidecar.admin()
            quiet = EngineProc(sidecar.endpoint, "quiet", MIX)
            flood = EngineProc(sidecar.endpoint, "flood", MIX)
            try:
                quiet.receive()
                flood.receive()
                quiet.call("run", tokens=QUIET, namespace=quiet_ns)
                for i in range(FLOODS):
                    if i == FLOODS - 1:  # its last prompt: every earlier write committed
                        wait_for(lambda: writes_done(admin), 60, "disk writes")
                    flood.call("run", tokens=flood_prompt(i), namespace=flood_ns)
                    assert tenants(admin)["top"]["flood"]["host_bytes"] <= HOST_QUOTA_PAGES * page
                wait_for(lambda: writes_done(admin), 60, "disk writes")
                report = tenants(admin)
                mine, theirs = report["top"]["quiet"], report["top"]["flood"]
                assert mine["host_bytes"] == mine["disk_bytes"] == len(QUIET) // PAGE * page
                assert mine["evicted"] == {"host": 0, "disk": 0}
                assert theirs["host_bytes"] == HOST_QUOTA_PAGES * page
                assert theirs["disk_bytes"] == DISK_QUOTA_PAGES * page
                floods = 2 * FLOODS
                assert theirs["quota_evicted"]["host"] + theirs["quota_refused"]["host"] == (
                    floods - HOST_QUOTA_PAGES
                )
                # A page refused on host never reached the disk.
                refused = theirs["quota_refused"]["host"]
                assert theirs["quota_evicted"]["disk"] == floods - refused - DISK_QUOTA_PAGES
                assert theirs["host_quota_bytes"] == HOST_QUOTA_PAGES * page
                assert mine["host_quota_bytes"] is None

                # The quiet tenant's pages come back from host, every byte checked.
                quiet.call("evict_all")
                assert quiet.call("match", tokens=QUIET, namespace=quiet_ns)["host_hit_len"] == (
                    len(QUIET)
                )
                assert quiet.call("start", tokens=QUIET, namespace=quiet_ns)["prefix_len"] == len(
                    QUIET
                )
                # The flooder kept its newest prompt on host and lost its oldest everywhere.
                flood.call("evict_all")
                newest = flood.call("match", tokens=flood_prompt(FLOODS - 1), namespace=flood_ns)
                assert newest["host_hit_len"] == 2 * PAGE
                oldest = flood.call("match", tokens=flood_prompt(0), namespace=flood_ns)
                assert oldest["prefix_len"] + oldest["host_hit_len"] + oldest["disk_hit_len"] == 0

                # A third tenant: the metrics name the top two by bytes, the rest sum up.
                other = request_namespace(None, "c")
                flood.call("run", tokens=list(range(90_000, 90_000 + PAGE)), namespace=other)
                samples = scrape(sidecar.metrics_port)
                held = {
                    (s.labels["tenant"], s.labels["tier"]): s.value
                    for s in samples["hicache_tenant_bytes"]
                }
                assert {t for t, _ in held} == {"quiet", "flood", "__other__"}
                assert held["flood", "disk"] == DISK_QUOTA_PAGES * page
                assert held["__other__", "host"] == page  # tenant c's one page
                failures = {
                    s.labels["reason"]: s.value for s in samples["hicache_controller_failures"]
                }
                assert failures["tenant_quota"] == refused
            finally:
                quiet.close()
                flood.close()
                admin.close()

        # The LMDB directory the sidecar left: what the index rebuilds agrees with LMDB,
        # and holds every quiet page and no more than the flooder's disk quota.
        config = ControllerConfig(disk_path=sidecar.disk, host_pool_bytes=1 << 20)
        ctl = LocalController(config, layout, PAGE)
        try:
            ctl.check_invariants(deep=True)
            fp = layout.fingerprint(PAGE)
            mine = page_hashes(np.array(QUIET), fp, PAGE, quiet_ns)
            assert all(Tier.DISK in t for t in ctl.store.tiers_of([_key(h) for h in mine]))
            theirs = [
                h
                for i in range(FLOODS)
                for h in page_hashes(np.array(flood_prompt(i)), fp, PAGE, flood_ns)
            ]
            stored = ctl.store.tiers_of([_key(h) for h in theirs])
            assert sum(Tier.DISK in t for t in stored) == DISK_QUOTA_PAGES
        finally:
            ctl.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _key(page_hash: bytes):
    from hicache.controller_api import PageKey

    return PageKey(FULL, page_hash)


def test_the_tenant_metrics_name_at_most_top_k_tenants_however_many_there_are(tmp_path):
    """200 tenants store pages and look up: every scrape carries at most K + 1 tenant
    label values, the named ones are those holding the most bytes, and the named rows plus
    ``__other__`` add up to the totals. Tenants that only looked up leave no record."""
    from prometheus_client import CollectorRegistry, generate_latest

    from hicache import CacheConfig, DevicePools
    from hicache.controller.sidecar.metrics import ControllerCollector
    from tests.support.sidecar import FullPages

    layout = make_layout(MIX)
    config = ControllerConfig(host_pool_bytes=4 << 20, tenant_metrics_top_k=TOP_K)
    ctl = LocalController(config, layout, PAGE)
    pools = DevicePools.allocate(layout, CacheConfig(page_size=PAGE, full_slots=2048 * PAGE))
    ctl.register(layout, PAGE, pools)
    pages = FullPages(pools, layout, PAGE)
    registry = CollectorRegistry()
    registry.register(ControllerCollector(ctl.stats))
    try:
        for i in range(200):
            n = 1 + (i == 7) * 5 + (i == 150) * 3  # t7 and t150 hold the most
            assert ctl.backup(pages.chain(n, seed=1000 * i), tenant=f"t{i}").wait(10)
            ctl.lookup([bytes(16)] * 2, [FULL], tenant=f"t{i}")
            ctl.lookup([bytes(16)], [FULL], tenant=f"looker{i}")  # no page: no record
            if i % 50 == 49:
                samples = {
                    f.name: f.samples
                    for f in text_string_to_metric_families(generate_latest(registry).decode())
                }
                names = {
                    s.labels["tenant"]
                    for fam, rows in samples.items()
                    if fam.startswith("hicache_tenant_")
                    for s in rows
                }
                assert len(names) <= TOP_K + 1 and "__other__" in names
        ctl.check_invariants()
        assert names == {"t7", "t150", "__other__"}
        stored = {s.labels["tenant"]: s.value for s in samples["hicache_tenant_stored_pages"]
                  if s.labels["tier"] == "host"}  # fmt: skip
        assert sum(stored.values()) == 200 + 5 + 3
        misses = {s.labels["tenant"]: s.value for s in samples["hicache_tenant_lookup_pages"]
                  if s.labels["result"] == "miss"}  # fmt: skip
        assert sum(misses.values()) == 200 * 2 + 200
        report = ctl.stats()["tenants"]
        assert report["tenants"] == 200  # the lookers hold nothing and are forgotten
    finally:
        ctl.close()
        pools.close()
