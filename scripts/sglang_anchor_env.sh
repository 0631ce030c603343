#!/usr/bin/env bash
# Creates .venv-sglang-anchor, the environment of benchmarks/bench_tree_vs_sglang.py: SGLang
# 0.5.20's released code (the last release with the Python RadixCache beside the unified
# one) installed --no-deps, with the local CPU torch wheel and the pinned packages its radix
# cache module imports (scripts/requirements-sglang-anchor.txt), plus hicache itself
# (editable, --no-deps), so one process can time both trees. torchvision is never
# installed (its build pulls a CUDA torch): a placeholder package imports in its place.
# Reused while the requirements file and this script are unchanged (the stamp holds their
# hash).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${SGLANG_ANCHOR_VENV:-.venv-sglang-anchor}"
python="${PYTHON:-python3}"
requirements=scripts/requirements-sglang-anchor.txt
stamp="$venv/.requirements-sha256"
want="$(sha256sum "$requirements" "$0" | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

echo "sglang_anchor_env: building $venv"
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
wheels="${HICACHE_WHEEL_DIR:-/opt/wheels}"
if ls "$wheels"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    "${pip[@]}" install --find-links "$wheels" "torch==2.13.0"
else
    echo "sglang_anchor_env: no torch wheel in $wheels; pip's index settings choose the build" \
        "(set PIP_INDEX_URL / PIP_FIND_LINKS to a CPU build of torch 2.13.0)" >&2
    "${pip[@]}" install "torch==2.13.0"
fi
"${pip[@]}" install --no-deps -r "$requirements"
"${pip[@]}" install --no-deps -e .

# torchvision: sglang's utilities import it at module level (image decoding); the radix
# cache never calls it. Every torchvision name and submodule imports and raises if called.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$site/torchvision"
cat > "$site/torchvision/__init__.py" <<'PY'
"""Placeholder written by hicache's scripts/sglang_anchor_env.sh; this is not torchvision.

Any submodule and any name imports; calling anything raises.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _Missing:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a placeholder here")


class _Module(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__version__ = "0.0"
__path__ = []


def __getattr__(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Missing(f"torchvision.{attr}")
PY

"$venv/bin/python" -W ignore -c "import sglang.srt.mem_cache.radix_cache, hicache"
echo "$want" > "$stamp"
