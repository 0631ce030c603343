"""Fixtures of the vLLM suite: the tiny model, a sidecar, vLLM instances as processes.

Runs in ``.venv-vllm`` (``make test-vllm``). The sidecar helpers of the default suite
(``tests/support/sidecar.py``) are reused as they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ENGINE_TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(ENGINE_TESTS.parents[2]))  # the repository: tests.support

from vllm_instance import make_tiny_llama  # noqa: E402

from tests.support.sidecar import Sidecar, short_tmpdir, wait_for  # noqa: E402

INSTANCE = ENGINE_TESTS / "vllm_instance.py"
INSTANCE_TIMEOUT_S = 900.0  # a vLLM start takes 1-2 minutes on a busy 2-core machine


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def sidecar_dir() -> Iterator[Path]:
    path = short_tmpdir("hv")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def flat_stats(stats: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The sidecar's nested stats as ``a.b.c`` keys, as ``hicachectl stats`` prints them."""
    out: dict[str, Any] = {}
    for key, value in stats.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_stats(value, name + "."))
        else:
            out[name] = value
    return out


def sidecar_stats(sidecar: Sidecar) -> dict[str, Any]:
    from hicache.controller.wire.protocol import Verb

    admin = sidecar.admin()
    try:
        return flat_stats(admin.call(Verb.STATS))
    finally:
        admin.close()


def worker_counters(log: Path, rank: int = 0) -> dict[str, int]:
    """The counters a vLLM worker logged at its shutdown (``hicache worker N: k=v ...``)."""
    mark = f"hicache worker {rank}: "
    lines = [line for line in log.read_text().splitlines() if mark in line and "=" in line]
    assert lines, f"no counters of worker {rank} in {log}"
    pairs = (item.split("=") for item in lines[-1].split(mark, 1)[1].split())
    return {k: int(v) for k, v in pairs}


class Instance:
    """A vLLM instance process serving rounds of prompts (``vllm_instance.py``)."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        model: Path,
        rounds: list[list[Any]],
        socket: Path | None,
        pause_before: tuple[int, ...] = (),
        reset_before: tuple[int, ...] = (),
        extra: dict[str, Any] | None = None,
        max_tokens: int = 4,
        kv_events: str | None = None,
    ) -> None:
        self.dir = workdir / name
        self.dir.mkdir(parents=True)
        (self.dir / "requests.json").write_text(json.dumps(rounds))
        self.out = self.dir / "out.json"
        cmd = [
            sys.executable,
            str(INSTANCE),
            "--model",
            str(model),
            "--requests",
            str(self.dir / "requests.json"),
            "--out",
            str(self.out),
            "--pause-dir",
            str(self.dir),
            "--max-tokens",
            str(max_tokens),
            "--extra",
            json.dumps(extra or {}),
        ]
        if socket is not None:
            cmd += ["--socket", str(socket)]
        if kv_events is not None:
            cmd += ["--kv-events", kv_events]
        for n in pause_before:
            cmd += ["--pause-before", str(n)]
        for n in reset_before:
            cmd += ["--reset-before", str(n)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
        self.log = self.dir / "instance.log"
        with open(self.log, "w") as log:
            # Its own process group: vLLM starts an engine-core and a worker process.
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text().splitlines()[-n:])

    def wait_paused(self, round_index: int) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"instance exited early:\n{self.log_tail()}")
            return (self.dir / f"ready-{round_index}").exists()

        wait_for(ready, INSTANCE_TIMEOUT_S, f"round {round_index}", every_s=0.2)

    def resume(self, round_index: int) -> None:
        (self.dir / f"go-{round_index}").touch()

    def result(self) -> list[dict[str, Any]]:
        """Wait for the instance to finish; its rounds' results."""
        try:
            rc = self.proc.wait(INSTANCE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"instance hung:\n{self.log_tail()}") from None
        assert rc == 0 and self.out.exists(), f"instance failed ({rc}):\n{self.log_tail()}"
        return json.loads(self.out.read_text())

    def stop(self) -> None:
        """Stop the instance and the processes it started (its process group, by PID)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(60)
        else:
            with contextlib.suppress(ProcessLookupError):  # children left behind, if any
                os.killpg(self.proc.pid, signal.SIGKILL)
