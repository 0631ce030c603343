"""The sidecar's sessions: who is connected, which engine each connection serves, their
leases, the fence between an engine's sessions, and the unmapping of its memory.

A connection's lease runs from its last message; one with a request in flight never
expires. When it expires, or the engine says ``bye``, or the same engine handshakes again
from a new connection, the controller forgets the engine (``unregister``: its pins are
released) and the sidecar unmaps its memory once no copy can touch it.

A dropped connection's requests that have not started are refused (``no_session``), and
the engine's next registration is answered only once those still running have ended
(:meth:`Sessions.fence`): an engine that gave up on a load or a backup keeps its pages
until then, and from then on nothing of its earlier sessions touches them.

Everything here but the job counts (under ``jobs``) and the unmap list (under its lock)
is the I/O thread's.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicache.controller.wire.protocol import ErrorCode, ProtocolError, Role

if TYPE_CHECKING:
    from hicache.controller.sidecar.device_map import MappedPools
    from hicache.controller.sidecar.metrics import SidecarMetrics
    from hicache.controller.store.local import LocalController
    from hicache.controller.wire.security import PeerCredentials
    from hicache.layout import ModelLayout

log = logging.getLogger("hicache.sidecar")

_FENCE_POLL_S = 0.5  # a fence waiting on an earlier session's jobs looks again this often


@dataclass
class Connection:
    """One handshaken peer: an engine worker or an admin tool."""

    sock: int
    routing_id: bytes
    role: Role
    engine_id: str
    pid: int
    transport: str
    since: float
    last_seen: float
    layout: ModelLayout | None = None
    page_size: int = 0
    inflight: int = 0
    mapped: MappedPools | None = None
    peer: PeerCredentials | None = None  # SO_PEERCRED of a Unix-socket peer; None over TCP
    requests: int = 0
    running: int = 0  # worker jobs under way (under the sessions' ``jobs`` condition)
    dropped: bool = False

    @property
    def key(self) -> tuple[int, bytes]:
        return (self.sock, self.routing_id)


@dataclass
class ServedLayout:
    """The one layout a sidecar serves: fixed by its config or by the first engine."""

    layout: ModelLayout
    page_size: int
    fingerprint: bytes


class Sessions:
    """The connection table of one sidecar, and what leaving it releases."""

    def __init__(
        self,
        controller: LocalController,
        metrics: SidecarMetrics,
        served: ServedLayout | None = None,
    ) -> None:
        self.controller = controller
        self.metrics = metrics
        self.served = served
        self.started = time.monotonic()
        self.conns: dict[tuple[int, bytes], Connection] = {}
        self.engines: dict[str, Connection] = {}
        self.inflight = 0  # requests handed to workers and the lane, not yet answered
        self.stopping = False
        # Worker jobs per connection, and engines' dropped connections with jobs still
        # running: a new registration of the engine waits for them (``fence``).
        self.jobs = threading.Condition()
        self._retired: list[Connection] = []
        self._unmap_lock = threading.Lock()
        self._to_unmap: list[MappedPools] = []

    def find(self, key: tuple[int, bytes], peer: PeerCredentials | None) -> Connection | None:
        """The session of a message's connection; None when there is none, or when the
        message's sender is not the process that opened it (a routing id reused)."""
        conn = self.conns.get(key)
        return conn if conn is not None and conn.peer == peer else None

    def add(self, conn: Connection) -> None:
        """Start ``conn``'s session; an engine's earlier session (a reconnect) ends."""
        if conn.role is Role.ENGINE:
            old = self.engines.get(conn.engine_id)
            if old is not None:
                self.drop(old, "replaced by a new connection")
            self.engines[conn.engine_id] = conn
        self.conns[conn.key] = conn
        self.metrics.engines.set(len(self.engines))

    def drop(self, conn: Connection, reason: str) -> None:
        """Forget ``conn``; for an engine, release its pins and unmap its memory. Its
        requests not started yet will be refused; those running are waited for by the
        engine's next registration (:meth:`fence`)."""
        with self.jobs:
            if not conn.dropped:
                conn.dropped = True
                if conn.running and conn.role is Role.ENGINE:
                    self._retired.append(conn)
        if self.conns.get(conn.key) is conn:
            del self.conns[conn.key]
        if conn.role is Role.ENGINE and self.engines.get(conn.engine_id) is conn:
            del self.engines[conn.engine_id]
            self.controller.unregister(conn.engine_id)
            log.info("engine %s (pid %d) left: %s", conn.engine_id, conn.pid, reason)
        if conn.mapped is not None:
            self.unmap_later(conn.mapped)
            conn.mapped = None
        self.metrics.engines.set(len(self.engines))

    def drop_all(self, reason: str) -> None:
        for conn in list(self.conns.values()):
            self.drop(conn, reason)

    # -- jobs ----------------------------------------------------------------------------

    def job_started(self, conn: Connection) -> bool:
        """Count a job of ``conn`` as running; False (nothing counted) once it dropped."""
        with self.jobs:
            if conn.dropped:
                return False
            conn.running += 1
            return True

    def job_ended(self, conn: Connection) -> None:
        with self.jobs:
            conn.running -= 1
            self.jobs.notify_all()

    def fence(self, conn: Connection, deadline: float) -> None:
        """Wait (on a worker) until no request of ``conn``'s engine from an earlier,
        dropped connection is running; raises ProtocolError(BUSY) at ``deadline``."""
        with self.jobs:
            while True:
                self._retired = [c for c in self._retired if c.running]
                if not any(c.engine_id == conn.engine_id for c in self._retired):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProtocolError(
                        ErrorCode.BUSY,
                        "requests of this engine's previous session are still running; "
                        "register again later",
                    )
                self.jobs.wait(min(left, _FENCE_POLL_S))

    # -- memory and leases ---------------------------------------------------------------

    def unmap_later(self, mapped: MappedPools) -> None:
        """Unmap ``mapped`` now, or as soon as no copy uses it any more."""
        mapped.buffers = None  # type: ignore[assignment]
        with self._unmap_lock:
            self._to_unmap.append(mapped)
            self._to_unmap = [m for m in self._to_unmap if not m.close()]

    def reap(self, now: float, lease_s: float) -> None:
        """Drop every connection idle past ``lease_s`` with nothing in flight; retry the
        unmaps that a running copy held up."""
        for conn in list(self.conns.values()):
            if conn.inflight == 0 and now - conn.last_seen > lease_s:
                if conn.role is Role.ENGINE:
                    self.metrics.lease_expiries.inc()
                    log.warning(
                        "engine %s (pid %d): no heartbeat for %.1fs; lease expired, its pins "
                        "and registration are released",
                        conn.engine_id,
                        conn.pid,
                        now - conn.last_seen,
                    )
                self.drop(conn, "lease expired")
        with self._unmap_lock:
            self._to_unmap = [m for m in self._to_unmap if not m.close()]

    def summary(self) -> dict[str, Any]:
        """Uptime, engines, connections, requests in flight, and whether it is stopping."""
        return {
            "uptime_s": time.monotonic() - self.started,
            "engines": len(self.engines),
            "connections": len(self.conns),
            "inflight": self.inflight,
            "stopping": self.stopping,
        }
