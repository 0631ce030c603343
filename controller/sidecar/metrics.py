"""Prometheus metrics of the sidecar (names ``hicache_…``; see docs/metrics.md).

Three sources feed one registry:

* the server's own instruments (requests, failures and latency by verb, engines
  connected, lease expiries), updated as requests are handled;
* a collector that turns the controller's counters and residency into metric families
  at scrape time, so that nothing is counted twice and the controller stays free of any
  metrics library;
* the standard ``process_…`` metrics of the sidecar's process (start time, CPU, memory,
  file descriptors).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hicache.controller.sidecar.remote_status import remote_families

log = logging.getLogger(__name__)

_LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip


def _get(d: dict[str, Any], *path: str, default: Any = 0) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


class ControllerCollector(Collector):
    """Metric families computed from ``snapshot()`` at each scrape.

    ``snapshot`` returns the controller's ``stats()`` dict extended with ``page_size``
    and ``residency`` (pages per tier, component and state, see the server).
    """

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        try:
            s = self._snapshot()
        except Exception:  # a scrape must never take the sidecar down
            log.exception("metrics snapshot failed")
            return
        page_size = s.get("page_size") or 0

        lookup = CounterMetricFamily(
            "hicache_lookup_pages",
            "Pages of looked-up chains, by where they were found (host, disk) or miss.",
            labels=["result", "component"],
        )
        hits = CounterMetricFamily(
            "hicache_hit_tokens",
            "Tokens of looked-up FULL pages found beyond the device, by tier.",
            labels=["tier"],
        )
        for result in ("host", "disk", "remote", "miss"):
            for comp, n in _get(s, "lookup", result, default={}).items():
                lookup.add_metric([result, comp], n)
            if result != "miss":
                hits.add_metric([result], _get(s, "lookup", result, "full") * page_size)
        yield lookup
        yield hits

        failures = CounterMetricFamily(
            "hicache_controller_failures",
            "Controller operations that did not do what was asked, by reason.",
            labels=["reason"],
        )
        for reason, n in s.get("failures", {}).items():
            failures.add_metric([reason], n)
        yield failures
        misses = CounterMetricFamily(
            "hicache_miss_reasons",
            "Lookups and load-backs that fell short, by why (reason), where (tier) and "
            "component; a lookup counts the reason of its first missed page per component.",
            labels=["reason", "tier", "component"],
        )
        for reason, tiers in s.get("miss_reasons", {}).items():
            for tier, comps in tiers.items():
                for comp, n in comps.items():
                    misses.add_metric([reason, tier, comp], n)
        yield misses
        # Failed loads are the load requests less these, whatever the reason (a reason
        # such as host_full is also counted by backups, so no sum of reasons is a count
        # of failed loads).
        yield CounterMetricFamily(
            "hicache_loads_served",
            "Loads that copied every page asked for into the engine's device memory.",
            value=_get(s, "load", "ok"),
        )
        yield CounterMetricFamily(
            "hicache_loads_engine_copied",
            "Load-backs an engine copied itself from the shared host pages (no load request).",
            value=_get(s, "load", "engine_copied"),
        )
        yield CounterMetricFamily(
            "hicache_loads_engine_read",
            "Load-backs an engine did itself reading pages only on disk from LMDB (no load "
            "request).",
            value=_get(s, "load", "engine_read"),
        )

        fams = {
            unit: CounterMetricFamily(
                f"hicache_transfer_{unit}",
                f"{unit.capitalize()} moved between tiers, by direction.",
                labels=["direction"],
            )
            for unit in ("bytes", "seconds", "pages")
        }
        for direction, d in s.get("transfer", {}).items():
            for unit, fam in fams.items():
                fam.add_metric([direction], d.get(unit, 0))
        yield from fams.values()

        ev = CounterMetricFamily(
            "hicache_evictions",
            "Pages evicted, by tier and component.",
            labels=["tier", "component"],
        )
        for tier, comps in s.get("evictions", {}).items():
            for comp, n in comps.items():
                ev.add_metric([tier, comp], n)
        yield ev

        backup = CounterMetricFamily(
            "hicache_backup_pages",
            "Pages offered for backup: stored (copied) or deduped (already held).",
            labels=["result"],
        )
        for result in ("stored_pages", "deduped_pages"):
            backup.add_metric([result.removesuffix("_pages")], _get(s, "backup", result))
        yield backup

        stores = CounterMetricFamily(
            "hicache_engine_store_pages",
            "Host pages handed to engines for stores they copy themselves, and their end.",
            labels=["result"],
        )
        for result in ("handed", "committed", "aborted"):
            stores.add_metric([result], _get(s, "engine_stores", f"pages_{result}"))
        yield stores

        pages = GaugeMetricFamily(
            "hicache_pages",
            "Pages held per tier and component: resident (all held) and pinned (the "
            "pinned part of resident), reported apart.",
            labels=["tier", "component", "state"],
        )
        for tier, comps in s.get("residency", {}).items():
            for comp, states in comps.items():
                for state, n in states.items():
                    pages.add_metric([tier, comp, state], n)
        yield pages

        cap = GaugeMetricFamily(
            "hicache_host_capacity_pages", "Host pages per component.", labels=["component"]
        )
        for comp, n in _get(s, "host", "capacity_pages", default={}).items():
            cap.add_metric([comp], n)
        yield cap

        mem = GaugeMetricFamily(
            "hicache_host_memory_bytes",
            "Host pool memory: allocated, page_locked (pinned for DMA) and used by pages.",
            labels=["kind"],
        )
        mem.add_metric(["allocated"], _get(s, "host", "resident_bytes"))
        mem.add_metric(["page_locked"], _get(s, "host", "pinned_bytes"))
        mem.add_metric(["used"], _get(s, "host", "used_bytes"))
        yield mem

        disk = s.get("disk", {})
        if disk.get("enabled"):
            for name, key, doc in (
                ("hicache_disk_live_bytes", "live_bytes", "Bytes of committed, indexed pages."),
                ("hicache_disk_file_bytes", "file_bytes", "Size of the LMDB data file."),
                ("hicache_disk_budget_bytes", "budget_bytes", "The disk tier's byte budget."),
                ("hicache_disk_map_bytes", "map_size_bytes", "The LMDB map size."),
                ("hicache_disk_pending_writes", "pending_writes", "Writes queued to LMDB."),
            ):
                yield GaugeMetricFamily(name, doc, value=disk.get(key, 0))
            yield CounterMetricFamily(
                "hicache_disk_invalid_dropped",
                "Stored values dropped at open for bad headers or checksums.",
                value=disk.get("invalid_dropped", 0),
            )
            yield from prewarm_families(disk.get("prewarm") or {})
        yield GaugeMetricFamily(
            "hicache_pins_active", "Active pins.", value=s.get("pins_active", 0)
        )
        expired = _get(s, "pins", "expired") + _get(s, "pins", "released_with_engine")
        yield CounterMetricFamily(
            "hicache_pins_released_unused",
            "Pins that ended by expiry or with their engine, not by an unpin.",
            value=expired,
        )
        yield from remote_families(s)
        yield from tenant_families(s.get("tenants") or {})


def prewarm_families(p: dict[str, Any]) -> Iterator[Any]:
    """The warm start's progress (controller/tiers/prewarm.py)."""
    size = GaugeMetricFamily(
        "hicache_prewarm_bytes",
        "Bytes of the prewarm after the last start: planned (target) and read to host, "
        "and handed to the OS to read into its page cache (advised).",
        labels=["kind"],
    )
    size.add_metric(["target"], p.get("target_bytes", 0))
    size.add_metric(["read"], p.get("bytes_read", 0))
    size.add_metric(["advised"], p.get("bytes_advised", 0))
    yield size
    pages = GaugeMetricFamily(
        "hicache_prewarm_pages", "Pages of the prewarm: planned and read.", labels=["kind"]
    )
    pages.add_metric(["target"], p.get("target_pages", 0))
    pages.add_metric(["read"], p.get("pages_read", 0))
    yield pages
    yield GaugeMetricFamily(
        "hicache_prewarm_running",
        "1 while the prewarm reads pages back to host.",
        value=1 if p.get("state") == "running" else 0,
    )


OTHER_TENANTS = "__other__"  # the label of every tenant outside the top K, summed


def tenant_families(report: dict[str, Any]) -> Iterator[Any]:
    """The per-tenant families from the store's tenant report (controller/store/tenants.py):
    the ``tenant_metrics_top_k`` tenants holding the most bytes by name, every other one
    summed under ``__other__``, so a scrape carries at most K + 1 tenant label values."""
    rows = [*report.get("top", {}).items()]
    if report.get("other"):
        rows.append((OTHER_TENANTS, report["other"]))
    yield GaugeMetricFamily(
        "hicache_tenants", "Tenants holding pages on host or disk.", value=report.get("tenants", 0)
    )
    held = GaugeMetricFamily(
        "hicache_tenant_bytes",
        "Payload bytes of a tenant's pages, by tier.",
        labels=["tenant", "tier"],
    )
    quota = GaugeMetricFamily(
        "hicache_tenant_quota_bytes",
        "A tenant's quota, by tier (where it has one).",
        labels=["tenant", "tier"],
    )
    lookup = CounterMetricFamily(
        "hicache_tenant_lookup_pages",
        "FULL pages of a tenant's lookups, by where they were found (host, disk, remote) or miss.",
        labels=["tenant", "result"],
    )
    counted = {
        what: CounterMetricFamily(f"hicache_tenant_{what}_pages", doc, labels=["tenant", "tier"])
        for what, doc in (
            ("stored", "Pages a tenant stored, by tier."),
            ("evicted", "A tenant's pages evicted, by tier (its quota's evictions included)."),
            ("quota_evicted", "A tenant's pages evicted to keep it within its quota, by tier."),
            ("quota_refused", "Pages of a tenant not stored because they did not fit its quota."),
        )
    }
    for name, row in rows:
        for tier in ("host", "disk"):
            held.add_metric([name, tier], row.get(f"{tier}_bytes", 0))
            if row.get(f"{tier}_quota_bytes") is not None:
                quota.add_metric([name, tier], row[f"{tier}_quota_bytes"])
            for what, fam in counted.items():
                fam.add_metric([name, tier], _get(row, what, tier))
        for result, n in row.get("lookup", {}).items():
            lookup.add_metric([name, result], n)
    yield held
    yield quota
    yield lookup
    yield from counted.values()


class SidecarMetrics:
    """The sidecar's registry: server instruments plus the controller collector."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "hicache_requests", "Requests received, by verb.", ["verb"], registry=r
        )
        self.failures = Counter(
            "hicache_request_failures",
            "Requests answered with an error, by verb and reason (the error code).",
            ["verb", "reason"],
            registry=r,
        )
        self.latency = Histogram(
            "hicache_request_seconds",
            "Time from receiving a request to sending its reply, by verb.",
            ["verb"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.engines = Gauge(
            "hicache_engines_connected", "Engine connections with a live lease.", registry=r
        )
        self.lease_expiries = Counter(
            "hicache_lease_expiries",
            "Engines dropped because their heartbeats stopped (pins and registration freed).",
            registry=r,
        )
        self.registrations = Counter(
            "hicache_registrations",
            "Device pool registrations, by result (ok, refused).",
            ["result"],
            registry=r,
        )
        # process_start_time_seconds and friends: the alerts on what happens at start
        # (values dropped when LMDB opens) need the start time.
        ProcessCollector(registry=r)
        self._http: Any = None
        if snapshot is not None:
            r.register(ControllerCollector(snapshot))

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` in a daemon thread; returns the bound port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._http = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
