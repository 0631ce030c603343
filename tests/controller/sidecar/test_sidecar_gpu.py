"""The sidecar on a real GPU: run with ``pytest -m gpu`` on a CUDA machine.

The checks live in benchmarks/gpu_sidecar_check.py (one implementation, also run as a
script): an engine process registers CUDA pools through IPC handles, the sidecar backs a
prefix up and loads it into another slot range with equal bytes, and registrations with
stale or corrupted handles, a forged GPU or a GPU the sidecar cannot see are refused.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_SCRIPT = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_sidecar_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_sidecar_check", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cuda_ipc_registration_round_trip_and_refusals() -> None:
    rows = _script().run_checks(pages=16, repeat=2)
    failed = [row for row in rows if not row["ok"]]
    assert not failed, failed
    names = " | ".join(row["name"] for row in rows)
    assert "bytes equal" in names and "stale" in names and "forged GPU" in names
    assert "larger than its allocation" in names
