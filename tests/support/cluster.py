"""A real Valkey/Redis Cluster on loopback for the remote tier's tests.

:class:`LocalCluster` starts ``redis-server`` processes in cluster mode (no persistence,
``cluster-require-full-coverage no``), assigns the slots evenly to the masters, joins
them, attaches replicas, and waits until every node reports the cluster ok. Every server
is stopped by its PID. Without ``redis-server`` the tests skip, unless
``HICACHE_REQUIRE_REDIS=1`` (CI) makes them fail: ``scripts/bootstrap.sh`` installs it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

SLOTS = 16384


def require_redis_server() -> str:
    """The ``redis-server`` binary; skip (or fail under HICACHE_REQUIRE_REDIS) without."""
    path = shutil.which("redis-server")
    if path is None:
        msg = "redis-server is not installed (scripts/bootstrap.sh installs it)"
        if os.environ.get("HICACHE_REQUIRE_REDIS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def _free_port() -> int:
    """A port that is free, and whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 >= 65536:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair found")


class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each, on loopback, under ``workdir``."""

    def __init__(
        self,
        workdir: Path,
        masters: int = 3,
        replicas: int = 0,
        maxmemory_bytes: int | None = None,
        policy: str = "allkeys-lru",
        node_timeout_ms: int = 2000,
    ) -> None:
        self.binary = require_redis_server()
        self.workdir = workdir
        self.masters = masters
        self.replicas = replicas
        self.maxmemory_bytes = maxmemory_bytes
        self.policy = policy
        self.node_timeout_ms = node_timeout_ms
        self.ports: list[int] = []
        self.procs: dict[int, subprocess.Popen] = {}

    # -- processes -----------------------------------------------------------------------

    def _spawn(self, port: int) -> None:
        d = self.workdir / str(port)
        d.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-require-full-coverage", "no",
            "--save", "", "--appendonly", "no", "--protected-mode", "no",
            "--maxmemory-policy", self.policy, "--logfile", str(d / "server.log"),
        ]  # fmt: skip
        if self.maxmemory_bytes is not None:
            args += ["--maxmemory", str(self.maxmemory_bytes)]
        self.procs[port] = subprocess.Popen(args, stdin=subprocess.DEVNULL)

    def client(self, port: int) -> redis.Redis:
        return redis.Redis("127.0.0.1", port, socket_timeout=5)

    def _wait_up(self, port: int, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.client(port).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.procs[port].poll() is not None:
                    raise
                time.sleep(0.02)

    def reserve_ports(self) -> list[int]:
        """Choose the ports now (the URL is known before the servers start)."""
        if not self.ports:
            self.ports = [_free_port() for _ in range(self.masters * (1 + self.replicas))]
        return self.ports

    def start(self) -> LocalCluster:
        """Start, join and wait until every node says ``cluster_state:ok``."""
        n = self.masters * (1 + self.replicas)
        self.reserve_ports()
        for port in self.ports:
            self._spawn(port)
        for port in self.ports:
            self._wait_up(port)
        masters = self.ports[: self.masters]
        for i, port in enumerate(masters):
            lo = i * SLOTS // self.masters
            hi = (i + 1) * SLOTS // self.masters - 1
            self.client(port).execute_command("CLUSTER ADDSLOTSRANGE", lo, hi)
        for port in self.ports[1:]:
            self.client(port).execute_command("CLUSTER MEET", "127.0.0.1", self.ports[0])
        self._wait(lambda: all(self._known(p) == n for p in self.ports), "nodes to meet")
        for r, port in enumerate(self.ports[self.masters :]):
            master = masters[r % self.masters]
            master_id = self.client(master).execute_command("CLUSTER MYID")
            master_id = master_id.decode() if isinstance(master_id, bytes) else master_id
            self._wait(lambda p=port, m=master_id: self._knows(p, m), "replica to see master")
            self.client(port).execute_command("CLUSTER REPLICATE", master_id)
        self._wait(self.healthy, "cluster_state:ok")
        if self.replicas:
            self._wait(self._replicas_synced, "replicas to sync")
        return self

    def _nodes(self, port: int) -> list[dict]:
        return list(self.client(port).cluster("nodes").values())

    def _known(self, port: int) -> int:
        return len(self._nodes(port))

    def _knows(self, port: int, node_id: str) -> bool:
        return any(n["node_id"] == node_id for n in self._nodes(port))

    def _replicas_synced(self) -> bool:
        for port in self.ports[self.masters :]:
            info = self.client(port).info("replication")
            if info.get("master_link_status") != "up":
                return False
        return True

    def healthy(self) -> bool:
        """Every live node reports the cluster ok."""
        try:
            return all(
                self.client(p).cluster("info")["cluster_state"] == "ok"
                for p in self.ports
                if self.alive(p)
            )
        except redis.RedisError:
            return False

    @staticmethod
    def _wait(cond, what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the test cluster did not get {what} in {timeout_s} s")
            time.sleep(0.05)

    def alive(self, port: int) -> bool:
        return self.procs[port].poll() is None

    @property
    def url(self) -> str:
        return "redis://" + ",".join(f"127.0.0.1:{p}" for p in self.reserve_ports())

    @property
    def master_ports(self) -> list[int]:
        """The ports of the nodes that are masters now (after failovers too)."""
        out = []
        for p in self.ports:
            if not self.alive(p):
                continue
            try:
                if self.client(p).info("replication")["role"] == "master":
                    out.append(p)
            except redis.RedisError:
                continue
        return out

    def signal(self, port: int, sig: int) -> None:
        """Send ``sig`` to the server on ``port`` (by its PID)."""
        os.kill(self.procs[port].pid, sig)
        if sig == signal.SIGKILL:
            self.procs[port].wait()

    def flushall(self) -> None:
        for p in self.master_ports:
            self.client(p).flushall()

    def used_memory_bytes(self) -> int:
        return sum(self.client(p).info("memory")["used_memory"] for p in self.master_ports)

    def keys_per_master(self) -> dict[int, int]:
        return {p: self.client(p).dbsize() for p in self.master_ports}

    def stop(self) -> None:
        """Stop every server by its PID (SIGCONT first: a stopped one cannot exit)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
