"""The shape of the library, checked from the source: no import cycle among the modules of
hicache's core, the controller and the kernels (runtime, function-level and TYPE_CHECKING
imports alike); no method typed on the cache from outside it; no file past 500 lines; no
component type branch in the tree, the cache or the tiering; one quarantine and one staging
area; nothing outside controller/store/ reaching into the page store, which offers
operations, not fields, and talks to its lower tiers through one protocol."""

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


# -- the page store: operations, not fields ----------------------------------------------

STORE = ROOT / "controller" / "store"
# Attributes that name the page store (a LocalController's ``store``, or a ``_store``
# field), and the annotations of a variable or field that holds it.
STORE_ATTRS = ("store", "_store")
STORE_TYPES = ("PageStore", "TierHost")


def _store_operations() -> set[str]:
    """The public names of the page store (its methods and properties, mixins
    included): what code outside controller/store/ may use of it."""
    from hicache.controller.store.page_store import PageStore

    return {n for n in dir(PageStore) if not n.startswith("_")}


def _bound_name(node: ast.AST) -> str | None:
    """``x`` or ``self.x`` as a key, for a name or field that may be bound to the store."""
    if isinstance(node, ast.Name):
        return node.id
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in ("self", "cls")
    ):
        return f"self.{node.attr}"
    return None


def store_reaches(source: str, operations: set[str]) -> list[str]:
    """Where ``source`` reaches into the page store: an attribute of it that is not one of
    its ``operations`` (a field such as ``index`` or ``lock``, a private name), or another
    object's ``_store``. The store is ``x.store`` / ``x._store``, a name or ``self`` field
    annotated with its type, or one bound from any of these (``store = ctl.store``)."""
    tree = ast.parse(source)
    bound: set[str] = set()

    def is_store(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute) and node.attr in STORE_ATTRS:
            return True
        key = _bound_name(node)
        return key is not None and key in bound

    for node in ast.walk(tree):
        annotated = None
        if isinstance(node, ast.arg) and node.annotation is not None:
            annotated = node.arg, node.annotation
        elif isinstance(node, ast.AnnAssign):
            annotated = _bound_name(node.target), node.annotation
        if annotated and annotated[0] and any(t in ast.unparse(annotated[1]) for t in STORE_TYPES):
            bound.add(annotated[0])
    grew = True
    while grew:  # bindings from bindings: store = ctl.store; self._pages = store
        grew = False
        for node in ast.walk(tree):
            pairs: list[tuple[ast.AST, ast.AST]] = []
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                pairs = [(node.target, node.value)]
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                pairs = [(i.optional_vars, i.context_expr) for i in node.items if i.optional_vars]
            for target, value in pairs:
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                    sub = list(zip(target.elts, value.elts, strict=False))
                else:
                    sub = [(target, value)]
                for t, v in sub:
                    key = _bound_name(t)
                    if key is not None and key not in bound and is_store(v):
                        bound.add(key)
                        grew = True

    def others_private(node: ast.AST) -> bool:  # x._store, x not self
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "_store"
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        )

    found = set()
    for node in ast.walk(tree):
        if others_private(node) or (
            isinstance(node, ast.Attribute)
            and is_store(node.value)
            and not others_private(node.value)
            and node.attr not in operations
        ):
            found.add((node.lineno, ast.unparse(node)))
    return [f"{line}: {code}" for line, code in sorted(found)]


def _library_outside_the_store() -> dict[str, Path]:
    paths = {str(p.relative_to(ROOT)): p for p in _modules().values()}
    paths.update({str(p.relative_to(ROOT)): p for p in (ROOT / "benchmarks").rglob("*.py")})
    return {rel: p for rel, p in paths.items() if not p.is_relative_to(STORE)}


def test_no_module_outside_the_store_reaches_into_it():
    """The page store owns its lock, index, pins, host pool and tiers: the library (and the
    benchmarks) outside controller/store/ use its operations, never its fields."""
    operations = _store_operations()
    offenders = [
        f"{rel}:{where}"
        for rel, path in sorted(_library_outside_the_store().items())
        for where in store_reaches(path.read_text(), operations)
    ]
    assert not offenders, "reaches into the page store:\n" + "\n".join(offenders)


def test_the_store_scan_sees_the_operations_in_use():
    """Not satisfied by looking at nothing: the scan finds the store's operations used
    outside controller/store/ (admin verbs, the sidecar, the lower tiers), and a name
    that is not one of them would be a reach."""
    operations = _store_operations()
    used: dict[str, set[str]] = {}
    for rel, path in _library_outside_the_store().items():
        fewer = operations - {"residency", "presence", "tier_health", "finish_fills"}
        for where in store_reaches(path.read_text(), fewer):
            used.setdefault(rel, set()).add(where.split(": ")[1].rsplit(".", 1)[1])
    sidecar = set().union(
        *(ops for rel, ops in used.items() if rel.startswith("controller/sidecar/"))
    )
    assert {"residency", "presence", "tier_health"} <= sidecar, sidecar
    assert "finish_fills" in used.get("controller/tiers/remote_tier.py", set())
    assert "finish_fills" in used.get("controller/tiers/disk_tier.py", set())


def test_the_store_scan_finds_every_kind_of_reach():
    operations = {"presence", "clear"}
    reaches = store_reaches(
        "def f(ctl, pages: 'PageStore', host: TierHost):\n"
        "    ctl.store.presence([], [])\n"  # an operation: fine
        "    ctl.store.index.get(k)\n"  # a field
        "    store = ctl.store\n"
        "    with store.lock:\n"  # a field, through a local name
        "        pass\n"
        "    store.clear([])\n"  # an operation through a local name: fine
        "    ctl._store.fault('pin')\n"  # another object's private store
        "    pages.host\n"  # a parameter typed as the store
        "    host._index\n"  # a private field through the tiers' protocol
        "class T:\n"
        "    def __init__(self, pages: PageStore):\n"
        "        self._pages = pages\n"
        "    def g(self):\n"
        "        self._pages.pins\n"  # a field bound to self
        "        self._store = 1\n"  # its own field: fine
        "        return self._store\n",
        operations,
    )
    assert [r.split(": ")[1] for r in reaches] == [
        "ctl.store.index",
        "store.lock",
        "ctl._store",
        "pages.host",
        "host._index",
        "self._pages.pins",
    ], reaches


def test_the_page_store_offers_operations_not_fields():
    """Every public name of the store is a method or a property; its state is private."""
    from hicache.controller.config import ControllerConfig
    from hicache.controller.store.counters import Counters
    from hicache.controller.store.page_store import PageStore

    store = PageStore(ControllerConfig(), Counters())
    fields = sorted(n for n in vars(store) if not n.startswith("_"))
    assert not fields, f"public fields of the page store: {fields}"
    for name in _store_operations():
        member = getattr(PageStore, name)
        assert callable(member) or isinstance(member, property), name


def test_the_store_talks_to_lower_tiers_through_one_protocol():
    """Both lower tiers implement every member of LowerTier; the store asks a tier nothing
    else, and imports of tiers/ only the protocol and the tiers' constructors."""
    import inspect

    from hicache.controller.store.page_store import PageStore
    from hicache.controller.tiers.disk_tier import DiskTier
    from hicache.controller.tiers.lower_tier import LowerTier, TierHost
    from hicache.controller.tiers.remote_tier import RemoteTier

    protocol = {n for n in vars(LowerTier) if not n.startswith("_")} | {"tier"}
    for tier in (DiskTier, RemoteTier):
        for name in protocol:
            assert hasattr(tier, name), f"{tier.__name__} lacks LowerTier.{name}"
            want = getattr(LowerTier, name, None)
            if callable(want):
                got = inspect.signature(getattr(tier, name)).parameters
                assert list(got) == list(inspect.signature(want).parameters), (tier, name)
    host = {n for n in vars(TierHost) if not n.startswith("_")}
    assert host <= _store_operations(), host - _store_operations()
    allowed = {"lower_tier", "disk_tier", "remote_tier", "remote_store", "lmdb_fsck"}
    asked = set()
    for path in STORE.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "hicache.controller.tiers."
            ):
                assert node.module.rsplit(".", 1)[1] in allowed, (path.name, node.module)
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "_disk"
            ):
                asked.add(node.attr)
            if isinstance(node, ast.For) and "_tiers" in ast.unparse(node.iter):
                var = ast.unparse(node.target)
                asked |= {
                    n.attr
                    for n in ast.walk(node)
                    if isinstance(n, ast.Attribute) and ast.unparse(n.value) == var
                }
    assert asked, "the scan found no call to a lower tier"
    assert asked <= protocol, asked - protocol
    assert not [n for n in dir(PageStore) if n in ("disk", "remote", "index", "host", "lock")]
