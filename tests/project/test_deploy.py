"""The deployment files (deploy/) checked by the tools platform teams use, and against the code.

* Prometheus: ``promtool check config``, ``promtool check rules`` and ``promtool test rules``
  on the shipped files; every alert has unit tests that fire it; every metric named in
  the rules, their unit tests and the Grafana dashboard is a series the sidecar exports
  (read from a real sidecar's /metrics after real traffic), with label values it uses.
* systemd: ``systemd-analyze verify`` and ``security --offline`` on the unit,
  ``systemd-sysusers`` on the user definition, in a scratch root. All three work without
  systemd as PID 1 (as in a container): verify loads the unit offline and checks its keys,
  values and that ExecStart's program exists, which is why the test points ExecStart at
  this checkout's ``hicache`` instead of /opt/hicache. Where verify cannot run at all, the
  test skips, saying why.
* Kubernetes: the manifests parse and carry what the sidecar needs (socket and shared
  memory volumes, probes through ``hicachectl health``, resources sized from the config,
  non-root), and their embedded config loads through the sidecar's own loader.
* The example config: loads through the loader; its keys are exactly the options.
* The container image definition, statically: non-root, health check, pinned torch.

A missing tool skips its test, unless ``HICACHE_REQUIRE_PROMETHEUS=1`` (CI sets it), which
turns a missing ``promtool`` into a failure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from hicache import CacheConfig, ComponentType, DevicePools, Request, UnifiedRadixCache
from hicache.controller.client import AdminClient
from hicache.controller.config import ControllerConfig
from hicache.controller.sidecar.config import SidecarConfig
from hicache.controller.sidecar.process import load_settings, parse_size
from hicache.controller.store.counters import Failure
from hicache.controller.wire.protocol import ErrorCode, Verb
from hicache.layout import ModelLayout
from tests.support.sidecar import Sidecar, layout_file, short_tmpdir, wait_for

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
PROM = DEPLOY / "prometheus"
K8S = DEPLOY / "kubernetes"
EXAMPLE = DEPLOY / "hicache.example.toml"
RULES = PROM / "hicache-alerts.yml"
RULE_TESTS = PROM / "hicache-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "hicache-dashboard.json"
UNIT = DEPLOY / "systemd" / "hicache.service"
SYSUSERS = DEPLOY / "systemd" / "hicache.sysusers.conf"
DOCKERFILE = DEPLOY / "Dockerfile"

PAGE = 4
MIX = "full"
# Labels a scrape adds (Prometheus, the ServiceMonitor's relabelling), not the sidecar.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "node", "le"}
# The sidecar's own series, and the standard ones of its process.
EXPORTED_PREFIXES = ("hicache_", "process_")


def _option_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("HICACHE_REQUIRE_PROMETHEUS") == "1":
            pytest.fail("promtool is required (HICACHE_REQUIRE_PROMETHEUS=1) but not installed")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


def run_tool(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)


# -- the sidecar's registry, from a real sidecar after real traffic ---------------------------


@dataclasses.dataclass
class Registry:
    """What the sidecar exports: family types, sample names, label names and values."""

    types: dict[str, str]
    labels: dict[str, set[str]]  # family -> label names seen on its samples
    values: dict[str, set[str]]  # label name -> values seen on any family

    def sample_names(self) -> set[str]:
        suffixes = {
            "counter": ("_total", "_created"),
            "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created"),
        }
        return {fam + s for fam, t in self.types.items() for s in suffixes.get(t, ("",))}

    def family_of(self, sample: str) -> str | None:
        for fam in self.types:
            if sample == fam or (sample.startswith(fam + "_") and sample in self.sample_names()):
                return fam
        return None


def _serve_request(cache: UnifiedRadixCache, rid: str, tokens: np.ndarray) -> None:
    """One request as an engine runs it: match (and load back), compute, cache."""
    req = Request(rid)
    m = cache.match_prefix(tokens[:-1], req=req)
    if m.load_node is not None:
        cache.load_back(m.load_node, req=req)
    start = req.prefix_len
    cache.alloc_tokens(req, tokens.size - start)
    req.append_tokens(tokens[start:])
    cache.cache_finished_req(req)


@pytest.fixture(scope="module")
def registry() -> Registry:
    """A sidecar with a disk tier; an engine stores a prefix, loses it from its device,
    loads it back from host, then (after a host eviction) from disk, straight into its
    shared-memory CPU pools; then a scrape."""
    from hicache.controller.client.sidecar_client import SidecarClientConfig, SidecarController

    work = short_tmpdir("hcdeploy")
    layout_path = layout_file(work, MIX, PAGE)
    layout = ModelLayout.from_dict(
        {k: v for k, v in json.loads(layout_path.read_text()).items() if k != "page_size"}
    )
    sidecar = Sidecar(work, args=["--layout-file", str(layout_path)], metrics=True).start()
    cfg = CacheConfig(
        page_size=PAGE, full_slots=64 * PAGE, shared_memory=True, prefetch_policy="wait_complete"
    )
    pools = DevicePools.allocate(layout, cfg)
    # The sidecar reads the disk pages (not this engine: client/disk_share.py), so that
    # the scrape holds its load verb too.
    config = SidecarClientConfig(engine_disk_reads=False)
    client = SidecarController(sidecar.endpoint, "deploy-test-engine", config)
    admin = AdminClient(sidecar.endpoint, timeout_s=30.0)
    try:
        cache = UnifiedRadixCache(layout, cfg, pools, controller=client)
        turn = np.arange(1, 8 * PAGE + 1)
        longer = np.concatenate([turn, np.arange(900, 900 + 2 * PAGE)])
        _serve_request(cache, "a", turn)
        for rid, tier in (("b", None), ("c", "host")):
            cache.flush_backups()
            cache.evict(full_tokens=cfg.full_slots)
            if tier is not None:
                # A page leaves the host only once it is on disk (write-through).
                wait_for(
                    lambda: admin.call(Verb.STATS)["disk"]["pending_writes"] == 0, 30, "disk writes"
                )
                freed = admin.call(Verb.EVICT, {"tier": tier, "bytes": 1 << 30})
                assert freed["pages"] > 0, freed
            _serve_request(cache, rid, longer)
        cache.flush_backups()
        admin.call(Verb.HEALTH)
        url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as r:
            text = r.read().decode()
    finally:
        admin.close()
        client.close()
        pools.close()
        sidecar.stop()
        shutil.rmtree(work, ignore_errors=True)
    types: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    values: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(EXPORTED_PREFIXES) or fam.name.endswith("_created"):
            continue
        types[fam.name] = fam.type
        labels[fam.name] = set()
        for s in fam.samples:
            for k, v in s.labels.items():
                labels[fam.name].add(k)
                values.setdefault(k, set()).add(v)
    return Registry(types, labels, values)


def test_the_registry_fixture_saw_every_kind_of_traffic(registry):
    """The checks below are only as good as the scrape: it must hold the load, lookup,
    transfer and eviction series that the rules and the dashboard read."""
    # The disk load read its pages straight into the engine's CPU pools (disk_load_direct).
    assert {"host_to_device", "device_to_host", "host_to_disk", "disk_to_device"} <= (
        registry.values["direction"]
    )
    assert {"host", "disk", "miss"} <= registry.values["result"]
    assert "load" in registry.values["verb"]
    assert {"resident", "pinned"} <= registry.values["state"]
    assert "host" in registry.values["tier"]


# -- PromQL: the metric names and label values used -----------------------------------------

_SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def _exported_selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric name, [(label, op, value)]) for every ``hicache_…`` or ``process_…``
    selector in ``expr``."""
    out = []
    for m in _SELECTOR.finditer(expr):
        name, body = m.group(1), m.group(2) or ""
        if name.startswith(EXPORTED_PREFIXES):
            out.append((name, _MATCHER.findall(body)))
    return out


def _enum_values() -> dict[str, set[str]]:
    """Label values the code enumerates (beyond those the scrape happened to show)."""
    return {
        "reason": {f.value for f in Failure} | {e.value for e in ErrorCode},
        "verb": {v.value for v in Verb} | {"invalid"},
        "component": {c.name.lower() for c in ComponentType},
    }


def _check_expr(expr: str, registry: Registry, where: str) -> list[str]:
    """Problems with the sidecar's series ``expr`` reads (empty: none)."""
    problems = []
    names = registry.sample_names()
    known = _enum_values()
    for name, matchers in _exported_selectors(expr):
        if name not in names:
            problems.append(f"{where}: {name} is not exported by the sidecar")
            continue
        fam = registry.family_of(name)
        for label, op, value in matchers:
            if label in TARGET_LABELS:
                continue
            if label not in registry.labels.get(fam, set()):
                problems.append(f"{where}: {name} has no label {label!r}")
                continue
            allowed = registry.values.get(label, set()) | known.get(label, set())
            words = value.split("|") if op in ("=~", "!~") else [value]
            for w in words:
                if re.fullmatch(r"[a-z0-9_]+", w) and w not in allowed:
                    problems.append(f"{where}: {name}{{{label}={w!r}}}: no such value")
    return problems


def _rule_exprs() -> list[tuple[str, str]]:
    doc = yaml.safe_load(RULES.read_text())
    return [
        (r.get("alert") or r.get("record"), r["expr"]) for g in doc["groups"] for r in g["rules"]
    ]


REMOTE_ROW = "Remote tier (Valkey/Redis Cluster)"


def dashboard_exprs(rows: set[str] | None = None) -> list[tuple[str, str]]:
    """(where, expr) of every panel query, or of the panels under the rows named."""
    dash = json.loads(DASHBOARD.read_text())
    out, row = [], None
    for panel in dash["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        if rows is not None and row not in rows:
            continue
        for t in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {t['refId']}", t["expr"]))
    return out


def _row_titles() -> list[tuple[int, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["id"], p["title"]) for p in dash["panels"] if p["type"] == "row"]


def _dashboard_exprs() -> list[tuple[str, str]]:
    return dashboard_exprs()


def test_every_series_in_the_alert_rules_is_exported(registry):
    exprs = _rule_exprs()
    assert exprs
    problems = [p for name, e in exprs for p in _check_expr(e, registry, f"alert {name}")]
    assert not problems, "\n".join(problems)


def test_every_series_in_the_rule_unit_tests_is_exported(registry):
    """The unit tests feed series the sidecar really exports (or Prometheus's ``up``)."""
    doc = yaml.safe_load(RULE_TESTS.read_text())
    series = [s["series"] for t in doc["tests"] for s in t["input_series"]]
    assert series
    problems = []
    for s in series:
        if s.startswith("up{"):
            continue
        found = _check_expr(s, registry, f"test series {s}")
        problems += found
        if not _exported_selectors(s):
            problems.append(f"test series {s} is not a series the sidecar exports")
    assert not problems, "\n".join(problems)


def test_every_series_on_the_dashboard_is_exported(registry):
    """This sidecar has no remote tier: the remote row is checked by
    test_remote_deploy.py against a controller that has one."""
    rows = {t for _, t in _row_titles()} - {REMOTE_ROW}
    exprs = dashboard_exprs(rows)
    assert len(exprs) >= 10
    problems = [p for where, e in exprs for p in _check_expr(e, registry, where)]
    assert not problems, "\n".join(problems)


def test_the_dashboard_covers_what_operators_watch():
    """Hit ratio per tier, transfer GB/s, residency (resident and pinned), evictions,
    failures, engines: each read by at least one panel."""
    text = " ".join(e for _, e in _dashboard_exprs())
    for needed in (
        "hicache_lookup_pages_total",
        "hicache_transfer_bytes_total",
        'state="resident"',
        'state="pinned"',
        "hicache_evictions_total",
        "hicache_controller_failures_total",
        "hicache_request_failures_total",
        "hicache_engines_connected",
    ):
        assert needed in text, needed
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert {v["name"] for v in dash["templating"]["list"]} >= {"datasource", "job", "instance"}


def test_dashboard_queries_are_valid_promql(tmp_path):
    """Each panel query, with Grafana's variables filled in, parsed by promtool."""
    tool = promtool()
    fill = {"$__rate_interval": "5m", "$job": ".*", "$instance": ".*"}
    rules = []
    for i, (_, expr) in enumerate(_dashboard_exprs()):
        for var, value in fill.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"unfilled Grafana variable in {expr}"
        rules.append({"record": f"hicache:dashboard_query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = run_tool([tool, "check", "rules", str(path)])
    assert res.returncode == 0, res.stdout + res.stderr


# -- promtool on the shipped files ----------------------------------------------------------


def test_promtool_check_config():
    tool = promtool()
    res = run_tool([tool, "check", "config", "prometheus.yml"], cwd=PROM)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "hicache-alerts.yml" in res.stdout  # the rule file was found and checked


def test_promtool_check_rules():
    tool = promtool()
    res = run_tool([tool, "check", "rules", RULES.name], cwd=PROM)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(_rule_exprs())} rules found" in res.stdout


def test_promtool_test_rules():
    tool = promtool()
    res = run_tool([tool, "test", "rules", RULE_TESTS.name], cwd=PROM)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_every_alert_has_a_unit_test_that_fires_it_and_one_that_does_not():
    alerts = {name for name, _ in _rule_exprs()}
    fired: set[str] = set()
    quiet: set[str] = set()
    for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in t.get("alert_rule_test", []):
            (fired if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert alerts - fired == set(), f"alerts never fired by a test: {alerts - fired}"
    assert alerts - quiet == set(), f"alerts never shown quiet by a test: {alerts - quiet}"


def test_the_issue_alerts_exist():
    alerts = {name for name, _ in _rule_exprs()}
    for needed in (
        "HicacheLoadBackFailureRate",
        "HicacheDiskTierNearBudget",
        "HicacheLmdbFileFarPastLive",
        "HicacheNoEnginesConnected",
        "HicacheChecksumFailures",
    ):
        assert needed in alerts


def test_every_alert_has_a_runbook_entry_in_the_operations_guide():
    ops = (REPO / "docs" / "operations.md").read_text()
    missing = [name for name, _ in _rule_exprs() if name not in ops]
    assert not missing, f"docs/operations.md does not explain {missing}"


def _series_read(expr: str) -> set[tuple[str, tuple[tuple[str, str, str], ...]]]:
    """The series ``expr`` reads, less the target labels (Grafana's ``$job``/``$instance``)."""
    return {
        (name, tuple(sorted(m for m in matchers if m[0] not in TARGET_LABELS)))
        for name, matchers in _exported_selectors(expr)
    }


def test_the_load_failure_alert_and_panel_count_every_failed_load():
    """A failed load is a load request not served, whatever its reason: a sum of failure
    reasons misses some (a load that finds no free host page counts only host_full) and
    counts others that backups and prefetches share (host_full, copy_error, disk reads).
    The alert and the dashboard's panel read the same series."""
    alert = dict(_rule_exprs())["HicacheLoadBackFailureRate"]
    panel = next(e for where, e in _dashboard_exprs() if "'Load-back failures'" in where)
    want = {
        ("hicache_loads_served_total", ()),
        ("hicache_requests_total", (("verb", "=", "load"),)),
    }
    assert _series_read(alert) == want
    assert _series_read(panel) == want
    for expr in (alert, panel):  # the share not served
        assert "1 - sum" in " ".join(expr.split()), expr


def test_the_prometheus_rule_resource_carries_the_same_rules():
    crd = yaml.safe_load((K8S / "prometheusrule.yaml").read_text())
    assert crd["kind"] == "PrometheusRule"
    assert crd["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


# -- the example config -----------------------------------------------------------------------

_OPTION_LINE = re.compile(r"^(#\s*)?([a-z_][a-z0-9_]*)\s*=")
_TABLE_LINE = re.compile(r"^(#\s*)?\[([a-z]+)\]\s*$")


def _example_keys() -> dict[str, dict[str, bool]]:
    """{table: {key: active}}: active lines and commented-out ``# key = value`` lines."""
    tables: dict[str, dict[str, bool]] = {}
    table = None
    for line in EXAMPLE.read_text().splitlines():
        t = _TABLE_LINE.match(line)
        if t:
            table = t.group(2)
            tables.setdefault(table, {})
            continue
        m = _OPTION_LINE.match(line)
        if m and table is not None:
            assert m.group(2) not in tables[table], f"{m.group(2)} appears twice in [{table}]"
            tables[table][m.group(2)] = m.group(1) is None
    return tables


def test_example_config_loads_through_the_sidecar_loader():
    s = load_settings(EXAMPLE, env={})
    assert s.sidecar.socket == Path("/run/hicache/hicache.sock")
    assert s.controller.disk_enabled
    assert s.layout is None  # the [layout] table is an example, commented out


def test_example_config_holds_every_option_and_only_options():
    keys = _example_keys()
    assert set(keys) == {"sidecar", "controller", "layout"}
    for table, cls in (("sidecar", SidecarConfig), ("controller", ControllerConfig)):
        options = _option_names(cls)
        assert set(keys[table]) - options == set(), f"[{table}] keys that are not options"
        assert options - set(keys[table]) == set(), f"[{table}] options missing from the example"
    layout_fields = _option_names(ModelLayout) | {"page_size"}
    assert set(keys["layout"]) == layout_fields


def test_example_config_documents_every_option():
    """Each option line sits in a paragraph that opens with a comment."""
    paragraph_has_comment = False
    undocumented = []
    for line in EXAMPLE.read_text().splitlines():
        if not line.strip() or _TABLE_LINE.match(line):
            paragraph_has_comment = False
            continue
        m = _OPTION_LINE.match(line)
        if m:
            if not paragraph_has_comment:
                undocumented.append(m.group(2))
        elif line.startswith("#"):
            paragraph_has_comment = True
    assert not undocumented, f"options without a comment: {undocumented}"


def test_example_config_commented_options_are_valid_when_enabled(tmp_path):
    """Uncommenting every ``# option = value`` line (TCP with token auth) still loads, and
    so does the ``[layout]`` example."""
    text = re.sub(r"(?m)^#\s*(\[layout\]$|[a-z_]+\s*=)", r"\1", EXAMPLE.read_text())
    path = tmp_path / "all.toml"
    path.write_text(text)
    s = load_settings(path, env={}, overrides={"tcp_auth": "token"})
    assert s.sidecar.tcp_endpoint == "tcp://0.0.0.0:5557"
    assert s.sidecar.tcp_token_file is not None
    assert s.sidecar.curve_authorized_keys_dir is not None
    assert s.layout is not None
    layout, page_size = s.layout
    assert page_size == 16 and ComponentType.MAMBA in layout.components


def test_example_config_rejects_a_misspelt_key(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text(EXAMPLE.read_text().replace("lease_s =", "leese_s =", 1))
    with pytest.raises(Exception, match="leese_s"):
        load_settings(path, env={})


# -- Kubernetes ---------------------------------------------------------------------------


def _k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                doc["__file"] = path.name
                docs.append(doc)
    return docs


def _workloads() -> list[dict[str, Any]]:
    return [d for d in _k8s_docs() if d["kind"] in ("Deployment", "DaemonSet")]


def _pod_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod.get("initContainers", []) + pod["containers"]


def _sidecar_settings(container: dict[str, Any]):
    """The settings the sidecar container runs with: the ConfigMap plus its env."""
    cm = next(d for d in _k8s_docs() if d["kind"] == "ConfigMap")
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return cm, env


def test_manifests_parse_and_carry_metadata():
    docs = _k8s_docs()
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "Deployment", "DaemonSet", "Service", "ServiceMonitor"} <= kinds
    for d in docs:
        assert d.get("apiVersion") and d.get("metadata", {}).get("name"), d["__file"]
    for w in _workloads():
        sel = w["spec"]["selector"]["matchLabels"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert sel.items() <= labels.items(), f"{w['__file']}: selector does not match"


def _hicache_containers() -> list[tuple[dict, dict, dict]]:
    out = []
    for w in _workloads():
        pod = w["spec"]["template"]["spec"]
        for c in _pod_containers(pod):
            if c["name"] == "hicache":
                out.append((w, pod, c))
    return out


def test_the_sidecar_runs_in_an_engine_pod_and_as_a_daemonset():
    kinds = {
        (w["kind"], any(c["name"] == "engine" for c in pod["containers"]))
        for w, pod, _ in _hicache_containers()
    }
    assert kinds == {("DaemonSet", False), ("Deployment", True)}


def test_sidecar_containers_are_probed_resourced_and_unprivileged(tmp_path):
    for w, pod, c in _hicache_containers():
        name = f"{w['__file']}:{c['name']}"
        cm, env = _sidecar_settings(c)
        unknown = {k for k in env if k.startswith("HICACHE_")} - {
            "HICACHE_" + o.upper()
            for o in _option_names(SidecarConfig) | _option_names(ControllerConfig)
        }
        assert not unknown, f"{name}: {unknown} are not options"
        cfg = tmp_path / "hicache.toml"
        cfg.write_text(cm["data"]["hicache.toml"])
        s = load_settings(cfg, env=env)
        # probes: all three, through hicachectl health on the configured socket
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            cmd = c[probe]["exec"]["command"]
            assert cmd[0] == "hicachectl" and cmd[-1] == "health", name
            assert cmd[cmd.index("--socket") + 1] == str(s.sidecar.socket), name
            own = float(cmd[cmd.index("--timeout") + 1])
            assert c[probe]["timeoutSeconds"] > own, f"{name}: the probe kills hicachectl first"
        # resources: the host pool fits in the memory limit, with room for the process
        mem = c["resources"]["limits"]["memory"]
        assert parse_size(mem.replace("i", "iB") if mem.endswith("i") else mem, "memory") >= (
            s.controller.host_pool_bytes + (1 << 30)
        ), f"{name}: memory limit {mem} below host_pool_bytes + 1 GiB"
        assert c["resources"]["requests"]["cpu"]
        # metrics port named for the ServiceMonitor and reachable from outside the pod
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports.get("hicache-metrics") == s.sidecar.metrics_port, name
        assert s.sidecar.metrics_addr == "0.0.0.0", name
        # non-root, no privilege
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        # volumes: the socket's and the LMDB's directories are mounted
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert set(mounts.values()) <= set(volumes), f"{name}: mount of an undeclared volume"
        assert str(s.sidecar.socket.parent) in mounts, name
        disk_dir = next(
            (p for p in mounts if Path(s.controller.disk_path).is_relative_to(p) and p != "/"),
            None,
        )
        assert disk_dir is not None, f"{name}: no volume holds {s.controller.disk_path}"
        empty = volumes[mounts[disk_dir]].get("emptyDir")
        if empty is not None:  # an emptyDir must hold the whole LMDB map
            limit = empty["sizeLimit"]
            assert parse_size(limit.replace("i", "iB"), "sizeLimit") >= s.controller.map_size_bytes


def test_engine_pods_share_socket_shared_memory_and_user_with_the_sidecar():
    for w in _workloads():
        pod = w["spec"]["template"]["spec"]
        engines = [c for c in pod["containers"] if c["name"] == "engine"]
        if not engines:
            continue
        volumes = {v["name"]: v for v in pod["volumes"]}
        engine_mounts = {m["mountPath"]: m["name"] for m in engines[0]["volumeMounts"]}
        assert "/run/hicache" in engine_mounts, w["__file"]
        env = {e["name"]: e.get("value") for e in engines[0].get("env", [])}
        # SidecarController() with no endpoint finds $XDG_RUNTIME_DIR/hicache/hicache.sock
        assert env.get("XDG_RUNTIME_DIR") == "/run", w["__file"]
        sidecars = [c for c in _pod_containers(pod) if c["name"] == "hicache"]
        if sidecars:  # in the pod: the same emptyDir volumes
            side_mounts = {m["mountPath"]: m["name"] for m in sidecars[0]["volumeMounts"]}
            for path in ("/run/hicache", "/dev/shm"):
                assert engine_mounts[path] == side_mounts[path], f"{w['__file']}: {path}"
            assert volumes[engine_mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
            assert sidecars[0].get("restartPolicy") == "Always" or sidecars[0] in pod["containers"]
        else:  # the node's sidecar: its host directory and the host IPC namespace
            ds = next(d for d in _workloads() if d["kind"] == "DaemonSet")
            ds_pod = ds["spec"]["template"]["spec"]
            ds_run = next(v for v in ds_pod["volumes"] if v["name"] == "hicache-run")
            assert (
                volumes[engine_mounts["/run/hicache"]]["hostPath"]["path"]
                == ds_run["hostPath"]["path"]
            )
            assert pod.get("hostIPC") is True and ds_pod.get("hostIPC") is True
            assert pod["securityContext"]["runAsUser"] == ds_pod["securityContext"]["runAsUser"]
        assert pod["securityContext"]["runAsUser"] != 0


def test_the_socket_directory_is_the_sidecars_user_before_the_sidecar_starts():
    """The sidecar refuses a socket directory of another user, and a volume (emptyDir or
    hostPath) is created root-owned: an init container before it must hand the directory
    to the sidecar's user, mode 0700."""
    checked = 0
    for w in _workloads():
        pod = w["spec"]["template"]["spec"]
        containers = _pod_containers(pod)
        names = [c["name"] for c in containers]
        if "hicache" not in names:
            continue
        uid = pod["securityContext"]["runAsUser"]
        before = containers[: names.index("hicache")]
        owners = [
            c
            for c in before
            if any(m["mountPath"] == "/run/hicache" for m in c.get("volumeMounts", []))
            and f"chown {uid}:" in " ".join(c.get("command", []))
            and "chmod 0700 /run/hicache" in " ".join(c.get("command", []))
        ]
        assert owners, f"{w['__file']}: nothing hands /run/hicache to uid {uid} first"
        checked += 1
    assert checked == len(_hicache_containers())  # every workload that runs the sidecar


def test_the_service_monitor_finds_the_metrics_services():
    docs = _k8s_docs()
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    want = sm["spec"]["selector"]["matchLabels"]
    services = [
        d
        for d in docs
        if d["kind"] == "Service" and want.items() <= d["metadata"]["labels"].items()
    ]
    assert len(services) == 2  # the in-pod sidecars and the DaemonSet
    port = sm["spec"]["endpoints"][0]["port"]
    for svc in services:
        assert port in {p["name"] for p in svc["spec"]["ports"]}
        assert "hicache" in svc["metadata"]["name"]  # the job label the alerts match
        pods = [
            w
            for w in _workloads()
            if svc["spec"]["selector"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert pods, f"service {svc['metadata']['name']} selects no workload"


# -- systemd ------------------------------------------------------------------------------


def _unit() -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            k, _, v = line.partition("=")
            values.setdefault(k.strip(), []).append(v.strip())
    return values


def _systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    return found


def _unit_for_this_machine(tmp_path: Path) -> Path:
    """The unit with ExecStart's program replaced by this checkout's ``hicache``: verify
    checks that the program exists, and /opt/hicache is where it is installed, not here."""
    hicache = Path(sys.executable).parent / "hicache"
    assert hicache.exists(), hicache
    text = UNIT.read_text()
    program = shlex.split(_unit()["ExecStart"][0])[0]
    path = tmp_path / UNIT.name
    path.write_text(text.replace(f"ExecStart={program}", f"ExecStart={hicache}"))
    return path


def test_systemd_unit_passes_systemd_analyze_verify(tmp_path):
    tool = _systemd_analyze()
    res = run_tool([tool, "verify", str(_unit_for_this_machine(tmp_path))])
    if res.returncode != 0 and "System has not been booted with systemd" in res.stderr:
        pytest.skip(f"systemd-analyze verify cannot run here: {res.stderr.strip()}")
    # verify reports unknown keys and bad values as warnings, with exit code 0: any
    # output at all is a finding.
    assert res.returncode == 0 and not res.stderr.strip() and not res.stdout.strip(), (
        res.stdout + res.stderr
    )


def test_systemd_unit_is_hardened(tmp_path):
    tool = _systemd_analyze()
    res = run_tool([tool, "security", "--offline=true", str(_unit_for_this_machine(tmp_path))])
    if "--offline" in res.stderr:
        pytest.skip("this systemd-analyze has no offline security analysis (systemd < 250)")
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", res.stdout + res.stderr)
    assert m, res.stdout + res.stderr
    assert float(m.group(1)) <= 2.5, res.stdout


def test_systemd_unit_matches_the_example_config():
    """The unit runs the example config's paths: socket in RuntimeDirectory, LMDB in
    StateDirectory, as the user that sysusers creates."""
    unit = _unit()
    argv = shlex.split(unit["ExecStart"][0])
    assert argv[1] == "serve"
    assert argv[argv.index("--config") + 1] == "/etc/hicache/hicache.toml"
    s = load_settings(EXAMPLE, env={})
    assert s.sidecar.socket.parent == Path("/run") / unit["RuntimeDirectory"][0]
    assert Path(s.controller.disk_path).is_relative_to(Path("/var/lib") / unit["StateDirectory"][0])
    assert unit["UMask"] == ["0077"]
    user = unit["User"][0]
    assert re.search(rf"(?m)^u {re.escape(user)} ", SYSUSERS.read_text())


def test_sysusers_creates_the_service_user(tmp_path):
    tool = shutil.which("systemd-sysusers")
    if tool is None:
        pytest.skip("systemd-sysusers is not installed (apt-get install systemd)")
    (tmp_path / "etc").mkdir()
    res = run_tool([tool, f"--root={tmp_path}", str(SYSUSERS)])
    assert res.returncode == 0, res.stdout + res.stderr
    user = _unit()["User"][0]
    passwd = (tmp_path / "etc" / "passwd").read_text()
    assert re.search(rf"(?m)^{user}:x:\d+:\d+:.*:/usr/sbin/nologin$", passwd), passwd


# -- the container image ---------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _final_stage() -> list[tuple[str, str]]:
    steps = _dockerfile()
    last_from = max(i for i, (w, _) in enumerate(steps) if w == "FROM")
    return steps[last_from:]


def test_image_runs_as_a_non_root_user():
    users = [a for w, a in _final_stage() if w == "USER"]
    assert users, "the final stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("0", "root"), users


def test_image_health_check_uses_hicachectl_health_on_the_configured_socket():
    checks = [a for w, a in _final_stage() if w == "HEALTHCHECK"]
    assert len(checks) == 1
    cmd = json.loads(checks[0][checks[0].index("CMD") + 3 :].strip())
    assert cmd[0] == "hicachectl" and cmd[-1] == "health"
    socket = load_settings(EXAMPLE, env={}).sidecar.socket  # the config the image ships
    assert cmd[cmd.index("--socket") + 1] == str(socket)
    entry = [json.loads(a) for w, a in _final_stage() if w == "ENTRYPOINT"]
    assert entry == [["hicache", "serve"]]


def test_image_pins_torch_as_the_bootstrap_script_does():
    bootstrap = (REPO / "scripts" / "bootstrap.sh").read_text()
    pinned = set(re.findall(r"torch==([0-9.]+)", bootstrap))
    assert len(pinned) == 1
    args = dict(
        a.split("=", 1) for w, a in _dockerfile() if w == "ARG" and a.startswith("TORCH_VERSION=")
    )
    assert args == {"TORCH_VERSION": pinned.pop()}
    assert any('"torch==${TORCH_VERSION}"' in a for w, a in _dockerfile() if w == "RUN")
    # Which build (CPU, a CUDA version) is pip's to choose from its settings: the image
    # passes them through and names no index host itself.
    args = {a.split("=", 1)[0] for w, a in _dockerfile() if w == "ARG"}
    assert {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"} <= args


def test_no_package_index_host_is_named_by_the_build_scripts():
    for path in (REPO / "scripts" / "bootstrap.sh", DEPLOY / "Dockerfile"):
        text = path.read_text()
        index = re.search(r"--(extra-)?index-url|https?://[^\s\"']*(pypi|whl|simple)", text)
        assert index is None, f"{path} names a package index: {index and index.group(0)}"
        assert "PIP_INDEX_URL" in text, f"{path} does not say how to choose an index"


def test_image_copies_only_what_exists_and_the_build_context_keeps():
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for w, a in _dockerfile():
        if w != "COPY" or a.startswith("--from"):
            continue
        for src in a.split()[:-1]:
            assert (REPO / src).exists(), f"COPY {src}: no such path in the repository"
            assert src.rstrip("/") in kept, f"COPY {src}: excluded by Dockerfile.dockerignore"


def test_config_names_in_deploy_files_exist_in_the_loader():
    """``HICACHE_<OPTION>`` variables anywhere under deploy/ name real options."""
    options = {
        "HICACHE_" + o.upper()
        for o in _option_names(SidecarConfig) | _option_names(ControllerConfig)
    } | {"HICACHE_CONFIG"}
    found = set()
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.suffix in ("", ".yaml", ".yml", ".service", ".toml"):
            found |= set(re.findall(r"\bHICACHE_[A-Z_]+\b", path.read_text()))
    assert found, "expected the deploy files to use some HICACHE_ variables"
    assert found <= options, found - options


def test_toml_files_in_deploy_parse():
    paths = sorted(DEPLOY.rglob("*.toml"))
    assert paths, f"no TOML file under {DEPLOY}"
    for path in paths:
        assert isinstance(tomllib.loads(path.read_text()), dict), path


def test_the_metrics_reference_documents_every_exported_series(registry):
    """docs/metrics.md has a row for every series the sidecar exports, naming its type
    and every label it carries."""
    doc = (REPO / "docs" / "metrics.md").read_text()
    problems = []
    for fam, kind in registry.types.items():
        wire = fam + "_total" if kind == "counter" else fam
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{wire}`")), None)
        if row is None:
            problems.append(f"{wire}: no row")
            continue
        if kind not in row:
            problems.append(f"{wire}: type {kind} not stated")
        problems += [
            f"{wire}: label {label!r} not named"
            for label in sorted(registry.labels[fam] - {"le"})
            if f"`{label}`" not in row
        ]
    assert not problems, "\n".join(problems)
