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

# torch first, pinned to the CPU build: a bare requirement from the default index would
# pull a CUDA build of several GB. Where torch comes from is the machine's choice, not
# the repository's: a local wheel directory ($HICACHE_WHEEL_DIR, default /opt/wheels) is
# used when it holds the wheel; otherwise pip's own settings decide: PIP_INDEX_URL or
# PIP_EXTRA_INDEX_URL naming an index that serves the CPU build, or PIP_FIND_LINKS naming
# a directory of wheels (pip.conf works as well).
wheels="${HICACHE_WHEEL_DIR:-/opt/wheels}"
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "bootstrap: installing torch 2.13.0 (CPU)"
    if ls "$wheels"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
        "${pip[@]}" install --find-links "$wheels" "torch==2.13.0"
    else
        echo "bootstrap: no torch wheel in $wheels; pip's index settings choose the build" \
            "(set PIP_INDEX_URL / PIP_EXTRA_INDEX_URL to a CPU index, or PIP_FIND_LINKS)"
        "${pip[@]}" install "torch==2.13.0"
    fi
fi

if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "bootstrap: installing hicache (editable) with dev tools"
    "${pip[@]}" install -e ".[dev]"
    touch "$stamp"
fi
