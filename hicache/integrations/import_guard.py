"""The repository's ``kernels/`` folder must not stand in for the PyPI package ``kernels``.

``kernels/`` is mapped to ``hicache.kernels`` by the package-dir mapping; installed, it
lives under ``hicache/``. Run from a checkout's root with ``python -m`` (pytest, the CLI),
the root is the first entry of ``sys.path``, and a bare ``import kernels`` finds the folder.
transformers 5.25 and later depend on the PyPI package of that name and import it when
they load a model (``from kernels import get_kernel``, ``CUDAProperties``). They would get
hicache's copy kernels and fail with an ImportError. :func:`prefer_installed_kernels`
imports the installed package first, with the checkout's root left out of the search, so
the name ``kernels`` in ``sys.modules`` is the installed one.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys


def _shadowing_root() -> str | None:
    """The directory whose ``kernels/`` is hicache's own and answers the bare name
    ``kernels`` (imported already, or first on ``sys.path``); None when there is none."""
    try:
        bare = importlib.util.find_spec("kernels")  # a module in sys.modules: its spec
        ours = importlib.util.find_spec("hicache.kernels")
    except (ImportError, ValueError):
        return None
    if bare is None or ours is None or not bare.origin or not ours.origin:
        return None
    bare_dir = os.path.dirname(os.path.realpath(bare.origin))
    if bare_dir != os.path.dirname(os.path.realpath(ours.origin)):
        return None  # the bare name is some other package: nothing to do
    return os.path.dirname(bare_dir)


def prefer_installed_kernels() -> bool:
    """Import the installed ``kernels`` package where hicache's folder would shadow it.
    Returns whether it did. Nothing changes where no ``kernels`` distribution is
    installed, or where the bare name is not hicache's."""
    root = _shadowing_root()
    if root is None:
        return False
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if os.path.realpath(p or os.curdir) != root]
    sys.modules.pop("kernels", None)
    try:
        importlib.import_module("kernels")
    except Exception:  # a broken install: leave the name unbound, as it was
        sys.modules.pop("kernels", None)
        return False
    finally:
        sys.path[:] = saved
    return True
