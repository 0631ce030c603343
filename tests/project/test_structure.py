"""The shape of the library, checked from the source: no import cycle among the modules of
hicache's core, the controller and the kernels (runtime, function-level and TYPE_CHECKING
imports alike); no method typed on the cache from outside it; no file past 500 lines; no
component type branch in the tree, the cache or the tiering; one quarantine and one staging
area."""

from __future__ import annotations

import ast
import re
import tokenize
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Where each package of the graph lives (controller/ and kernels/ are mapped into hicache.).
PACKAGES = {
    "hicache": ROOT / "hicache",
    "hicache.controller": ROOT / "controller",
    "hicache.kernels": ROOT / "kernels",
}
# The applications built on the library (the demo, the replay, the reference engine, the
# command line): not part of the graph whose layering is checked.
APPS = ("hicache.apps", "hicache.cli")
MAX_LINES = 500
# The modules that carry no rule of one component type: every such rule is a hook of
# hicache/components/.
TYPE_FREE = (
    "backups.py",
    "beyond_device.py",
    "invariants.py",
    "load_back.py",
    "node.py",
    "quarantine.py",
    "tree.py",
    "tree_eviction.py",
    "tree_insert.py",
)


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if name.startswith(APPS) or (
                package == "hicache" and rel.parts[0] in ("controller", "kernels")
            ):
                continue
            out[name] = path
    return out


def _deepest_known(target: str, known: set[str]) -> str | None:
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that ``path`` imports anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [_deepest_known(alias.name, known) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                up = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{up}.{base}" if base else up
            # "from a.b import c" imports module a.b.c when there is one, else a.b
            targets = [
                f"{base}.{alias.name}"
                if f"{base}.{alias.name}" in known
                else _deepest_known(base, known)
                for alias in node.names
            ]
        else:
            continue
        found |= {t for t in targets if t is not None and t != name}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.add(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(frozenset(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"hicache.cache", "hicache.tree", "hicache.controller.store.local"} <= set(graph)
    assert "hicache.tree" in graph["hicache.cache"]  # edges are read, not assumed
    found = cycles(graph)
    assert not found, f"import cycles: {sorted(map(sorted, found))}"


def test_lazy_and_type_checking_imports_count_as_edges(tmp_path):
    """A cycle closed only by a function-level or TYPE_CHECKING import is found."""
    (tmp_path / "a.py").write_text("def f():\n    from pkg import b\n")
    (tmp_path / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n"
    )
    known = {"pkg.a", "pkg.b"}
    graph = {m: _imports(m, tmp_path / f"{m[4:]}.py", known) for m in known}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
    assert cycles(graph) == [frozenset(known)]


def test_no_method_is_typed_on_the_cache_from_outside_it():
    offenders = [
        f"{path.relative_to(ROOT)}:{i}"
        for folder in ("hicache", "controller", "kernels", "tests", "benchmarks", "scripts")
        for path in (ROOT / folder).rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"self\s*:\s*[\"']?UnifiedRadixCache", line)
    ]
    assert not offenders, offenders


def test_no_file_of_the_library_is_over_500_lines():
    long = {
        str(path.relative_to(ROOT))
        for path in _modules().values()
        if len(path.read_text().splitlines()) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {sorted(long)}"


def _code_lines(path: Path) -> dict[int, str]:
    """The code of ``path`` by line, without its comments and strings (docstrings)."""
    lines: dict[int, str] = {}
    with path.open() as f:
        for tok in tokenize.generate_tokens(f.readline):
            if tok.type not in (tokenize.COMMENT, tokenize.STRING):
                lines[tok.start[0]] = lines.get(tok.start[0], "") + " " + tok.string
    return lines


def test_the_tree_cache_and_tiering_name_no_component_type():
    """A per-type rule outside hicache/components/ is a branch on a component type, a
    hard-coded backbone index (but where node.py defines the accessor), or a component's
    attribute reached by its name."""
    pattern = re.compile(r"ComponentType \. (SWA|MAMBA)|data \[ 0 \]|getattr|mamba|swa", re.I)
    offenders = [
        f"hicache/{name}:{i}:{code}"
        for name in TYPE_FREE
        for i, code in _code_lines(ROOT / "hicache" / name).items()
        if pattern.search(code) and not (name == "node.py" and "self . base" in code)
    ]
    assert not offenders, "\n".join(offenders)


def test_one_quarantine_and_one_staging_area_in_the_library():
    """The engine-side cache and the staging area the vLLM and SGLang integrations share hold
    slots of unsettled copies in the same class; no integration builds its own staging."""
    classes = Counter(
        node.name
        for folder in PACKAGES.values()
        for path in folder.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ClassDef) and node.name in ("Quarantine", "StagingArea")
    )
    assert classes == {"Quarantine": 1, "StagingArea": 1}, classes
