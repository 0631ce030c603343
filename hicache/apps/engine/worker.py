"""An engine worker process: a model, shared-memory pools, a cache over the sidecar, and a
scheduler, driven by a parent process (``hicache demo``) over its stdin and stdout.

Frames are a 4-byte big-endian length and a msgpack map, both ways (no pickle). The parent
sends one command at a time; the worker answers with events, the last of which names the
command's end:

* ``run`` ``{mode, requests}`` — serve the requests (``mode`` "cached": the scheduler over
  the shared cache; "nocache": the same scheduler with prefix reuse off, on private
  pools). One ``finished`` event per request as it finishes, then ``ran`` with the wall
  time. A cached run waits for its backups before ``ran``, so that another engine can
  hit them.
* ``verify`` ``{rids}`` — run :func:`generate` (the cache-off baseline) on each request and
  compare its logits with those of the cached and cache-off runs by ``torch.equal``; one
  ``verified`` event per request, then ``verify_done``.
* ``stats`` — the sidecar's stats and the cache's counters.
* ``stop`` — close the sidecar session and the pools, answer ``stopped``, exit.

A command that fails answers ``error`` with the message and traceback; the worker keeps
serving. Run as ``python -m hicache.apps.engine.worker '<settings JSON>'``
(:class:`WorkerSettings`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import msgpack

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20


class WorkerError(RuntimeError):
    """A worker process died, answered an error, or did not answer in time."""


@dataclass
class WorkerSettings:
    """What an engine worker is: its id, model layout, pool sizes and scheduler sizes.

    ``socket`` is the sidecar's endpoint (None: no controller, device tier only); with
    ``sidecar_ready_file`` the worker waits up to ``sidecar_wait_s`` for that file (the
    sidecar writes it once it serves) before it registers.
    """

    engine_id: str
    kinds: tuple[str, ...] = ("full", "swa", "mamba", "full")
    page_size: int = 16
    sliding_window: int = 48
    full_slots: int = 16384
    mamba_slots: int = 64
    socket: str | None = None
    sidecar_ready_file: str | None = None
    sidecar_wait_s: float = 120.0
    # Generous: on a small, busy machine a lookup that times out is a miss, and three in
    # a row open the client's breaker (the engine then serves from its device alone).
    sidecar_lookup_timeout_s: float = 2.0
    sidecar_request_timeout_s: float = 30.0
    prefill_chunk_tokens: int = 64
    max_prefill_tokens_per_step: int = 256
    max_running_requests: int = 16
    torch_threads: int = 1
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSettings:
        data = json.loads(text)
        data["kinds"] = tuple(data["kinds"])
        return cls(**data)


# -- frames -------------------------------------------------------------------------------


def write_frame(stream: IO[bytes], message: dict[str, Any]) -> None:
    body = msgpack.packb(message, use_bin_type=True)
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def read_frame(stream: IO[bytes]) -> dict[str, Any] | None:
    """The next frame, or None at end of stream."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise WorkerError(f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    body = stream.read(size)
    if len(body) < size:
        return None
    return msgpack.unpackb(body, raw=False)


# -- the worker process -----------------------------------------------------------------


class WorkerEngine:
    """The worker's state: a cached engine, a cache-off engine, and the logits of both."""

    def __init__(self, settings: WorkerSettings, emit: Callable[[dict], None]) -> None:
        import torch

        from hicache import CacheConfig, DevicePools, UnifiedRadixCache
        from hicache.apps.engine.model import HybridModel, tiny_hybrid
        from hicache.apps.engine.scheduler import Scheduler, SchedulerConfig
        from hicache.config import PrefetchPolicy

        torch.set_num_threads(settings.torch_threads)
        self.settings = settings
        self.emit = emit
        spec = tiny_hybrid(
            settings.kinds,
            page_size=settings.page_size,
            sliding_window=settings.sliding_window,
            full_slots=settings.full_slots,
            mamba_slots=settings.mamba_slots,
            seed=settings.seed,
        )
        self.model = HybridModel(spec.layout, spec.model_config)
        base = dataclasses.asdict(spec.cache_config)
        # Wait for disk reads at load-back: after a restart every hit is on disk, and a
        # best-effort load would only start a prefetch and recompute.
        shared = CacheConfig(
            **{**base, "shared_memory": True, "prefetch_policy": PrefetchPolicy.WAIT_COMPLETE}
        )
        self.pools = DevicePools.allocate(spec.layout, shared)
        self.controller = None
        if settings.socket:
            from hicache.controller.client.sidecar_client import SidecarController

            if settings.sidecar_ready_file:
                _wait_for_file(Path(settings.sidecar_ready_file), settings.sidecar_wait_s)
            from hicache.controller.client.sidecar_client import SidecarClientConfig

            client = SidecarClientConfig(
                lookup_timeout_s=settings.sidecar_lookup_timeout_s,
                request_timeout_s=settings.sidecar_request_timeout_s,
            )
            self.controller = SidecarController(
                settings.socket, engine_id=settings.engine_id, config=client
            )
        self.cache = UnifiedRadixCache(spec.layout, shared, self.pools, self.controller)
        sched = SchedulerConfig(
            prefill_chunk_tokens=settings.prefill_chunk_tokens,
            max_prefill_tokens_per_step=settings.max_prefill_tokens_per_step,
            max_running_requests=settings.max_running_requests,
        )
        self.scheduler = Scheduler(self.model, self.cache, sched)
        private = CacheConfig(**base)
        self.private_pools = DevicePools.allocate(spec.layout, private)
        self.nocache = Scheduler(
            self.model,
            UnifiedRadixCache(spec.layout, private, self.private_pools),
            dataclasses.replace(sched, reuse_prefixes=False),
        )
        self.requests: dict[str, Any] = {}
        self.logits: dict[str, dict[str, Any]] = {"cached": {}, "nocache": {}}

    def run(self, mode: str, requests: list[dict]) -> dict:
        from hicache.apps.engine.scheduler import GenerationRequest

        if mode not in self.logits:
            raise ValueError(f"run mode must be 'cached' or 'nocache', got {mode!r}")
        scheduler = self.scheduler if mode == "cached" else self.nocache
        specs = [
            GenerationRequest.of(r["rid"], r["prompt"], r["max_new_tokens"], r.get("extra_key"))
            for r in requests
        ]
        for spec in specs:
            self.requests[spec.rid] = spec

        def finished(result: Any) -> None:
            self.logits[mode][result.rid] = result.logits
            self.emit({"event": "finished", "mode": mode, "result": _result_dict(result)})

        began = time.perf_counter()
        scheduler.run(specs, on_finish=finished)
        if mode == "cached":
            self.cache.flush_backups()
        return {"event": "ran", "mode": mode, "wall_s": time.perf_counter() - began}

    def verify(self, rids: list[str]) -> dict:
        import torch

        from hicache.apps.engine.reference import generate

        for rid in rids:
            spec = self.requests[rid]
            expected = generate(
                self.model,
                self.private_pools,
                spec.prompt_ids,
                spec.max_new_tokens,
                # another chunking than the scheduler's: the logits must not depend on it
                prefill_chunk_tokens=2 * self.settings.prefill_chunk_tokens,
            ).logits
            verdict: dict[str, Any] = {"event": "verified", "rid": rid, "tokens": len(expected)}
            for mode, stored in self.logits.items():
                got = stored.get(rid)
                verdict[mode] = None if got is None else bool(torch.equal(got, expected))
                if got is not None and got.shape == expected.shape and not verdict[mode]:
                    verdict[f"{mode}_max_abs_diff"] = float((got - expected).abs().max())
            self.emit(verdict)
        return {"event": "verify_done", "checked": len(rids)}

    def stats(self) -> dict:
        sidecar = self.controller.stats() if self.controller is not None else None
        client = (sidecar or {}).pop("client", None)
        counters = self.cache.stats().counters
        return {
            "event": "stats",
            "sidecar": _plain(sidecar),
            "client": _plain(client),
            "cache": _plain(counters),
        }

    def close(self) -> None:
        try:
            self.cache.flush_backups()
        finally:
            if self.controller is not None:
                self.controller.close()
            self.pools.close()
            self.private_pools.close()


def _wait_for_file(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise WorkerError(f"the sidecar did not write {path} within {timeout_s} s")
        time.sleep(0.05)


def _result_dict(result: Any) -> dict:
    return {
        f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.name != "logits"
    }


def _plain(value: Any) -> Any:
    """A msgpack-safe copy (dict keys as strings)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    """The worker process: ``python -m hicache.apps.engine.worker '<settings JSON>'``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hicache.apps.engine.worker '<settings JSON>'", file=sys.stderr)
        return 2
    settings = WorkerSettings.from_json(argv[0])
    # Frames own the real stdout; anything else printed goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    stdin = sys.stdin.buffer

    def emit(message: dict) -> None:
        write_frame(out, message)

    try:
        engine = WorkerEngine(settings, emit)
    except Exception as exc:
        emit({"event": "error", "message": f"{exc}", "traceback": traceback.format_exc()})
        return 1
    emit({"event": "ready", "pid": os.getpid()})
    while True:
        command = read_frame(stdin)
        if command is None or command.get("op") == "stop":
            engine.close()
            emit({"event": "stopped"})
            out.close()
            # Everything is closed and flushed; the interpreter's teardown with torch
            # loaded would only add a second or more to every restart.
            os._exit(0)
        try:
            op = command.get("op")
            if op == "run":
                emit(engine.run(command["mode"], command["requests"]))
            elif op == "verify":
                emit(engine.verify(command["rids"]))
            elif op == "stats":
                emit(engine.stats())
            else:
                raise ValueError(f"unknown command {op!r}")
        except Exception as exc:
            emit({"event": "error", "message": f"{exc}", "traceback": traceback.format_exc()})


# -- the parent's handle --------------------------------------------------------------------


class WorkerProcess:
    """A running worker; its events arrive on ``events`` as ``(worker index, event)``."""

    def __init__(
        self,
        index: int,
        settings: WorkerSettings,
        events: queue.Queue,
        log_path: Path,
        python: str = sys.executable,
    ) -> None:
        self.index = index
        self.settings = settings
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [python, "-m", "hicache.apps.engine.worker", settings.to_json()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._events = events
        self._reader = threading.Thread(target=self._pump, daemon=True, name=f"worker-{index}")
        self._reader.start()

    def _pump(self) -> None:
        try:
            while True:
                event = read_frame(self.proc.stdout)
                if event is None:
                    break
                self._events.put((self.index, event))
        except Exception as exc:  # a broken frame: report it as the worker's death
            self._events.put((self.index, {"event": "exited", "error": str(exc)}))
            return
        self._events.put((self.index, {"event": "exited", "code": self.proc.wait()}))

    def send(self, op: str, **fields: Any) -> None:
        try:
            write_frame(self.proc.stdin, {"op": op, **fields})
        except (BrokenPipeError, OSError) as exc:
            raise WorkerError(
                f"engine worker {self.settings.engine_id} is gone ({exc}); see {self.log_path}"
            ) from exc

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def request_stop(self) -> None:
        """Ask the worker to stop (it closes its session and pools, then exits)."""
        if self.proc.poll() is None and not self.proc.stdin.closed:
            try:
                self.send("stop")
                self.proc.stdin.close()
            except (WorkerError, OSError, ValueError):
                pass

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the worker to stop, then wait; kill it if it does not exit in time."""
        self.request_stop()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5.0)
        self._log.close()


if __name__ == "__main__":
    sys.exit(main())
