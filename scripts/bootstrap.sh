#!/usr/bin/env bash
# Creates the virtual environment (when missing) and installs hicache into it, editable,
# with its development tools. Safe to run again: it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.hicache-installed"

# System tools some tests run for real: prometheus (and its promtool) for the metrics and
# alert tests, systemd-analyze/systemd-sysusers for the unit files, curl for the docs,
# redis-server for the remote tier's cluster tests.
# Installed when missing and this user may (root with apt); otherwise those tests skip and
# say why.
missing=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "bootstrap: installing ${missing[*]} (Debian packages)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null
    else
        echo "bootstrap: ${missing[*]} missing (install them to run every test)" >&2
    fi
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "bootstrap: creating $venv with $("$python" --version)"
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

# torch first, pinned to the CPU build: a bare requirement would pull a CUDA build of
# several GB. A local wheel is preferred where the machine has one.
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "bootstrap: installing torch 2.13.0 (CPU)"
    if ls /opt/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
        "${pip[@]}" install --find-links /opt/wheels "torch==2.13.0"
    else
        "${pip[@]}" install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
            --extra-index-url https://pypi.org/simple
    fi
fi

if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "bootstrap: installing hicache (editable) with dev tools"
    "${pip[@]}" install -e ".[dev]"
    touch "$stamp"
fi
