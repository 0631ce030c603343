"""``hicachectl`` against a real sidecar, and a real Prometheus server scraping it.

One sidecar serves the module; an engine in this process (shared-memory pools) stores
prefixes through it, and each test drives the admin verbs and checks what changed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
import zmq
from prometheus_client.parser import text_string_to_metric_families

from hicache import CacheConfig, DevicePools
from hicache.controller.admin import cli as admin_cli
from hicache.controller.client.sidecar_client import SidecarClientConfig, SidecarController
from hicache.controller.store.page_codec import HEADER_BYTES
from hicache.controller.wire.protocol import Verb
from hicache.controller_api import PageRef, Presence
from hicache.keys import namespace_hash, page_hashes
from hicache.types import ComponentType
from tests.support.cache import make_layout
from tests.support.sidecar import Sidecar, free_port, layout_file, short_tmpdir, wait_for

MIX = "full"
PAGE = 4
FULL = ComponentType.FULL


class Env:
    """The module's sidecar, an engine client with device pools, and stored prefixes."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        self.layout = make_layout(MIX)
        self.fp = self.layout.fingerprint(PAGE)
        cfg = CacheConfig(page_size=PAGE, full_slots=512 * PAGE, shared_memory=True)
        self.pools = DevicePools.allocate(self.layout, cfg)
        # Not reading LMDB itself: a test here opens the sidecar's LMDB file in this process.
        config = SidecarClientConfig(lookup_timeout_s=10.0, engine_disk_reads=False)
        self.client = SidecarController(sidecar.endpoint, "admin-test-engine", config)
        self.client.register(self.layout, PAGE, self.pools)
        self.admin = sidecar.admin()

    def prefix(self, seed: int, pages: int = 6) -> list[int]:
        return list(range(seed * 10_000, seed * 10_000 + pages * PAGE))

    def refs(self, tokens: list[int], namespace: str | None) -> list[PageRef]:
        hashes = page_hashes(np.asarray(tokens), self.fp, PAGE, namespace)
        parents = [namespace_hash(self.fp, namespace), *hashes[:-1]]
        pages = self.pools.alloc_kv_pages(len(hashes))
        slots = torch.from_numpy(self.pools.full.pages_to_slots(pages))
        self.pools.full.buffer[:, :, slots] = torch.randn(self.pools.full.buffer[:, :, slots].shape)
        return [PageRef(FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, pages)]

    def store(self, tokens: list[int], namespace: str | None = None) -> list[bytes]:
        refs = self.refs(tokens, namespace)
        assert self.client.backup(refs).wait(30)
        wait_for(
            lambda: self.admin.call(Verb.STATS)["disk"]["pending_writes"] == 0, 30, "disk writes"
        )
        return [r.page_hash for r in refs]

    def where(self, hashes: list[bytes]) -> list[int]:
        return self.client.lookup(hashes, [FULL]).presence[FULL].tolist()


@pytest.fixture(scope="module")
def env():
    work = short_tmpdir()
    sidecar = Sidecar(
        work, args=["--layout-file", str(layout_file(work, MIX, PAGE))], metrics=True
    ).start()
    e = Env(sidecar)
    yield e
    e.admin.close()
    e.client.close()
    e.pools.close()
    sidecar.stop()
    shutil.rmtree(work, ignore_errors=True)


def ctl(env: Env, capsys, *argv: str) -> tuple[int, str, str]:
    """Run hicachectl in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = admin_cli.main(["--socket", str(env.sidecar.socket), *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def ctl_json(env: Env, capsys, *argv: str) -> tuple[int, dict]:
    code, out, err = ctl(env, capsys, *argv, "--json")
    assert out, err
    return code, json.loads(out)


# -- queries ------------------------------------------------------------------------------


def test_status_engines_stats_health(env, capsys):
    code, status = ctl_json(env, capsys, "status")
    assert code == 0
    assert status["layout"]["model_id"] == env.layout.model_id
    assert status["layout"]["fingerprint"] == env.fp.hex()
    assert env.sidecar.endpoint in status["endpoints"]

    code, engines = ctl_json(env, capsys, "engines")
    mine = [e for e in engines["engines"] if e["engine_id"] == "admin-test-engine"]
    assert code == 0 and mine and mine[0]["registered"] and mine[0]["device"] == "cpu"

    hashes = env.store(env.prefix(1))
    code, stats = ctl_json(env, capsys, "stats")
    assert code == 0 and stats["residency"]["host"]["full"]["resident"] >= len(hashes)

    code, out, _ = ctl(env, capsys, "health")
    assert code == 0 and out.startswith("ok")


def test_exit_codes_for_unreachable_and_refused(env, capsys, tmp_path):
    code, _, err = ctl(env, capsys, "--timeout", "0.5", "--socket", "/tmp/no-such.sock", "health")
    assert code == admin_cli.EXIT_UNREACHABLE and "not reachable" in err
    bad = tmp_path / "token"
    bad.write_text("not-the-admin-token-at-all")
    code, _, err = ctl(env, capsys, "--token-file", str(bad), "status")
    assert code == admin_cli.EXIT_REFUSED and "admin token" in err
    code, _, err = ctl(env, capsys, "evict", "--tier", "host", "--bytes", "lots")
    assert code == admin_cli.EXIT_USAGE and "not a size" in err


# -- clear, pin, unpin, evict -------------------------------------------------------------


def test_clear_respects_pins_and_namespaces(env, capsys):
    p1, p2 = env.prefix(2), env.prefix(3)
    h1 = env.store(p1)
    h2 = env.store(p2, namespace="tenant-b")
    tokens = ",".join(map(str, p1))
    code, pin = ctl_json(env, capsys, "pin", "--tokens", tokens, "--ttl", "120")
    assert code == 0 and pin["pages"] == len(h1) and pin["tokens"] == len(p1)

    code, res = ctl_json(env, capsys, "clear", "--tier", "all")
    assert code == 0 and res["kept_pages"] >= len(h1)
    assert env.where(h2) == [Presence.ABSENT] * len(h2)  # the other namespace: gone
    assert env.where(h1) == [Presence.HOST] * len(h1)  # pinned: kept on both tiers

    assert ctl_json(env, capsys, "unpin", str(pin["pin_id"]))[0] == 0
    code, res = ctl_json(env, capsys, "clear", "--tier", "host", "--namespace", "tenant-b")
    assert code == 0 and res["host_pages"] == 0  # nothing of that namespace is left
    assert env.where(h1) == [Presence.HOST] * len(h1)
    code, res = ctl_json(env, capsys, "clear", "--tier", "host", "--default-namespace")
    assert code == 0 and res["host_pages"] >= len(h1)
    assert env.where(h1) == [Presence.DISK] * len(h1)

    code, res = ctl_json(env, capsys, "evict", "--tier", "disk", "--bytes", "1GiB")
    assert code == 0 and res["pages"] >= len(h1)
    assert env.where(h1) == [Presence.ABSENT] * len(h1)


def test_pin_of_an_uncached_prefix_exits_1(env, capsys):
    code, res = ctl_json(env, capsys, "pin", "--tokens", "1,2,3,4,5,6,7,8", "--ttl", "5")
    assert code == admin_cli.EXIT_BAD_NEWS and res["pin_id"] is None


def test_evict_host_frees_least_recently_used_first(env, capsys):
    old = env.store(env.prefix(4, pages=2))
    new = env.store(env.prefix(5, pages=2))
    env.where(new)  # touch
    page_bytes = env.layout.page_bytes(FULL, PAGE)
    code, res = ctl_json(env, capsys, "evict", "--tier", "host", "--bytes", str(page_bytes))
    assert code == 0 and res["pages"] >= 1
    assert Presence.DISK in env.where(old) and env.where(new) == [Presence.HOST] * 2


# -- fsck ---------------------------------------------------------------------------------


def test_fsck_finds_and_repairs_a_corrupt_value(env, capsys):
    hashes = env.store(env.prefix(6, pages=3))
    code, res = ctl_json(env, capsys, "fsck")
    assert code == 0 and res["corrupt"] == 0 and res["checked"] >= 3
    map_size = env.admin.call(Verb.STATS)["disk"]["map_size_bytes"]
    db = lmdb.open(str(env.sidecar.disk), map_size=map_size, subdir=True)
    key = hashes[1] + bytes((int(FULL),))
    with db.begin(write=True) as txn:
        value = bytearray(txn.get(key))
        value[HEADER_BYTES + 5] ^= 0xFF  # one flipped byte in the payload
        txn.put(key, bytes(value))
    db.close()

    code, out, err = ctl(env, capsys, "fsck", "--progress")
    assert code == admin_cli.EXIT_BAD_NEWS and "1 corrupt" in out, (code, out, err)
    assert "fsck [" in err, err  # the progress bar
    code, res = ctl_json(env, capsys, "fsck", "--repair")
    assert code == admin_cli.EXIT_BAD_NEWS and res["repaired"] == 1, (code, res)
    code, res = ctl_json(env, capsys, "fsck")
    assert code == 0 and res["corrupt"] == 0
    # The repaired page is gone from disk; its host copy is still served.
    assert env.where(hashes)[1] in (Presence.HOST, Presence.ABSENT)


# -- Prometheus ---------------------------------------------------------------------------


def _prometheus_binary() -> str | None:
    found = shutil.which("prometheus")
    if found is None and os.environ.get("HICACHE_REQUIRE_PROMETHEUS") == "1":
        pytest.fail("prometheus is required (HICACHE_REQUIRE_PROMETHEUS=1) but not installed")
    return found


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _scalar(port: int, expr: str) -> float | None:
    res = _query(port, expr)
    return float(res[0]["value"][1]) if res else None


def _ready(port: int, proc: subprocess.Popen, tmp_path: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()}")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _scrape_direct(metrics_port: int, name: str, **labels: str) -> float:
    """A sample straight from the sidecar's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


def test_prometheus_scrapes_our_series(env, tmp_path):
    binary = _prometheus_binary()
    if binary is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    metrics_port = env.sidecar.metrics_port
    host_full = {"result": "host", "component": "full"}
    bad = {"verb": "invalid", "reason": "bad_message"}
    lookups_before = _scrape_direct(metrics_port, "hicache_lookup_pages_total", **host_full)
    bad_before = _scrape_direct(metrics_port, "hicache_request_failures_total", **bad)

    # What this test causes: a lookup of 5 host pages, and 3 undecodable messages.
    hashes = env.store(env.prefix(7, pages=5))
    assert env.where(hashes) == [Presence.HOST] * 5
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(env.sidecar.endpoint)
    for _ in range(3):
        raw.send(b"\xc1garbage")
    for _ in range(3):
        assert raw.poll(10_000)
        raw.recv()
    raw.close(linger=0)

    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: hicache\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{metrics_port}']\n"
    )
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "prometheus.log", "w"),  # noqa: SIM115 - closed with the process
    )
    try:
        wait_for(lambda: _ready(port, proc, tmp_path), 90, "Prometheus to start", every_s=0.2)
        lookups = 'hicache_lookup_pages_total{result="host",component="full"}'
        wait_for(
            lambda: _scalar(port, lookups) == lookups_before + 5,
            90,
            "Prometheus to scrape the lookup counter",
            every_s=0.5,
        )
        assert _scalar(port, "hicache_engines_connected") == 1
        assert (
            _scalar(port, 'hicache_request_failures_total{verb="invalid",reason="bad_message"}')
            == bad_before + 3
        )
        assert _scalar(port, 'hicache_hit_tokens_total{tier="host"}') >= 5 * PAGE
        resident = _scalar(port, 'hicache_pages{tier="host",component="full",state="resident"}')
        assert resident is not None and resident >= 5
        assert _scalar(port, 'hicache_pages{tier="host",component="full",state="pinned"}') == 0
        live = _scalar(port, "hicache_disk_live_bytes")
        file_bytes = _scalar(port, "hicache_disk_file_bytes")
        assert live is not None and file_bytes is not None and file_bytes >= live > 0
        assert _scalar(port, 'hicache_transfer_bytes_total{direction="device_to_host"}') > 0
        assert _query(port, 'hicache_request_seconds_count{verb="lookup"}')
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
