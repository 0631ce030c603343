"""A node in miniature: one sidecar process and engine worker processes around it.

:class:`SidecarProcess` runs ``python -m hicache.controller.sidecar.process`` (what
``hicache serve`` runs) on a Unix socket in a work folder, with its LMDB tier there;
:class:`EngineCluster` starts engine workers (:mod:`hicache.apps.engine.worker`) that
reach it through ``SidecarController``, hands each its share of a batch of requests, and
collects their events. Both stop cleanly (the sidecar drains its disk writes on SIGTERM),
so a restart keeps every page the disk tier committed.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.apps.engine.worker import WorkerError, WorkerProcess, WorkerSettings

# sockaddr_un holds 108 bytes with the terminating NUL
_MAX_SOCKET_PATH_CHARS = 107


@dataclass
class SidecarSettings:
    """The sidecar's tiers for the demo (bytes)."""

    host_pool_bytes: int = 256 << 20
    disk_budget_bytes: int = 512 << 20
    # ``hicache serve`` reads the hottest disk pages back to host at a start (a warm
    # start); the demo's restart phase shows the disk tier serving instead, so it is off.
    prewarm_bytes: int = 0
    start_timeout_s: float = 120.0
    stop_timeout_s: float = 120.0


class SidecarProcess:
    """``hicache serve`` in a subprocess: socket and LMDB under ``workdir``, log in
    ``workdir/sidecar.log``."""

    def __init__(self, workdir: Path, settings: SidecarSettings | None = None) -> None:
        self.workdir = workdir
        self.settings = settings or SidecarSettings()
        self.disk_path = workdir / "lmdb"
        self.ready_file = workdir / "sidecar-ready.json"
        self.log_path = workdir / "sidecar.log"
        socket_path = workdir / "run" / "hicache.sock"
        if len(str(socket_path.resolve())) > _MAX_SOCKET_PATH_CHARS:
            # A deep work folder: the socket goes to a short private temp folder instead.
            socket_path = Path(tempfile.mkdtemp(prefix="hicache-demo-")) / "hicache.sock"
        self.socket_path = socket_path.resolve()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.socket_path}"

    def start(self) -> SidecarProcess:
        """Start it and wait until it serves; raises WorkerError with its log if it fails."""
        self.launch()
        self.wait_ready()
        return self

    def launch(self) -> None:
        """Start the process without waiting for it to serve (see :meth:`wait_ready`)."""
        self.socket_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        command = [
            sys.executable,
            "-m",
            "hicache.controller.sidecar.process",
            "--socket",
            str(self.socket_path),
            "--disk-path",
            str(self.disk_path),
            "--host-pool-bytes",
            str(self.settings.host_pool_bytes),
            "--disk-budget-bytes",
            str(self.settings.disk_budget_bytes),
            "--set",
            f"prewarm_bytes={self.settings.prewarm_bytes}",
            "--metrics-port",
            "0",
            "--log-level",
            "warning",
            "--ready-file",
            str(self.ready_file),
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def wait_ready(self) -> None:
        """Wait until the launched sidecar serves; raises WorkerError with its log if it
        exits or takes longer than ``start_timeout_s``."""
        deadline = time.monotonic() + self.settings.start_timeout_s
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise WorkerError(
                    f"the sidecar exited with code {self.proc.returncode} at start:\n"
                    f"{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise WorkerError(f"the sidecar did not start in time:\n{self.log_tail()}")
            time.sleep(0.05)
        json.loads(self.ready_file.read_text())  # written atomically once it serves

    def stop(self) -> int:
        """SIGTERM, then wait for the drain (queued disk writes are committed first)."""
        if self.proc is None or self.proc.poll() is not None:
            return 0 if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(self.settings.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise WorkerError(f"the sidecar did not stop in time:\n{self.log_tail()}") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class EngineCluster:
    """Engine workers, all of one layout, over one sidecar (or none). The processes start
    at construction; :meth:`wait_ready` waits for them."""

    def __init__(
        self,
        settings: list[WorkerSettings],
        workdir: Path,
        command_timeout_s: float = 900.0,
    ) -> None:
        self.events: queue.Queue = queue.Queue()
        self.command_timeout_s = command_timeout_s
        self.workers = [
            WorkerProcess(i, s, self.events, workdir / f"engine-{s.engine_id}.log")
            for i, s in enumerate(settings)
        ]

    def wait_ready(self) -> None:
        """Wait until every worker has built its engine (and reached its sidecar)."""
        self._collect({i: "ready" for i in range(len(self.workers))})

    def __len__(self) -> int:
        return len(self.workers)

    def _collect(
        self,
        until: dict[int, str],
        on_event: Callable[[int, dict], None] | None = None,
    ) -> dict[int, dict]:
        """Wait until each worker in ``until`` sends the named event; returns those
        events. ``on_event`` sees every other event."""
        deadline = time.monotonic() + self.command_timeout_s
        waiting = dict(until)
        ends: dict[int, dict] = {}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"engine workers {sorted(waiting)} did not answer in time")
            try:
                index, event = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            kind = event.get("event")
            worker = self.workers[index]
            if kind in ("error", "exited"):
                detail = event.get("traceback") or event.get("message") or ""
                raise WorkerError(
                    f"engine worker {worker.settings.engine_id} failed ({kind}): "
                    f"{event.get('message', event.get('code', event.get('error')))}\n"
                    f"{detail}\n{worker.log_tail()}"
                )
            if waiting.get(index) == kind:
                ends[index] = event
                del waiting[index]
            elif on_event is not None:
                on_event(index, event)
        return ends

    def call(
        self,
        commands: dict[int, dict[str, Any]],
        end: str,
        on_event: Callable[[int, dict], None] | None = None,
    ) -> dict[int, dict]:
        """Send each worker its command (``{"op": ..., ...}``) at once, then wait for
        each to answer ``end``; every other event goes to ``on_event``."""
        for index, command in commands.items():
            fields = dict(command)
            self.workers[index].send(fields.pop("op"), **fields)
        return self._collect(dict.fromkeys(commands, end), on_event)

    def stop(self) -> None:
        for worker in self.workers:  # all at once: each exit takes a while
            worker.request_stop()
        for worker in self.workers:
            worker.stop()
