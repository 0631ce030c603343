"""Fixtures of the SGLang suite (run by ``make test-sglang`` in .venv-sglang): SGLang's own
host pools built on the CPU, its reference file backend, and a hicache sidecar."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sidecar_support import Sidecar, short_tmpdir  # noqa: E402


@pytest.fixture
def sidecar():
    """A running ``hicache serve`` with its own socket and LMDB; stopped by its PID."""
    workdir = short_tmpdir("hcsgl")
    car = Sidecar(workdir)
    with car:
        yield car
