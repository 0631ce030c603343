#!/usr/bin/env bash
# Creates .venv-sglang, the environment of tests/engines/sglang: SGLang's released code
# (sglang==0.5.23, installed --no-deps) with the CPU torch and only the packages its HiCache
# storage, controller and host-pool modules import (scripts/requirements-sglang.txt), plus
# hicache itself (editable, --no-deps). Reused while the requirements file is unchanged:
# the stamp holds its hash.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${SGLANG_VENV:-.venv-sglang}"
python="${PYTHON:-python3}"
requirements=scripts/requirements-sglang.txt
stamp="$venv/.requirements-sha256"
want="$(sha256sum "$requirements" "$0" | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

echo "sglang_env: building $venv"
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# The CPU torch the bootstrap uses, from the machine's wheel directory: a bare torch
# requirement would pull a CUDA build of several GB.
"${pip[@]}" install --find-links /opt/wheels "torch==2.13.0"
# --no-deps: every package sglang's storage path imports is pinned in the file; its own
# dependency list would replace the CPU torch with a CUDA build.
"${pip[@]}" install --no-deps -r "$requirements"
"${pip[@]}" install --no-deps -e .

# SGLang's model-config package imports torchvision at module level (for vision models'
# image transforms) on the way to its memory pools; the real torchvision pins a CUDA torch.
# A placeholder package stands in: it imports, and any name in it raises when called.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
placeholder="$site/torchvision"
mkdir -p "$placeholder/transforms/v2"
for module in __init__ io ops transforms/__init__ transforms/functional \
              transforms/v2/__init__ transforms/v2/functional; do
    cat > "$placeholder/$module.py" <<'PY'
"""Import placeholder written by hicache's scripts/sglang_env.sh; this is not torchvision.

SGLang's multimodal code imports torchvision at module level; the storage path never runs
it, so every name here is a stub that raises when called.
"""

__version__ = "0.0"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(name)


class _Unavailable:
    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str):
        return _Unavailable(f"{self.name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision placeholder: {self.name} is not available")
PY
done

"$venv/bin/python" - <<'PY'
import sglang.srt.managers.cache_controller  # noqa: F401
import sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller  # noqa: F401
import sglang.srt.mem_cache.pool_host.mamba  # noqa: F401
import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
import hicache.integrations  # noqa: F401
PY
echo "$want" > "$stamp"
