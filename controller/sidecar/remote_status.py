"""The remote tier in the sidecar: its Prometheus families, its status, and its verbs.

The families are computed from the controller's ``stats()`` snapshot at each scrape (see
controller/sidecar/metrics.py; the names and their meaning are in docs/metrics.md). With a
remote tier, a lookup waits on the network (up to ``remote_lookup_timeout_s``) and a
status asks every master: both move from the sidecar's I/O thread to its workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hicache.controller.tiers.remote_health import BreakerState
from hicache.types import Tier


def remote_families(s: dict[str, Any]) -> Iterator[Any]:
    """The ``hicache_remote_*`` families (none when the tier is not configured)."""
    tier = s.get("remote_tier") or {}
    if not tier.get("enabled"):
        return
    counts = s.get("remote", {})
    ops = CounterMetricFamily(
        "hicache_remote_ops",
        "Keys of remote store calls, by operation and per-key result.",
        labels=["op", "result"],
    )
    for op, results in counts.get("ops", {}).items():
        for result, n in results.items():
            ops.add_metric([op, result], n)
    yield ops
    seconds = CounterMetricFamily(
        "hicache_remote_seconds", "Time spent in remote store calls, by operation.",
        labels=["op"],
    )  # fmt: skip
    for op, n in counts.get("seconds", {}).items():
        seconds.add_metric([op], n)
    yield seconds
    for name, key, label, doc in (
        ("hicache_remote_fills", "fills", "result", "Remote reads into host pages, by result."),
        ("hicache_remote_write_dropped", "write_dropped", "reason",
         "Pages not written to the remote tier, by reason."),
        ("hicache_remote_invalid_values", "invalid", "reason",
         "Remote values that failed their checks (never served, then deleted), by reason."),
    ):  # fmt: skip
        fam = CounterMetricFamily(name, doc, labels=[label])
        for label, n in counts.get(key, {}).items():
            fam.add_metric([label], n)
        yield fam
    yield CounterMetricFamily(
        "hicache_remote_write_skipped_present",
        "Pages not written because the remote tier held them already.",
        value=counts.get("write_skipped_present", 0),
    )
    yield CounterMetricFamily(
        "hicache_remote_probe_deadline",
        "Lookups whose remote probe ran out of its deadline.",
        value=counts.get("probe_deadline", 0),
    )
    for name, key, doc in (
        ("hicache_remote_write_queue_pages", "write_queue_pages",
         "Pages queued for remote writes."),
        ("hicache_remote_write_queue_limit_pages", "write_queue_limit_pages",
         "The remote write queue's bound."),
        ("hicache_remote_presence_hints", "presence_hints", "Pages hinted present remotely."),
        ("hicache_remote_failure_hints", "failure_hints", "Cluster nodes hinted failing."),
    ):  # fmt: skip
        yield GaugeMetricFamily(name, doc, value=tier.get(key, 0))
    state = BreakerState[str(tier.get("breaker_state", "closed")).upper()]
    yield GaugeMetricFamily(
        "hicache_remote_breaker_state",
        "The remote tier's circuit breaker: 0 closed, 1 open, 2 half-open.",
        value=int(state),
    )
    yield CounterMetricFamily(
        "hicache_remote_breaker_opened", "Times the breaker opened.",
        value=tier.get("breaker_opened", 0),
    )  # fmt: skip


def remote_status(controller: Any) -> dict[str, Any]:
    """The remote tier's state and the cluster's health, for ``hicachectl status``:
    ``{"enabled": False}`` without one. Asks every master (within the read deadline)."""
    timeout_s = controller.config.remote_read_timeout_s
    health = controller.store.tier_health(Tier.REMOTE, timeout_s)
    return {"enabled": False} if health is None else health


def print_remote_status(remote: dict[str, Any]) -> None:
    """The ``remote:`` lines of ``hicachectl status``."""
    if not remote.get("enabled"):
        print("  remote:    off")
        return
    nodes = remote.get("nodes", [])
    up = sum(1 for n in nodes if n.get("up"))
    used = sum(n.get("used_memory_bytes", 0) for n in nodes)
    keys = sum(n.get("keys", 0) for n in nodes)
    print(
        f"  remote:    breaker {remote['breaker_state']}, {up}/{len(nodes)} masters up, "
        f"{remote.get('slots_covered', 0)}/16384 slots, {keys} keys, {used / (1 << 20):.1f} MiB, "
        f"queue {remote['write_queue_pages']}/{remote['write_queue_limit_pages']} pages"
    )
    for n in nodes:
        if not n.get("up"):
            print(f"    {n['addr']}: down or not answering")
        elif n.get("maxmemory_policy") not in ("allkeys-lru", "allkeys-lfu"):
            print(f"    {n['addr']}: maxmemory-policy {n.get('maxmemory_policy')!r}: "
                  "full means refused writes (see docs/operations.md)")  # fmt: skip
