"""Helpers for the sidecar tests: a real sidecar subprocess, engine subprocesses driven
over JSON lines (tests/support/engine_worker.py is their other end), and waits on
conditions (never fixed sleeps)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
START_TIMEOUT_S = 90.0  # a cold start imports torch; a shared 2-core machine is slow


def short_tmpdir(prefix: str = "hc") -> Path:
    """A fresh directory with a short path (a Unix socket path must fit 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.02) -> Any:
    """Poll ``cond`` until it returns something truthy; AssertionError after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


def layout_file(dirpath: Path, mix: str = "full+swa+mamba", page_size: int = 4) -> Path:
    """The test layout of ``mix`` as a JSON layout file for ``hicache serve``."""
    from tests.support.cache import make_layout

    d = make_layout(mix).to_dict()
    d["page_size"] = page_size
    path = dirpath / "layout.json"
    path.write_text(json.dumps(d))
    return path


def token_tcp_args(workdir: Path, token: str, mix: str, page_size: int) -> list[str]:
    """``hicache serve`` flags for a fixed layout and a TCP endpoint with a shared token
    (written to a file in ``workdir``)."""
    token_file = workdir / "tcp.token"
    token_file.write_text(token)
    return [
        "--layout-file",
        str(layout_file(workdir, mix, page_size)),
        "--tcp",
        "tcp://127.0.0.1:*",
        "--tcp-auth",
        "token",
        "--tcp-token-file",
        str(token_file),
    ]


class ServerThread:
    """A ``SidecarServer`` over ``controller``, bound on ``socket_path`` (no metrics port)
    and serving on a daemon thread of this process (``start``: at once; else call
    :meth:`start` after patching it). ``options``: more ``SidecarConfig`` fields."""

    def __init__(
        self, controller: Any, socket_path: Path, layout: Any = None, start: bool = True, **options
    ) -> None:
        from hicache.controller.sidecar.config import SidecarConfig
        from hicache.controller.sidecar.server import SidecarServer

        cfg = SidecarConfig(socket_path=socket_path, metrics_port=0, **options)
        self.server = SidecarServer(controller, cfg, layout=layout)
        self.server.bind()
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop serving and wait for the thread (the controller is left to its owner)."""
        self.server.request_stop()
        self.thread.join(60)


class Sidecar:
    """``hicache serve`` in a subprocess, with its own socket, LMDB and log files."""

    def __init__(
        self,
        workdir: Path,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        metrics: bool = False,
    ) -> None:
        self.workdir = workdir
        self.socket = workdir / "run" / "hicache.sock"
        self.disk = workdir / "lmdb"
        self.ready_file = workdir / "ready.json"
        self.args = list(args or [])
        self.env = dict(env or {})
        self.metrics = metrics
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}
        self.starts = 0
        self.log_path = workdir / "sidecar.log"

    @property
    def endpoint(self) -> str:
        return "ipc://" + str(self.socket)

    @property
    def metrics_port(self) -> int:
        return int(self.info.get("metrics_port", 0))

    def command(self) -> list[str]:
        port = str(free_port()) if self.metrics else "0"
        return [
            PYTHON,
            "-m",
            "hicache.controller.sidecar.process",
            "--socket",
            str(self.socket),
            "--disk-path",
            str(self.disk),
            "--metrics-port",
            port,
            "--ready-file",
            str(self.ready_file),
            "--log-level",
            "debug",
            "--host-pool-bytes",
            "8MiB",
            "--disk-budget-bytes",
            "64MiB",
            # Pages found on disk at a start stay there (the tests of the disk path); a
            # test of the prewarm sets its own (a later --set wins).
            "--set",
            "prewarm_bytes=0",
            *self.args,
        ]

    def start(self) -> Sidecar:
        """Start and wait until it serves."""
        return self.launch().wait_ready()

    def launch(self) -> Sidecar:
        """Start without waiting (engines may start meanwhile: they connect when it is up)."""
        self.ready_file.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.starts += 1
        with open(self.log_path, "a") as log:
            log.write(f"--- start {self.starts} ---\n")
            log.flush()
            self.proc = subprocess.Popen(
                self.command(), cwd=self.workdir, env=env, stdout=log, stderr=log
            )
        return self

    def wait_ready(self) -> Sidecar:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"sidecar exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            return self.ready_file.exists()

        wait_for(ready, START_TIMEOUT_S, "the sidecar to serve", every_s=0.05)
        self.info = json.loads(self.ready_file.read_text())
        return self

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def admin(self):
        from hicache.controller.client import AdminClient

        return AdminClient(self.endpoint, timeout_s=30.0)

    def __enter__(self) -> Sidecar:
        """Start it, unless :meth:`launch` already did (then the caller waits for it)."""
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.stop(30)
        self.kill()


class EngineProc:
    """An engine worker subprocess (tests/support/engine_worker.py), one command at a time."""

    def __init__(self, endpoint: str, engine_id: str, mix: str = "full+swa+mamba", **kw: Any):
        cmd = [
            PYTHON,
            "-m",
            "tests.support.engine_worker",
            "--endpoint",
            endpoint,
            "--engine-id",
            engine_id,
            "--mix",
            mix,
            "--client-config",
            json.dumps(kw),
        ]
        self.engine_id = engine_id
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,  # where `tests` is a package
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._lines: queue.Queue = queue.Queue()
        self._err: list[str] = []
        pump = threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines))
        pump.daemon = True
        pump.start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    @staticmethod
    def _pump(stream: Any, q: queue.Queue) -> None:
        for line in stream:
            q.put(line)
        q.put(None)

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            self._err.append(line)

    def stderr(self) -> str:
        return "".join(self._err[-60:])

    def send(self, op: str, **kw: Any) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"engine {self.engine_id}: no answer\n{self.stderr()}") from None
        if line is None:
            raise AssertionError(f"engine {self.engine_id} exited\n{self.stderr()}")
        out = json.loads(line)
        if "error" in out:
            raise AssertionError(f"engine {self.engine_id}: {out['error']}\n{self.stderr()}")
        return out

    def call(self, op: str, timeout_s: float = START_TIMEOUT_S, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self.receive(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.call("exit", timeout_s=30)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


class FullPages:
    """FULL pages of shared-memory device pools, for tests that back pages up and load
    them into other slots through a controller: random contents, fresh destinations and
    a byte comparison. (torch and the library are imported on first use.)"""

    def __init__(self, pools: Any, layout: Any, page_size: int) -> None:
        self.pools, self.layout, self.page_size = pools, layout, page_size

    def chain(self, n: int = 4, seed: int = 5) -> list:
        import numpy as np
        import torch

        from hicache.controller_api import PageRef
        from hicache.keys import namespace_hash, page_hashes
        from hicache.types import ComponentType

        fp = self.layout.fingerprint(self.page_size)
        hashes = page_hashes(np.arange(n * self.page_size) + seed, fp, self.page_size)
        parents = [namespace_hash(fp, None), *hashes[:-1]]
        pages = self.pools.alloc_kv_pages(n)
        slots = torch.from_numpy(self.pools.full.pages_to_slots(pages))
        buf = self.pools.full.buffer
        buf[:, :, slots] = torch.randn(buf[:, :, slots].shape)
        full = ComponentType.FULL
        return [PageRef(full, h, p, int(d)) for h, p, d in zip(hashes, parents, pages)]

    def retarget(self, refs: list) -> list:
        """The same pages, to be loaded into fresh device pages."""
        from dataclasses import replace

        dst = self.pools.alloc_kv_pages(len(refs))
        return [replace(r, device_index=int(d)) for r, d in zip(refs, dst)]

    def same_bytes(self, a: list, b: list) -> bool:
        import numpy as np
        import torch

        full = self.pools.full
        sa = torch.from_numpy(full.pages_to_slots(np.array([r.device_index for r in a])))
        sb = torch.from_numpy(full.pages_to_slots(np.array([r.device_index for r in b])))
        return torch.equal(full.buffer[:, :, sa], full.buffer[:, :, sb])


class FullEngine:
    """An engine of one FULL layout over 64 pages of shared-memory CPU pools, registered
    as ``engine`` with the sidecar at ``endpoint``: its pools, their pages
    (:class:`FullPages`) and its client (``config``). (The library is imported here.)"""

    def __init__(self, endpoint: str, page_size: int, config: Any) -> None:
        from hicache import CacheConfig, DevicePools
        from hicache.controller.client.sidecar_client import SidecarController
        from tests.support.cache import make_layout

        self.layout = make_layout("full")
        cfg = CacheConfig(page_size=page_size, full_slots=64 * page_size, shared_memory=True)
        self.pools = DevicePools.allocate(self.layout, cfg)
        self.pages = FullPages(self.pools, self.layout, page_size)
        self.chain, self.retarget = self.pages.chain, self.pages.retarget
        self.same_bytes = self.pages.same_bytes
        self.client = SidecarController(endpoint, "engine", config)
        self.client.register(self.layout, page_size, self.pools)

    def close(self) -> None:
        self.client.close()
        self.pools.close()


class GatedCopy:
    """A copy in flight that has not ended while ``gate`` is shut: a load's (``done``,
    ``finish``) or a backup's handle (``done``, ``wait``)."""

    def __init__(self, inner: Any, gate: threading.Event) -> None:
        self._inner = inner
        self._gate = gate

    def done(self) -> bool:
        return self._gate.is_set() and self._inner.done()

    def finish(self) -> bool:
        assert self._gate.wait(30), "the test never opened the gate"
        return self._inner.finish()

    def wait(self, timeout_s: float | None = None) -> bool:
        t0 = time.monotonic()
        if not self._gate.wait(timeout_s):
            return False
        left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - t0))
        return self._inner.wait(left)
