"""Package names that load their modules on first use (``hicache``, ``hicache.controller``,
``hicache.controller.client``): importing a package costs only what is used of it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a module
    path) on first use of ``name`` and keeps the value in ``namespace`` (the package's
    globals), so later uses are plain lookups."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
