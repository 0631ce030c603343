"""``hicache serve`` configuration: a misspelt HICACHE_* variable or a TOML value of the
wrong type stops the sidecar at start, with exit code 2 and a message naming it."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

import pytest

from hicache.controller.config import ControllerConfig
from hicache.controller.sidecar.config import BackupAck, SidecarConfig
from hicache.controller.sidecar.process import EXIT_BAD_CONFIG, OTHER_VARIABLES, load_settings
from hicache.types import ConfigError
from tests.support.sidecar import PYTHON, REPO, START_TIMEOUT_S


@pytest.mark.parametrize(
    "variable, value, closest",
    [
        ("HICACHE_HOST_POOL_BYTE", "32GiB", "HICACHE_HOST_POOL_BYTES"),
        ("HICACHE_DISK_BUDGET", "32GiB", "HICACHE_DISK_BUDGET_BYTES"),
        ("HICACHE_LEASE_SECONDS", "30", "HICACHE_LEASE_S"),
        ("HICACHE_host_pool_bytes", "32GiB", "HICACHE_HOST_POOL_BYTES"),
    ],
)
def test_a_misspelt_variable_is_an_error_that_names_the_option_meant(variable, value, closest):
    with pytest.raises(ConfigError) as e:
        load_settings(env={variable: value})
    assert f"${variable} is not an option" in str(e.value)
    assert f"did you mean {closest}?" in str(e.value)


def test_variables_that_are_not_options_pass_and_options_still_apply(tmp_path):
    env = {v: "1" for v in OTHER_VARIABLES - {"HICACHE_CONFIG"}}
    env["HICACHE_LEASE_S"] = "30"
    s = load_settings(env=env)
    assert s.sidecar.lease_s == 30.0


def test_kubernetes_service_links_of_a_service_named_hicache_are_not_settings():
    """Kubernetes gives a pod <SERVICE>_PORT, _SERVICE_HOST, ... for every Service of its
    namespace: a Service "hicache-metrics" sets HICACHE_METRICS_PORT=tcp://..., which is a
    field's name. Such values must neither stop the sidecar nor set the field."""
    env = {
        "HICACHE_METRICS_PORT": "tcp://10.0.0.7:9464",
        "HICACHE_METRICS_PORT_9464_TCP": "tcp://10.0.0.7:9464",
        "HICACHE_METRICS_PORT_9464_TCP_ADDR": "10.0.0.7",
        "HICACHE_METRICS_SERVICE_HOST": "10.0.0.7",
        "HICACHE_METRICS_SERVICE_PORT": "9464",
        "HICACHE_PORT": "tcp://10.0.0.8:5555",
        "HICACHE_SERVICE_PORT_ZMQ": "5555",
        "HICACHE_LEASE_S": "30",
    }
    s = load_settings(env=env)
    assert s.sidecar.metrics_port == SidecarConfig().metrics_port
    assert s.sidecar.lease_s == 30.0


def test_every_hicache_variable_the_project_reads_is_an_option_or_allowed():
    """A new HICACHE_* knob read anywhere (code, tests, CI) must join OTHER_VARIABLES, or
    a sidecar started from that environment refuses to start."""
    read = re.compile(r"""(?:environ|getenv|env)(?:\.get)?[(\[]\s*["'](HICACHE_\w+)["']""")
    exported = re.compile(r"^\s*export\s+(HICACHE_\w+)=", re.MULTILINE)
    found: set[str] = set()
    for path in REPO.rglob("*"):
        parts = path.relative_to(REPO).parts
        if not path.is_file() or parts[0] in (".venv", ".git", "build") or "egg-info" in parts[0]:
            continue
        if path.suffix == ".py":
            found |= set(read.findall(path.read_text()))
        elif path.suffix in ("", ".sh") and path.parent.name in (".ci", "scripts"):
            found |= set(exported.findall(path.read_text()))
    options = {
        "HICACHE_" + f.name.upper()
        for f in dataclasses.fields(SidecarConfig) + dataclasses.fields(ControllerConfig)
    }
    assert found - options == OTHER_VARIABLES


@pytest.mark.parametrize(
    "text, words",
    [
        ("[sidecar]\nworker_threads = 2.5\n", "[sidecar]: worker_threads=2.5 is not an integer"),
        ("[sidecar]\nmetrics_port = true\n", "[sidecar]: metrics_port=True is not an integer"),
        ("[controller]\ndisk_path = 5\n", "[controller]: disk_path=5 is not a path (a string)"),
        ("[sidecar]\nlease_s = true\n", "lease_s=True is not a number"),
        ("[controller]\ndisk_sync = 1\n", "disk_sync=1 is not true or false"),
        ("[sidecar]\ngpu_uuids = ['GPU-1', 2]\n", "gpu_uuids=['GPU-1', 2] is not a list"),
        ("[sidecar]\nbackup_ack = 1\n", "backup_ack=1 is not one of: host, disk"),
        ("[sidecar]\nlog_level = 3\n", "log_level=3 is not a string"),
        ("[controller]\nhost_pool_bytes = true\n", "host_pool_bytes: expected a size"),
        ("[sidecar]\nleese_s = 3\n", "unknown key 'leese_s' in [sidecar]; did you mean 'lease_s'?"),
        ("[controler]\n", "unknown table(s) ['controler']"),
        ("[controller]\nhost_pool_bytes = 'lots'\n", "not a size"),
        ("[sidecar]\ntcp_endpoint = 'tcp://0.0.0.0:5000'\n", "only served with authentication"),
        ("[sidecar\n", "not valid TOML"),
    ],
)
def test_a_bad_toml_config_is_an_error_naming_what_is_wrong(tmp_path, text, words):
    """A value of the wrong type names the type expected; an unknown key or table, an
    unauthenticated TCP endpoint or broken TOML says so."""
    cfg = tmp_path / "hicache.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_settings(cfg, env={})
    assert words in str(e.value)


def test_values_of_the_right_type_pass_as_their_field_types(tmp_path):
    cfg = tmp_path / "hicache.toml"
    cfg.write_text(
        "[sidecar]\nlease_s = 20\nbackup_ack = 'host'\ngpu_uuids = ['GPU-1']\n"
        "[controller]\nhost_weight_mamba = 1\ndisk_path = 'cache'\ndisk_sync = false\n"
    )
    env = {"HICACHE_WORKER_THREADS": " 8 ", "HICACHE_DISK_VERIFY_ON_OPEN": "yes"}
    s = load_settings(cfg, env=env, overrides={"admin_token_file": "none"})
    assert s.sidecar.lease_s == 20.0 and type(s.sidecar.lease_s) is float  # an int is a float
    assert s.sidecar.backup_ack is BackupAck.HOST and s.sidecar.gpu_uuids == ["GPU-1"]
    assert s.sidecar.worker_threads == 8 and s.sidecar.admin_token_file is None
    assert type(s.controller.host_weight_mamba) is float
    assert s.controller.disk_path == Path("cache")
    assert s.controller.disk_sync is False and s.controller.disk_verify_on_open is True


@pytest.mark.parametrize(
    "config, env, words",
    [
        ("[sidecar]\nworker_threads = 2.5\n", {}, "worker_threads=2.5 is not an integer"),
        ("", {"HICACHE_HOST_POOL_BYTE": "32GiB"}, "did you mean HICACHE_HOST_POOL_BYTES?"),
    ],
)
def test_serve_exits_2_with_one_line_naming_the_bad_setting(tmp_path, config, env, words):
    cfg = tmp_path / "hicache.toml"
    cfg.write_text(config)
    (tmp_path / "xdg").mkdir(mode=0o700)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    proc = subprocess.run(
        [PYTHON, "-m", "hicache.controller.sidecar.process", "--config", str(cfg), "--no-disk"],
        cwd=tmp_path,
        env={**clean, "XDG_RUNTIME_DIR": str(tmp_path / "xdg"), "HICACHE_METRICS_PORT": "0", **env},
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    assert proc.returncode == EXIT_BAD_CONFIG, proc.stderr
    assert proc.stderr.startswith("hicache serve: ") and words in proc.stderr
    assert "Traceback" not in proc.stderr
