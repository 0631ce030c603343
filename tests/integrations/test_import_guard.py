"""From a checkout's root the folder kernels/ (hicache.kernels) comes first on sys.path under
the bare name ``kernels``, which is also a PyPI package that transformers 5.25+ imports:
importing hicache.integrations makes the bare name the installed package's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import sys, hicache.integrations; "
    "print('kernels' in sys.modules); "
    "import kernels; print(getattr(kernels, 'WHO', kernels.__file__))"
)


def fake_site(tmp_path: Path, with_metadata: bool) -> Path:
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("WHO = 'installed'\n")
    if with_metadata:
        info = site / "kernels-0.0.1.dist-info"
        info.mkdir()
        info.joinpath("METADATA").write_text(
            "Metadata-Version: 2.1\nName: kernels\nVersion: 0.0.1\n"
        )
    return site


def probe(cwd: Path, site: Path, before: str = "") -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", before + PROBE],
        cwd=cwd,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.split()


def test_from_the_root_the_installed_kernels_package_wins(tmp_path):
    assert (ROOT / "kernels" / "__init__.py").exists()
    assert probe(ROOT, fake_site(tmp_path, with_metadata=True)) == ["True", "installed"]


def test_the_checkouts_folder_imported_before_is_replaced(tmp_path):
    site = fake_site(tmp_path, with_metadata=True)
    assert probe(ROOT, site, before="import kernels; ") == ["True", "installed"]


def test_without_an_installed_kernels_package_nothing_is_imported(monkeypatch):
    # In this process, so that no kernels distribution of the environment counts.
    import importlib.metadata

    from hicache.integrations import import_guard

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    monkeypatch.setattr(sys, "path", [str(ROOT), *sys.path])
    monkeypatch.delitem(sys.modules, "kernels", raising=False)
    assert import_guard.prefer_installed_kernels() is False
    assert "kernels" not in sys.modules


def test_away_from_the_root_nothing_changes(tmp_path):
    site = fake_site(tmp_path, with_metadata=True)
    assert probe(tmp_path, site) == ["False", "installed"]
