"""The node side's layering, checked from the source: which process each part of
controller/ runs in, what an engine process loads, the one place that places a verb, and
the public names the engine integrations are built on."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTROLLER = ROOT / "controller"
SUBPACKAGES = ("wire", "client", "store", "tiers", "sidecar", "admin")
# The modules an integration may import from outside hicache.integrations, each only for
# the names in its __all__.
API_MODULES = (
    "hicache",
    "hicache.controller",
    "hicache.controller.client",
    "hicache.kernels",
    "hicache.apps.engine",
)
# What the engine half of host sharing may use from the store's package: the host pool's
# page geometry and the copy engine, which both processes run over the same pages, and
# the stored page's form and a slot's geometry, with which both read disk pages into slots.
SHARED_DATA_PLANE = (
    "hicache.controller.store.host_pool",
    "hicache.controller.store.transfer_engine",
    "hicache.controller.store.page_codec",
    "hicache.controller.store.load_reads",
)


def _imported_modules(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import in ``path``, at any depth (lazy and TYPE_CHECKING
    imports included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def _loaded_by(statement: str) -> list[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    return out.split()


def test_the_engine_client_loads_few_controller_modules_and_no_lmdb_or_redis():
    loaded = _loaded_by(
        "import hicache.controller.client; "
        "from hicache.controller.client import SidecarController, SidecarClientConfig"
    )
    controller = [m for m in loaded if m.startswith("hicache.controller.")]
    assert len(controller) + 1 <= 10, controller  # + the package hicache.controller
    assert "lmdb" not in loaded and "redis" not in loaded
    assert not [m for m in controller if m.startswith(("hicache.controller.store",))]


def test_the_engine_half_of_host_sharing_loads_no_lmdb_or_redis():
    loaded = _loaded_by("import hicache.controller.client.host_share")
    assert "lmdb" not in loaded and "redis" not in loaded
    sidecar_side = ("hicache.controller.sidecar", "hicache.controller.tiers")
    assert not [m for m in loaded if m.startswith(sidecar_side)]


def test_the_client_imports_nothing_of_the_sidecar_side():
    for path in sorted((CONTROLLER / "client").glob("*.py")):
        for module, _ in _imported_modules(path):
            if not module.startswith("hicache.controller."):
                continue
            allowed = module.startswith(
                ("hicache.controller.client", "hicache.controller.wire")
            ) or module in ("hicache.controller.config", *SHARED_DATA_PLANE)
            assert allowed, f"{path.relative_to(ROOT)} imports {module}"


def test_controller_is_laid_out_by_process_and_layer():
    top = sorted(p.name for p in CONTROLLER.glob("*.py"))
    assert len(top) <= 3, top
    assert sorted(p.name for p in CONTROLLER.iterdir() if (p / "__init__.py").exists()) == sorted(
        SUBPACKAGES
    )
    for package in SUBPACKAGES:
        doc = ast.get_docstring(ast.parse((CONTROLLER / package / "__init__.py").read_text()))
        assert doc and "process" in doc.splitlines()[0], package


def test_the_verb_table_alone_says_where_a_verb_runs():
    """Only controller/wire/verbs.py reads a verb's ``runs``; everything else asks
    ``VerbSpec.place`` (no set of verbs moved elsewhere, no branch on ``Runs``)."""
    table = CONTROLLER / "wire" / "verbs.py"
    for path in sorted([*CONTROLLER.rglob("*.py"), *(ROOT / "hicache").rglob("*.py")]):
        if path == table:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            placing = (isinstance(node, ast.Attribute) and node.attr in ("runs", "on_workers")) or (
                isinstance(node, ast.Name) and node.id == "Runs"
            )
            assert not placing, f"{path.relative_to(ROOT)}:{node.lineno} decides where a verb runs"


def test_integrations_import_only_public_names():
    for path in sorted((ROOT / "hicache" / "integrations").glob("*.py")):
        for module, names in _imported_modules(path):
            if not module.startswith("hicache") or module.startswith("hicache.integrations"):
                continue
            assert module in API_MODULES, f"{path.name} imports from {module}"
            public = set(importlib.import_module(module).__all__)
            assert set(names) <= public, f"{path.name}: {sorted(set(names) - public)}"


def test_results_live_outside_the_source_and_tests_mirror_it():
    scripts = (".py", ".sh")
    results = [p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix not in scripts]
    assert not [n for n in results if n != "__pycache__"], results
    assert not list((ROOT / "tests").glob("test_*.py"))
    for folder in (
        "core",
        "kernels",
        "integrations",
        "apps",
        *(f"controller/{p}" for p in SUBPACKAGES),
    ):
        assert list((ROOT / "tests" / folder).glob("test_*.py")), folder
