"""A :class:`~hicache.controller.tiers.remote_store.RemoteStore` on a Valkey/Redis Cluster.

The client is redis-py (with its hiredis parser), used per node: this module keeps the
slot map itself (``CLUSTER SLOTS``), groups each call's keys by the master that owns
their slot, and sends one pipeline per master, all masters in parallel on a thread pool.
That gives what a cluster client's own routing does not: a result per key (a dead node
fails its keys only), and deadlines that are hicache's. redis-py's cluster client retries
and re-discovers on a hung node, which blocked 2.9 s with a 0.25 s socket timeout; here
every connection has retries off and a socket timeout equal to its call's deadline, and
the caller stops waiting at the deadline whatever a node does.

Three clients per node, by purpose: lookups (``EXISTS``), reads (``HMGET``) and writes
(``HSET``/``DEL``) never queue behind each other on one connection, so a stream of
bulk writes does not delay a lookup. A node that failed or outlasted a deadline is
*hinted* failing for ``failure_hint_s``: its keys answer SKIPPED at once meanwhile, and
the slot map is refreshed in the background (a failover moves slots to a replica).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import redis
from redis.backoff import NoBackoff
from redis.cluster import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    OutOfMemoryError,
    TryAgainError,
)
from redis.retry import Retry

from hicache.controller.tiers.remote_store import FIELD_BODY, FIELD_HEAD, Fetched, KeyStatus
from hicache.types import ConfigError

log = logging.getLogger(__name__)

SLOTS = 16384
_READ_CHUNK_BYTES = 1 << 20
Addr = tuple[str, int]


class Purpose(enum.Enum):
    """Which of a node's clients a call uses."""

    LOOKUP = "lookup"
    READ = "read"
    WRITE = "write"


@dataclass(frozen=True)
class ClusterSettings:
    """Where the cluster is and how to talk to it (built from the controller's config)."""

    seeds: tuple[Addr, ...]
    tls: bool = False
    username: str | None = None
    password: str | None = None
    tls_ca_file: str | None = None
    lookup_timeout_s: float = 0.1
    read_timeout_s: float = 1.0
    write_timeout_s: float = 2.0
    failure_hint_s: float = 2.0
    # While some node is hinted failing, the slot map is re-read this often (a failover
    # moves its slots to a replica).
    topology_refresh_s: float = 0.5
    io_threads: int = 8

    @classmethod
    def from_config(cls, config: Any) -> ClusterSettings:
        """The cluster of a ``ControllerConfig``'s ``remote_url``, with the deadlines and
        threads of its ``remote_*`` settings (the password read from
        ``remote_password_file``). Not typed on the config: it imports this module."""
        seeds, tls, user = parse_remote_url(config.remote_url)
        password = None
        if config.remote_password_file is not None:
            password = read_password_file(config.remote_password_file)
        return cls(
            seeds,
            tls=tls,
            username=user,
            password=password,
            tls_ca_file=config.remote_tls_ca_file,
            lookup_timeout_s=config.remote_lookup_timeout_s,
            read_timeout_s=config.remote_read_timeout_s,
            write_timeout_s=config.remote_write_timeout_s,
            failure_hint_s=config.remote_failure_hint_s,
            topology_refresh_s=config.remote_topology_refresh_s,
            io_threads=config.remote_io_threads,
        )

    def timeout_s(self, purpose: Purpose) -> float:
        return {
            Purpose.LOOKUP: self.lookup_timeout_s,
            Purpose.READ: self.read_timeout_s,
            Purpose.WRITE: self.write_timeout_s,
        }[purpose]


def parse_remote_url(url: str) -> tuple[tuple[Addr, ...], bool, str | None]:
    """``redis://[user@]host:port[,host:port…]`` (``rediss://``: TLS) → seeds, tls, user.

    A password in the URL is refused: it would show in process lists and config dumps;
    it belongs in ``remote_password_file``."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("redis", "rediss"):
        raise ConfigError(
            f"remote_url {url!r} must start with redis:// or rediss:// (TLS), e.g. "
            "redis://10.0.0.5:6379,10.0.0.6:6379"
        )
    user = None
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        if ":" in cred:
            raise ConfigError(
                "remote_url must not carry a password; put it in the file named by "
                "remote_password_file"
            )
        user = unquote(cred) or None
    seeds = []
    for part in rest.rstrip("/").split(","):
        host, colon, port = part.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"remote_url seed {part!r} must be host:port (in {url!r})")
        seeds.append((host.strip("[]"), int(port)))
    return tuple(seeds), scheme == "rediss", user


def read_password_file(path: str | Path) -> str:
    """The password in ``path`` (first line); a clear error when it cannot be read."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"remote_password_file {path}: cannot read it ({exc.strerror})") from None
    password = text.splitlines()[0].strip() if text.strip() else ""
    if not password:
        raise ConfigError(f"remote_password_file {path} is empty; write the password in it")
    return password


class ClusterStore:
    """Per-key calls to the masters of one cluster; see the module docstring."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._clients: dict[tuple[Addr, Purpose], redis.Redis] = {}
        self._slots: list[Addr | None] | None = None
        self._masters: tuple[Addr, ...] = ()
        self._hints: dict[Addr, float] = {}
        self._refresh_wanted = threading.Event()
        self._refreshing = threading.Lock()
        self._refreshed_at = 0.0
        self._closed = False
        self._pool = ThreadPoolExecutor(settings.io_threads, thread_name_prefix="hicache-remote")

    # -- clients and topology ------------------------------------------------------------

    def _client(self, addr: Addr, purpose: Purpose) -> redis.Redis:
        key = (addr, purpose)
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                s = self.settings
                timeout = s.timeout_s(purpose)
                client = redis.Redis(
                    host=addr[0],
                    port=addr[1],
                    socket_timeout=timeout,
                    socket_connect_timeout=timeout,
                    retry=Retry(NoBackoff(), 0),  # the deadline is ours: never retry
                    username=s.username,
                    password=s.password,
                    ssl=s.tls,
                    ssl_ca_certs=s.tls_ca_file,
                    client_name=f"hicache-{purpose.value}",
                    # Reads carry whole pages: fewer, larger socket reads (each one takes
                    # the interpreter's lock to hand its bytes to the parser).
                    socket_read_size=_READ_CHUNK_BYTES if purpose is Purpose.READ else 65536,
                )
                self._clients[key] = client
            return client

    def refresh_topology(self) -> bool:
        """Read the slot map from the first node that answers; True when one did."""
        with self._refreshing:
            candidates = list(dict.fromkeys([*self._masters, *self.settings.seeds]))
            for addr in candidates:
                try:
                    reply = self._client(addr, Purpose.LOOKUP).execute_command("CLUSTER SLOTS")
                except redis.RedisError as exc:
                    log.debug("CLUSTER SLOTS from %s:%d failed: %s", *addr, exc)
                    continue
                slots: list[Addr | None] = [None] * SLOTS
                masters = []
                for start, end, master, *_replicas in reply:
                    host = master[0].decode() if isinstance(master[0], bytes) else master[0]
                    node = (host or addr[0], int(master[1]))
                    masters.append(node)
                    slots[int(start) : int(end) + 1] = [node] * (int(end) - int(start) + 1)
                with self._lock:
                    self._slots = slots
                    self._masters = tuple(dict.fromkeys(masters))
                    self._refreshed_at = time.monotonic()
                    for node in [a for a in self._hints if a not in self._masters]:
                        del self._hints[node]
                return True
            return False

    def _topology(self, deadline: float) -> list[Addr | None] | None:
        """The slot map; the first call (or one after a failure) fetches it in time."""
        due = (
            self._hints and time.monotonic() - self._refreshed_at > self.settings.topology_refresh_s
        )
        if self._refresh_wanted.is_set() or self._slots is None or due:
            self._refresh_wanted.clear()
            self._refreshed_at = time.monotonic()  # one refresh at a time, not one per call
            job = self._pool.submit(self.refresh_topology)
            if self._slots is None:
                futures.wait([job], timeout=max(0.0, deadline - time.monotonic()))
        return self._slots

    def _hinted(self, addr: Addr, now: float) -> bool:
        until = self._hints.get(addr)
        return until is not None and now < until

    def _mark_failing(self, addr: Addr) -> None:
        with self._lock:
            self._hints[addr] = time.monotonic() + self.settings.failure_hint_s
        self._refresh_wanted.set()

    @property
    def failure_hints(self) -> int:
        """Nodes currently hinted failing."""
        now = time.monotonic()
        with self._lock:
            return sum(1 for until in self._hints.values() if now < until)

    # -- fan-out -------------------------------------------------------------------------

    def _fanout(
        self,
        purpose: Purpose,
        keys: Sequence[bytes],
        timeout_s: float,
        send: Callable[[Any, list[int]], None],
        parse: Callable[[Any], Any],
        failed: Callable[[KeyStatus], Any],
    ) -> list[Any]:
        """Run one pipeline per master over the indexes of ``keys`` it owns.

        ``send(pipeline, idxs)`` queues the commands; ``parse(reply)`` turns one reply
        (or the exception in its place) into that key's result; ``failed(status)`` is the
        result of a key not answered (ERROR, or SKIPPED for a hinted node)."""
        deadline = time.monotonic() + timeout_s
        out: list[Any] = [None] * len(keys)
        slots = self._topology(deadline) if not self._closed else None
        if slots is None:
            return [failed(KeyStatus.ERROR)] * len(keys)
        groups: dict[Addr, list[int]] = {}
        now = time.monotonic()
        for i, k in enumerate(keys):
            addr = slots[key_slot(k)]
            if addr is None:
                out[i] = failed(KeyStatus.ERROR)
            elif self._hinted(addr, now):
                out[i] = failed(KeyStatus.SKIPPED)
            else:
                groups.setdefault(addr, []).append(i)
        jobs = {}
        for addr, idxs in groups.items():
            client = self._client(addr, purpose)
            jobs[self._pool.submit(self._run, client, idxs, send)] = (addr, idxs)
        done, late = futures.wait(jobs, timeout=max(0.0, deadline - time.monotonic()))
        for job in jobs:
            addr, idxs = jobs[job]
            replies = job.result() if job in done else None
            if isinstance(replies, list) and len(replies) == len(idxs):
                moved = False
                for i, reply in zip(idxs, replies, strict=True):
                    out[i] = parse(reply)
                    moved = moved or _is_redirect(reply)
                if moved:
                    self._refresh_wanted.set()
            else:  # the node failed, or outlasted the deadline: its keys fail, it is hinted
                self._mark_failing(addr)
                if job in late:
                    log.warning("remote node %s:%d outlasted a %.3f s deadline", *addr, timeout_s)
                for i in idxs:
                    out[i] = failed(KeyStatus.ERROR)
        return out

    @staticmethod
    def _run(client: redis.Redis, idxs: list[int], send: Callable[[Any, list[int]], None]) -> Any:
        """One node's pipeline: its replies, or the exception that ended it (not raised)."""
        pipe = client.pipeline(transaction=False)
        try:
            send(pipe, idxs)
            return pipe.execute(raise_on_error=False)
        except Exception as exc:  # a dead or hung node: its keys fail, no one else's
            log.debug("remote pipeline to %s failed: %s", client, exc)
            return exc
        finally:
            pipe.reset()

    # -- the protocol --------------------------------------------------------------------

    def exists(
        self, keys: Sequence[bytes], timeout_s: float, bulk: bool = False
    ) -> list[KeyStatus]:
        def send(pipe: Any, idxs: list[int]) -> None:
            for i in idxs:
                pipe.exists(keys[i])

        def parse(reply: Any) -> KeyStatus:
            if isinstance(reply, Exception):
                return KeyStatus.ERROR
            return KeyStatus.OK if reply else KeyStatus.MISSING

        purpose = Purpose.WRITE if bulk else Purpose.LOOKUP
        return self._fanout(purpose, keys, timeout_s, send, parse, _same)

    def get(self, keys: Sequence[bytes], timeout_s: float) -> list[Fetched]:
        def send(pipe: Any, idxs: list[int]) -> None:
            for i in idxs:
                pipe.hmget(keys[i], [FIELD_HEAD, FIELD_BODY])

        def parse(reply: Any) -> Fetched:
            if isinstance(reply, Exception) or not isinstance(reply, list):
                return Fetched(KeyStatus.ERROR)
            head, body = reply
            if head is None and body is None:
                return Fetched(KeyStatus.MISSING)
            # A field missing is a truncated value: returned, so that its checks fail.
            return Fetched(KeyStatus.OK, head or b"", body or b"")

        return self._fanout(Purpose.READ, keys, timeout_s, send, parse, Fetched)

    def put(self, items: Sequence[tuple[bytes, bytes, bytes]], timeout_s: float) -> list[KeyStatus]:
        def send(pipe: Any, idxs: list[int]) -> None:
            for i in idxs:
                key, head, body = items[i]
                pipe.hset(key, mapping={FIELD_HEAD: head, FIELD_BODY: body})

        def parse(reply: Any) -> KeyStatus:
            if isinstance(reply, OutOfMemoryError):
                return KeyStatus.FULL
            return KeyStatus.ERROR if isinstance(reply, Exception) else KeyStatus.OK

        keys = [it[0] for it in items]
        return self._fanout(Purpose.WRITE, keys, timeout_s, send, parse, _same)

    def delete(self, keys: Sequence[bytes], timeout_s: float) -> list[KeyStatus]:
        def send(pipe: Any, idxs: list[int]) -> None:
            for i in idxs:
                pipe.delete(keys[i])

        def parse(reply: Any) -> KeyStatus:
            return KeyStatus.ERROR if isinstance(reply, Exception) else KeyStatus.OK

        return self._fanout(Purpose.WRITE, keys, timeout_s, send, parse, _same)

    def ping(self, timeout_s: float) -> bool:
        """True when some node answers ``CLUSTER SLOTS`` within ``timeout_s``."""
        job = self._pool.submit(self.refresh_topology)
        done, _ = futures.wait([job], timeout=timeout_s)
        return bool(done) and job.result()

    def info(self, timeout_s: float) -> dict[str, Any]:
        """Each master's reachability, memory, policy and key count; the slots covered."""
        deadline = time.monotonic() + timeout_s
        slots = self._topology(deadline)
        masters = list(self._masters)

        def node_info(addr: Addr) -> dict[str, Any]:
            client = self._client(addr, Purpose.LOOKUP)
            mem = client.info("memory")
            return {
                "addr": f"{addr[0]}:{addr[1]}",
                "up": True,
                "role": "master",
                "used_memory_bytes": int(mem.get("used_memory", 0)),
                "maxmemory_bytes": int(mem.get("maxmemory", 0)),
                "maxmemory_policy": str(mem.get("maxmemory_policy", "")),
                "keys": int(client.dbsize()),
            }

        jobs = {self._pool.submit(node_info, a): a for a in masters}
        futures.wait(jobs, timeout=max(0.0, deadline - time.monotonic()))
        nodes = []
        for job, addr in jobs.items():
            try:
                nodes.append(job.result(timeout=0))
            except Exception:  # down, hung or late: reported as down
                nodes.append({"addr": f"{addr[0]}:{addr[1]}", "up": False, "role": "master"})
        covered = 0 if slots is None else sum(1 for a in slots if a is not None)
        return {"nodes": nodes, "slots_covered": covered, "failure_hints": self.failure_hints}

    def close(self) -> None:
        """Stop the thread pool and drop every connection."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


def _same(status: KeyStatus) -> KeyStatus:
    return status


def _is_redirect(reply: Any) -> bool:
    """A reply that says the slot map changed (or is changing)."""
    return isinstance(reply, (MovedError, AskError, ClusterDownError, TryAgainError))
