"""The test suite is laid out like the source: no test module at the top of tests/, every
folder of the default suite a package, and shared code imported from tests.support or
reached through a conftest.py fixture, never a module by its bare name off sys.path."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# Run in the engines' own environments (make test-vllm, make test-sglang), as they are.
ENGINES = TESTS / "engines"
BARE_IMPORT = re.compile(r"^\s*(?:from|import) (test_\w+|\w+_support|fake_controller)\b", re.M)


def _default_suite() -> list[Path]:
    return [p for p in TESTS.rglob("*.py") if ENGINES not in p.parents]


def test_no_test_module_sits_at_the_top_of_tests():
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == []


def test_every_folder_of_the_default_suite_is_a_package():
    folders = {p.parent for p in _default_suite()}
    loose = [f for f in folders if not (f / "__init__.py").exists()]
    assert sorted(str(f.relative_to(TESTS)) for f in loose) == []


def test_no_test_imports_a_module_by_its_bare_name():
    offenders = [
        f"{path.relative_to(TESTS)}: {m.group(0).strip()}"
        for path in _default_suite()
        for m in BARE_IMPORT.finditer(path.read_text())
    ]
    assert offenders == []
