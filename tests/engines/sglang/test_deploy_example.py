"""deploy/sglang/ says what docs/integrations/sglang.md says: its extra config loads
hicache's backend through SGLang's own dynamic-backend loader, with known keys only."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache.integrations.sglang import DEFAULTS

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "sglang"
DOC = Path(__file__).resolve().parents[3] / "docs" / "integrations" / "sglang.md"
SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "allocator"}


def _env() -> dict[str, str]:
    out = {}
    for line in (DEPLOY / "sglang.env").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            out[name] = value
    return out


def test_the_example_extra_config_loads_the_backend_through_sglangs_loader():
    extra = json.loads(_env()["HICACHE_EXTRA_CONFIG"])
    assert set(extra) <= SGLANG_KEYS | set(DEFAULTS), set(extra) - SGLANG_KEYS - set(DEFAULTS)
    cls = StorageBackendFactory._load_backend_class(
        extra["module_path"], extra["class_name"], extra["backend_name"]
    )
    assert issubclass(cls, HiCacheStorage)
    assert extra["interface_v1"] == 1


def test_every_extra_config_key_is_documented():
    doc = DOC.read_text()
    missing = [k for k in [*DEFAULTS, *SGLANG_KEYS] if f"`{k}`" not in doc]
    assert not missing, missing


def test_the_unit_passes_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze is installed by scripts/bootstrap.sh"
    unit = tmp_path / "sglang-hicache.service"
    text = (DEPLOY / "sglang-hicache.service").read_text()
    # verify checks that ExecStart's binary exists: point it at one that does
    unit.write_text(text.replace("/opt/sglang/bin/python", shutil.which("python3")))
    res = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True)
    # verify reports unknown keys and bad values as warnings, with exit code 0: any
    # output at all is a finding
    assert res.returncode == 0 and not res.stderr.strip() and not res.stdout.strip(), (
        res.stdout + res.stderr
    )
