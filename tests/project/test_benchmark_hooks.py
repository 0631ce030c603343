"""The benchmarks' request tracer (benchmarks/sidecar_trace.py) patches methods of the
sidecar, the controller and the client by name: each name must still exist, or a traced
benchmark run (``hf_ttft_gpu.py --trace-dir``) fails at its start. Installed in a fresh
interpreter, since the patches are process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_stage_the_tracer_patches_exists(tmp_path):
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import sidecar_trace; "
        f"sidecar_trace.install_server({str(tmp_path / 'server.json')!r}); "
        "sidecar_trace.install_client()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "server.json").read_text() == "[]"  # dumped at exit, nothing traced
