"""Start ``hicache serve`` for a benchmark: its own socket, LMDB tier and ready file in a
work folder; returns once it serves."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def start_sidecar(
    workdir: Path, host_pool: str = "256MiB", extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, Path]:
    """``hicache serve`` in ``workdir``, once it serves; (the process, its socket)."""
    socket = workdir / "run" / "hicache.sock"
    ready = workdir / "ready.json"
    cmd = [
        sys.executable,
        "-m",
        "hicache.controller.sidecar_process",
        "--socket",
        str(socket),
        "--disk-path",
        str(workdir / "lmdb"),
        "--metrics-port",
        "0",
        "--host-pool-bytes",
        host_pool,
        "--disk-budget-bytes",
        "1GiB",
        "--ready-file",
        str(ready),
        *extra,
    ]
    log = open(workdir / "sidecar.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    end = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > end:
            raise SystemExit(f"the sidecar did not start; see {workdir / 'sidecar.log'}")
        time.sleep(0.1)
    return proc, socket
