"""The distribution maps controller/ and kernels/ into the hicache namespace, both when
installed editable (this venv) and from a built wheel in a fresh venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAPPED = {"hicache": "hicache", "hicache.controller": "controller", "hicache.kernels": "kernels"}


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == MAPPED
    listed = set(cfg["packages"])
    found = set()
    for name, folder in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found == listed, f"packages in pyproject.toml differ from the folders: {found ^ listed}"


def test_editable_install_maps_the_top_level_folders():
    import hicache.controller
    import hicache.kernels

    assert Path(hicache.controller.__file__).parent == ROOT / "controller"
    assert Path(hicache.kernels.__file__).parent == ROOT / "kernels"


@pytest.mark.timeout(600)
def test_wheel_in_a_fresh_venv_imports_the_mapped_packages(tmp_path):
    dist = tmp_path / "dist"
    # Build from a copy of the sources: setuptools writes build/ and *.egg-info beside them.
    src = tmp_path / "src"
    skip = (".git", ".venv", "build", "demo-out", "*.egg-info", "__pycache__", ".whl")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*skip, "hicache-data"))
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)],
        cwd=src,
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("hicache-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for member in (
        "hicache/controller/store/local.py",
        "hicache/kernels/reference.py",
        "hicache/tree.py",
        "hicache/apps/engine/model.py",
    ):
        assert member in names, f"{member} missing from the wheel"
    assert not any(n.startswith(("controller/", "kernels/", "tests/")) for n in names)

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    # Dependencies (torch, numpy, ...) come from this venv's site-packages on PYTHONPATH;
    # hicache itself only from the fresh venv (no .pth files are read from PYTHONPATH).
    env = dict(os.environ, PYTHONPATH=sysconfig.get_paths()["purelib"])
    probe = (
        "import hicache, hicache.controller.store.local, hicache.kernels;"
        "print(hicache.controller.__file__); print(hicache.kernels.__file__)"
    )
    out = subprocess.run(
        [py, "-c", probe], check=True, capture_output=True, text=True, env=env, cwd=tmp_path
    ).stdout.split()
    assert all(str(env_dir) in path for path in out), out
