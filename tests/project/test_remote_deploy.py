"""The remote tier's deployment files, checked with the real tools.

``deploy/valkey/valkey.conf`` and ``users.acl`` start a real server whose settings are the
ones docs/operations.md asks for, and whose ``hicache`` user can do exactly what the
remote tier does (on its own keys) and nothing else. The Kubernetes manifest carries the
same settings. The alert rules pass ``promtool`` and their unit tests, and read only
series that a controller with a remote tier exports.
"""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
import redis
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hicache.controller.config import ControllerConfig
from hicache.controller.sidecar.metrics import SidecarMetrics
from hicache.controller.store.local import LocalController
from hicache.controller.store.page_codec import encode_value
from hicache.controller.tiers.remote_cluster import ClusterSettings, ClusterStore
from hicache.controller.tiers.remote_store import KeyStatus, MemoryStore, remote_key, split_value
from hicache.types import ComponentType
from tests.project.test_deploy import REMOTE_ROW, REPO, dashboard_exprs, promtool, run_tool
from tests.support.cluster import SLOTS, _free_port, require_redis_server

VALKEY = REPO / "deploy" / "valkey"
PROM = REPO / "deploy" / "prometheus"
RULES = PROM / "hicache-remote-alerts.yml"
RULE_TESTS = PROM / "hicache-remote-alerts.test.yml"


def _directives(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition(" ")
            out[name] = value
    return out


@pytest.fixture
def server(tmp_path):
    """A server started from deploy/valkey/valkey.conf (port, address and folders moved
    to the test's), with the example ACL file; all slots on it."""
    binary = require_redis_server()
    port = _free_port()
    acl = tmp_path / "users.acl"
    acl.write_text((VALKEY / "users.acl").read_text())
    proc = subprocess.Popen(
        [binary, str(VALKEY / "valkey.conf"), "--port", str(port), "--bind", "127.0.0.1",
         "--dir", str(tmp_path), "--aclfile", str(acl), "--maxmemory", "64mb",
         "--logfile", str(tmp_path / "server.log")],
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    admin = redis.Redis("127.0.0.1", port, username="admin", password="password")
    try:
        for _ in range(300):
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    pytest.fail((tmp_path / "server.log").read_text())
                subprocess.run(["sleep", "0.02"], check=True)
        admin.execute_command("CLUSTER ADDSLOTSRANGE", 0, SLOTS - 1)
        for _ in range(300):
            if admin.cluster("info")["cluster_state"] == "ok":
                break
            subprocess.run(["sleep", "0.02"], check=True)
        yield port, admin
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_server_config_has_the_settings_that_matter(server):
    _, admin = server
    want = {
        "cluster-require-full-coverage": "no",
        "maxmemory-policy": "allkeys-lru",
        "save": "",
        "appendonly": "no",
        "cluster-node-timeout": "2000",
    }
    for name, value in want.items():
        assert admin.config_get(name)[name] == value, name
    replica = admin.config_get("client-output-buffer-limit")["client-output-buffer-limit"]
    assert re.search(r"slave 2147483648 1073741824 60", replica), replica


def test_the_hicache_user_can_do_what_the_tier_does_and_no_more(server):
    port, _ = server
    store = ClusterStore(
        ClusterSettings((("127.0.0.1", port),), username="hicache", password="password")
    )
    key = remote_key("hicache", bytes(range(16)), ComponentType.FULL)
    head, body = split_value(encode_value(ComponentType.FULL, bytes(16), bytes(16), bytes(512)))
    assert store.put([(key, head, body)], 2.0) == [KeyStatus.OK]
    assert store.exists([key], 2.0) == [KeyStatus.OK]
    assert store.get([key], 2.0)[0].status is KeyStatus.OK
    info = store.info(2.0)
    assert info["slots_covered"] == SLOTS and info["nodes"][0]["up"]
    assert store.delete([key], 2.0) == [KeyStatus.OK]
    # Another prefix's keys and other commands are refused (as errors, never raised).
    assert store.put([(b"other:1", head, body)], 2.0) == [KeyStatus.ERROR]
    user = redis.Redis("127.0.0.1", port, username="hicache", password="password")
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.flushall()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis("127.0.0.1", port).ping()  # the default user is off
    store.close()


def test_the_kubernetes_manifest_carries_the_same_server_settings():
    docs = list(yaml.safe_load_all((VALKEY / "valkey-cluster.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "StatefulSet", "Job"]
    shipped = _directives(docs[0]["data"]["valkey.conf"])
    local = _directives((VALKEY / "valkey.conf").read_text())
    for name in set(local) - {"cluster-config-file", "aclfile"}:
        assert shipped.get(name) == local[name], name
    assert docs[2]["spec"]["replicas"] == 6


def test_promtool_checks_and_unit_tests_the_remote_rules():
    tool = promtool()
    res = run_tool([tool, "check", "rules", RULES.name], cwd=PROM)
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_tool([tool, "test", "rules", RULE_TESTS.name], cwd=PROM)
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_tool([tool, "check", "config", "prometheus.yml"], cwd=PROM)
    assert res.returncode == 0, res.stdout + res.stderr


def _exported_remote_series() -> dict[str, set[str]]:
    """Sample name → label names, from a controller whose remote tier saw writes, fills,
    drops, invalid values and a breaker."""
    from hicache import Request
    from hicache.config import PrefetchPolicy
    from tests.support.cache import MarkerEngine, make_cache

    store = MemoryStore(capacity_bytes=4096, eviction="noeviction")
    ctrl = LocalController(
        ControllerConfig(host_pool_bytes=1 << 20, disk_path=None, remote_write_queue_pages=2),
        remote_store=store,
    )
    cache = make_cache("full", page_size=4, window=None, controller=ctrl,
                       prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)  # fmt: skip
    engine = MarkerEngine(cache)
    tokens = np.arange(1, 17, dtype=np.int64)
    engine.run(tokens)
    cache.flush_backups()
    ctrl.flush(10.0)
    store.corrupt(store.keys()[0], 3)
    other = make_cache("full", page_size=4, window=None, controller=LocalController(
        ControllerConfig(host_pool_bytes=1 << 20, disk_path=None), remote_store=store),
        prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)  # fmt: skip
    req = Request("x")
    m = other.match_prefix(tokens, req=req)
    assert m.load_node is not None and not other.load_back(m.load_node, req=req)
    stats = other.controller.stats()
    assert stats["remote"]["invalid"]["corrupt"] == 1
    metrics = SidecarMetrics(lambda: {**ctrl.stats(), "page_size": 4, "residency": {}})
    series: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in fam.samples:
            series.setdefault(s.name, set()).update(s.labels)
    extra = SidecarMetrics(lambda: {**stats, "page_size": 4, "residency": {}})
    for fam in text_string_to_metric_families(generate_latest(extra.registry).decode()):
        for s in fam.samples:
            series.setdefault(s.name, set()).update(s.labels)
    ctrl.close()
    other.controller.close()
    return series


def test_every_series_in_the_remote_rules_and_their_tests_is_exported():
    series = _exported_remote_series()
    rules = yaml.safe_load(RULES.read_text())
    tests = yaml.safe_load(RULE_TESTS.read_text())
    texts = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    texts += [s["series"] for t in tests["tests"] for s in t["input_series"]]
    names = {n for t in texts for n in re.findall(r"\bhicache_[a-z_]+", t)}
    assert names and names <= set(series), names - set(series)
    assert "reason" in series["hicache_remote_write_dropped_total"]
    assert "reason" in series["hicache_remote_invalid_values_total"]


def test_the_dashboards_remote_row_reads_only_exported_series():
    """Every query of the dashboard's remote-tier row names series (and labels) that a
    controller with a remote tier exports; the row covers hits, calls, fills, writes and
    the breaker."""
    exprs = dashboard_exprs({REMOTE_ROW})
    text = " ".join(e for _, e in exprs)
    for needed in (
        'result="remote"',
        "hicache_remote_ops_total",
        "hicache_remote_fills_total",
        "hicache_remote_write_dropped_total",
        "hicache_remote_breaker_state",
    ):
        assert needed in text, needed
    series = _exported_remote_series()
    problems = []
    for where, expr in exprs:
        for name, labels in re.findall(r"\b(hicache_[a-z_]+)(?:\{([^}]*)\})?", expr):
            if name not in series:
                problems.append(f"{where}: {name} is not exported")
                continue
            for label in re.findall(r"([a-z_]+)\s*=~?", labels):
                if label not in ("job", "instance") and label not in series[name]:
                    problems.append(f"{where}: {name} has no label {label!r}")
    assert not problems, "\n".join(problems)


def test_the_metrics_reference_documents_every_remote_series():
    doc = (REPO / "docs" / "metrics.md").read_text()
    series = _exported_remote_series()
    names = {n.removesuffix("_created") for n in series if n.startswith("hicache_remote_")}
    problems = []
    for name in sorted(names):
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{name}`")), None)
        if row is None:
            problems.append(f"{name}: no row in docs/metrics.md")
            continue
        problems += [f"{name}: label {label!r} not named" for label in series[name]
                     if f"`{label}`" not in row]  # fmt: skip
    assert not problems, "\n".join(problems)


def test_the_operator_rule_carries_the_same_remote_alerts():
    path = REPO / "deploy" / "kubernetes" / "prometheusrule-remote.yaml"
    crd = yaml.safe_load(path.read_text())
    assert crd["kind"] == "PrometheusRule"
    assert crd["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
