"""The sidecar's ZeroMQ server: a ROUTER socket in front of a :class:`LocalController`.

Threading model
---------------
* **The I/O thread** (:meth:`SidecarServer.serve`) owns every ZeroMQ socket. It decodes
  and checks each message, keeps the connection table (handshakes, leases), answers the
  cheap verbs itself (lookup, pin, unpin, heartbeat, stats, the admin queries) and hands
  the rest to workers. Nothing it does waits on a copy or a disk read, so a lookup is
  answered while loads and backups run.
* **Workers** (a thread pool) run register, backup, load, prefetch and the long admin
  verbs, and pass their replies back through an inproc socket.

A connection's lease runs from its last message; one with a request in flight never
expires. When it expires, or the engine says ``bye``, or the same engine handshakes again
from a new connection, the controller forgets the engine (``unregister``: its pins are
released) and the sidecar unmaps its memory.

A dropped connection's requests that have not started are refused (``no_session``), and
the engine's next registration is answered only once those still running have ended
(``"fenced": true`` in the reply): an engine that gave up on a load or a backup keeps
its pages until then, and from then on nothing of its earlier sessions touches them.

Anything malformed is answered with an error reply and changes nothing (see
:mod:`hicache.controller.protocol` for the codes); only a message past four times
``max_message_bytes`` is dropped unread by ZeroMQ itself, with its connection.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import secrets
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
import zmq.auth

from hicache.controller.fair_lane import FairLane
from hicache.controller.fd_pass import FdInbox, fd_socket_path
from hicache.controller.local import LocalController
from hicache.controller.metrics import SidecarMetrics
from hicache.controller.protocol import (
    ErrorCode,
    ProtocolError,
    Request,
    Role,
    Verb,
    decode_request,
    error_reply,
    ok_reply,
    progress_reply,
)
from hicache.controller.security import PeerCredentials, peer_credentials
from hicache.controller.sidecar_config import SidecarConfig, TcpAuth
from hicache.controller.sidecar_verbs import VerbHandlers
from hicache.controller_api import ControllerError
from hicache.types import HicacheError

if TYPE_CHECKING:
    from hicache.controller.device_share import MappedPools
    from hicache.layout import ModelLayout

log = logging.getLogger("hicache.sidecar")

_REPLY = b"R"
_PROGRESS = b"P"
_REFREEZE_MIN_ENTRIES = 100_000  # index growth that earns another gc.freeze()
_MAX_BATCH = 256  # messages read per socket per loop turn, so no socket starves another
_POLL_MS = 100
_ZAP_DOMAIN = "hicache"
# libzmq drops (with the connection) any frame past this multiple of max_message_bytes;
# below it the sidecar reads the message and answers TOO_LARGE itself.
_HARD_LIMIT_FACTOR = 4


class _TracebackLimiter:
    """Logs the traceback of an unexpected error at most once per ``interval_s``; the
    others in between are counted and reported with the next one. Anyone who can connect
    can trigger a bug as often as they like: the log must not grow with them."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last = -interval_s
        self._suppressed = 0
        self._lock = threading.Lock()

    def log(self, exc: BaseException) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval_s:
                self._suppressed += 1
                return
            self._last, suppressed, self._suppressed = now, self._suppressed, 0
        log.error(
            "internal error (%d more since the last traceback, not shown)",
            suppressed,
            exc_info=(type(exc), exc, exc.__traceback__),
        )


_TRACEBACK_INTERVAL_S = 60.0
_internal_errors = _TracebackLimiter(_TRACEBACK_INTERVAL_S)


class SidecarError(HicacheError):
    """The sidecar cannot start or serve; the message says what to do."""


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
    running: int = 0  # worker jobs under way (under the server's ``jobs`` condition)
    dropped: bool = False

    @property
    def key(self) -> tuple[int, bytes]:
        return (self.sock, self.routing_id)


class SidecarServer:
    """Serves one LocalController to the engines and admin tools of a node."""

    def __init__(
        self,
        controller: LocalController,
        config: SidecarConfig | None = None,
        metrics: SidecarMetrics | None = None,
        layout: tuple[ModelLayout, int] | None = None,
        own_process: bool = False,
    ) -> None:
        """``layout``: the (layout, page_size) served, when fixed up front; otherwise the
        first engine's handshake fixes it. ``own_process``: the process is this sidecar's
        alone (``hicache serve``), so it may tune process-wide state such as the garbage
        collector (:meth:`freeze_long_lived`)."""
        self.controller = controller
        self.own_process = own_process
        self.frozen_at_entries = -1  # index size at the last freeze_long_lived, -1: never
        self.config = config or SidecarConfig()
        self.verbs = VerbHandlers(self)
        self.metrics = metrics or SidecarMetrics(self.verbs.metrics_snapshot)
        self.layout: ModelLayout | None = None
        self.page_size = 0
        self.fingerprint: bytes | None = None
        if layout is not None:
            self.layout, self.page_size = layout
            self.fingerprint = self.layout.fingerprint(self.page_size)
        self.started = time.monotonic()
        self.endpoints: list[str] = []
        self.admin_token = b""
        self.fd_inbox: FdInbox | None = None  # memory descriptors (controller/fd_pass.py)
        self.conns: dict[tuple[int, bytes], Connection] = {}
        self.engines: dict[str, Connection] = {}
        self.stopping = False
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._routers: list[zmq.Socket] = []
        self._transports: list[str] = []
        self._auth: Any = None
        self._replies: zmq.Socket | None = None
        self._reply_addr = f"inproc://hicache-replies-{id(self)}"
        self._local = threading.local()
        self._push_sockets: list[zmq.Socket] = []
        self._push_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(
            self.config.worker_threads, thread_name_prefix="hicache-sidecar-worker"
        )
        self._lane = FairLane("hicache-sidecar-bulk")
        self._inflight = 0
        # Worker jobs per connection, and engines' dropped connections with jobs still
        # running: a new registration of the engine waits for them (``fence``).
        self.jobs = threading.Condition()
        self._retired: list[Connection] = []
        self._unmap_lock = threading.Lock()
        self._to_unmap: list[MappedPools] = []
        self._last_reap = 0.0

    # -- binding -------------------------------------------------------------------------

    def _router(self) -> zmq.Socket:
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, _HARD_LIMIT_FACTOR * self.config.max_message_bytes)
        s.setsockopt(zmq.RCVHWM, 10_000)
        s.setsockopt(zmq.SNDHWM, 10_000)
        return s

    def _private_dir(self, path: Path, setting: str) -> None:
        """Create ``path`` mode 0700, or check the directory that is there: the socket and
        the admin token in it are trusted only because no other user can replace them.
        Raises SidecarError for a symbolic link, a non-directory or a directory of another
        user; a directory of this user that others may enter is made 0700 (and logged).
        ``setting``: the option that put the directory there, for the messages."""
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700, parents=True)
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            problem = "is a symbolic link"
        elif not stat.S_ISDIR(st.st_mode):
            problem = "is not a directory"
        elif st.st_uid != os.getuid():
            problem = f"belongs to uid {st.st_uid}, not to the sidecar's user (uid {os.getuid()})"
        else:
            mode = stat.S_IMODE(st.st_mode)
            if mode & 0o077:
                os.chmod(path, 0o700)
                log.warning(
                    "the directory %s (of %s) was mode %04o; made it 0700", path, setting, mode
                )
            return
        raise SidecarError(
            f"the directory {path} (of {setting}) {problem}, so another user could replace the "
            f"socket or plant the admin token; remove it, or set {setting} to a path in a "
            "directory of your own"
        )

    def _bind_ipc(self) -> str:
        path = self.config.socket
        self._private_dir(path.parent, "socket_path")
        if path.exists() or path.is_symlink():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
                raise SidecarError(
                    f"another sidecar is serving {path}; stop it or choose another socket_path"
                )
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink(missing_ok=True)  # left behind by a sidecar that died
            finally:
                probe.close()
        router = self._router()
        endpoint = "ipc://" + str(path)
        old = os.umask(0o177)  # the socket is created 0600: only our user may connect
        try:
            router.bind(endpoint)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        self._routers.append(router)
        self._transports.append("ipc")
        return endpoint

    def _bind_tcp(self) -> str:
        from zmq.auth.thread import ThreadAuthenticator

        cfg = self.config
        router = self._router()
        auth_log = logging.getLogger("hicache.sidecar.auth")
        auth_log.setLevel(logging.INFO)  # its debug lines would print PLAIN passwords
        self._auth = ThreadAuthenticator(self._ctx, log=auth_log)
        self._auth.start()
        if cfg.tcp_auth is TcpAuth.CURVE:
            public, secret = zmq.auth.load_certificate(str(cfg.curve_secret_key_file))
            if secret is None:
                raise SidecarError(
                    f"{cfg.curve_secret_key_file} holds no secret key; give the server's "
                    "secret certificate (zmq.auth.create_certificates writes one)"
                )
            router.curve_secretkey = secret
            router.curve_publickey = public
            router.curve_server = True
            self._auth.configure_curve(
                domain=_ZAP_DOMAIN, location=str(cfg.curve_authorized_keys_dir)
            )
        else:
            token = Path(cfg.tcp_token_file).read_text().strip()
            if len(token) < 16:
                raise SidecarError(f"the token in {cfg.tcp_token_file} is shorter than 16 chars")
            router.plain_server = True
            self._auth.configure_plain(domain=_ZAP_DOMAIN, passwords={"hicache": token})
        router.zap_domain = _ZAP_DOMAIN.encode()
        router.bind(cfg.tcp_endpoint)
        self._routers.append(router)
        self._transports.append("tcp")
        return router.getsockopt_string(zmq.LAST_ENDPOINT)

    def _load_admin_token(self) -> bytes:
        """The token this sidecar wrote before (kept across restarts), or a fresh one.

        An existing file is trusted only if it is a regular file of the sidecar's user that
        no other user may read or write (mode 0600 or 0400). Any other (planted by another
        user, readable by others, a symbolic link) is replaced by a fresh token (logged):
        written to a new 0600 file and renamed over it, never into the file that was there.
        """
        path = self.config.admin_token_path
        beside_socket = path.parent == self.config.socket.parent
        self._private_dir(path.parent, "socket_path" if beside_socket else "admin_token_file")
        try:
            # O_NONBLOCK: a FIFO planted there must not hang the start.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            distrust = None
        except OSError as exc:
            distrust = "a symbolic link" if path.is_symlink() else exc.strerror
        else:
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    distrust = "not a regular file"
                elif st.st_uid != os.getuid():
                    distrust = f"written by uid {st.st_uid}"
                elif stat.S_IMODE(st.st_mode) & 0o077:
                    distrust = f"mode {stat.S_IMODE(st.st_mode):04o}, open to other users"
                else:
                    token = os.read(fd, 4096).strip()
                    if len(token) >= 16:
                        return token
                    distrust = None  # empty or cut short: simply write a new one
            finally:
                os.close(fd)
        if distrust:
            log.warning("admin token %s not trusted (%s); writing a new one", path, distrust)
        token = secrets.token_hex(32).encode()
        fresh = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(token + b"\n")
            os.replace(fresh, path)
        except BaseException:
            fresh.unlink(missing_ok=True)
            raise
        return token

    def bind(self) -> list[str]:
        """Create and bind the sockets; returns the endpoints served."""
        self.admin_token = self._load_admin_token()
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._replies.bind(self._reply_addr)
        self.endpoints.append(self._bind_ipc())
        self.fd_inbox = FdInbox(fd_socket_path(self.config.socket))
        if self.config.tcp_endpoint:
            self.endpoints.append(self._bind_tcp())
        log.info("listening on %s", ", ".join(self.endpoints))
        return self.endpoints

    def freeze_long_lived(self) -> None:
        """Leave what is alive now (above all the page index just rebuilt from disk) out of
        every later garbage collection. The index is large, long-lived and acyclic; a full
        collection would scan all of it (1.9 s for a million pages on a 2-core machine)
        while lookups wait, and the first one after the rebuild would come at once. What is
        freed later by reference counting is still freed."""
        if not self.own_process:
            return  # a server inside another program leaves its collector alone
        gc.collect(1)  # young garbage first, so that little of it is kept for good
        gc.freeze()
        self.frozen_at_entries = len(self.controller.store.index)
        log.info("%d long-lived objects left out of garbage collection", gc.get_freeze_count())

    def _refreeze_if_grown(self) -> None:
        """Freeze again once the index has grown by half (and by ``_REFREEZE_MIN_ENTRIES``)
        since the last freeze: a sidecar that started empty and filled its disk would
        otherwise be back to collections that scan most of its index."""
        if self.frozen_at_entries < 0:
            return
        n = len(self.controller.store.index)
        if n - self.frozen_at_entries >= max(_REFREEZE_MIN_ENTRIES, self.frozen_at_entries // 2):
            self.freeze_long_lived()

    # -- the I/O loop --------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask :meth:`serve` to drain and return (safe from a signal handler)."""
        self._stop.set()

    def serve(self) -> None:
        """Run the I/O loop until :meth:`request_stop`; then finish in-flight requests
        (up to ``drain_timeout_s``) and return. The controller is left open."""
        if not self._routers:
            self.bind()
        poller = zmq.Poller()
        for r in self._routers:
            poller.register(r, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        drain_deadline = None
        while True:
            if self._stop.is_set() and drain_deadline is None:
                self.stopping = True
                drain_deadline = time.monotonic() + self.config.drain_timeout_s
                log.info("stopping: %d requests in flight to finish", self._inflight)
            if drain_deadline is not None:
                if self._inflight == 0:
                    break
                if time.monotonic() > drain_deadline:
                    log.error("drain timed out with %d requests in flight", self._inflight)
                    break
            events = dict(poller.poll(_POLL_MS))
            for i, r in enumerate(self._routers):
                if r in events:
                    self._read_router(i, r)
            if self._replies in events:
                self._read_replies()
            now = time.monotonic()
            if now - self._last_reap > min(1.0, self.config.lease_s / 4):
                self._last_reap = now
                self._reap(now)
        self._shutdown_sockets()

    def _read_router(self, i: int, router: zmq.Socket) -> None:
        for _ in range(_MAX_BATCH):
            try:
                # Frames, not bytes: a Unix-socket message carries its sender's credentials.
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_message(i, frames)

    def _read_replies(self) -> None:
        while True:
            try:
                kind, sock, rid, payload = self._replies.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            i = sock[0]
            if kind == _REPLY:
                self._inflight -= 1
                conn = self.conns.get((i, rid))
                if conn is not None:
                    conn.inflight -= 1
                    conn.last_seen = time.monotonic()
            self._send(i, rid, payload)

    def _send(self, i: int, rid: bytes, payload: bytes) -> None:
        try:
            self._routers[i].send_multipart([rid, payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or not reading: the reply is dropped
            log.debug("reply dropped: %s", exc)

    # -- one message ---------------------------------------------------------------------

    def _reject(self, i: int, rid: bytes, req_id: int | None, verb: str, exc: ProtocolError):
        self.metrics.failures.labels(verb, exc.code.value).inc()
        log.debug("refused %s: %s %s", verb, exc.code.value, exc.message)
        self._send(i, rid, error_reply(req_id, exc.code, exc.message))

    def _on_message(self, i: int, frames: list[zmq.Frame]) -> None:
        t0 = time.monotonic()
        rid = frames[0].bytes
        if len(frames) != 2:
            self._reject(
                i,
                rid,
                None,
                "invalid",
                ProtocolError(ErrorCode.BAD_MESSAGE, "a request is exactly one frame"),
            )
            return
        try:
            req = decode_request(frames[1].bytes, self.config.max_message_bytes)
        except ProtocolError as exc:
            self._reject(i, rid, getattr(exc, "request_id", None), "invalid", exc)
            return
        verb = req.verb.value
        self.metrics.requests.labels(verb).inc()
        peer = peer_credentials(frames[1]) if self._transports[i] == "ipc" else None
        conn = self.conns.get((i, rid))
        if conn is not None and conn.peer != peer:
            # Another process reusing a departed peer's routing id: not its session.
            conn = None
        if conn is not None:
            conn.last_seen = t0
            conn.requests += 1
        try:
            self._check_allowed(conn, req)
            deadline = t0 + min(req.ttl_s, self.config.max_request_ttl_s)
            if req.verb is Verb.HELLO:
                result = self.verbs.hello(i, rid, req, t0, peer)
            elif req.verb in self.verbs.inline and not self.verbs.is_bulk(req):
                result = self.verbs.inline[req.verb](conn, req)
            else:
                self._dispatch(conn, req, deadline, t0)
                return
        except ProtocolError as exc:
            self._reject(i, rid, req.id, verb, exc)
            return
        except Exception as exc:
            self._reject(i, rid, req.id, verb, _as_protocol_error(exc))
            return
        self._send(i, rid, ok_reply(req.id, result))
        self.metrics.latency.labels(verb).observe(time.monotonic() - t0)

    def _check_allowed(self, conn: Connection | None, req: Request) -> None:
        if self.stopping:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        if req.verb is Verb.HELLO:
            if conn is not None:
                raise ProtocolError(
                    ErrorCode.OUT_OF_ORDER, "this connection has completed its handshake already"
                )
            return
        if conn is None:
            raise ProtocolError(
                ErrorCode.NO_SESSION,
                "no handshake on this connection: send hello first (after a sidecar restart, "
                "handshake and register again)",
            )
        if conn.role is Role.ENGINE and req.verb.admin:
            raise ProtocolError(
                ErrorCode.FORBIDDEN,
                f"{req.verb.value} is an admin verb; engine connections may not use it",
            )
        if conn.role is Role.ADMIN and req.verb not in self.verbs.admin_allowed:
            raise ProtocolError(
                ErrorCode.FORBIDDEN,
                f"{req.verb.value} is an engine verb; admin connections may not use it",
            )
        if req.verb.needs_registration and conn.mapped is None:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER,
                f"{req.verb.value} before register: register the engine's device pools first",
            )

    def _dispatch(self, conn: Connection, req: Request, deadline: float, t0: float) -> None:
        if self._inflight >= self.config.max_inflight_requests:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"{self._inflight} requests in flight (max_inflight_requests); retry later",
            )
        self._inflight += 1
        conn.inflight += 1
        if req.verb in self.verbs.inline:  # a large lookup or pin: one engine at a time
            self._lane.submit(conn.engine_id, lambda: self._run_job(conn, req, deadline, t0))
        else:
            self._executor.submit(self._run_job, conn, req, deadline, t0)

    # -- workers -------------------------------------------------------------------------

    def _push(self, frames: list[bytes]) -> None:
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(self._reply_addr)
            self._local.push = sock
            with self._push_lock:
                self._push_sockets.append(sock)
        sock.send_multipart(frames)

    def progress(self, conn: Connection, req: Request, done: int, total: int) -> None:
        """Send a progress message for a long request (from its worker)."""
        self._push(
            [_PROGRESS, bytes((conn.sock,)), conn.routing_id, progress_reply(req.id, done, total)]
        )

    def _run_job(self, conn: Connection, req: Request, deadline: float, t0: float) -> None:
        verb = req.verb.value
        with self.jobs:
            started = not conn.dropped
            if started:
                conn.running += 1
        try:
            if not started:
                raise ProtocolError(
                    ErrorCode.NO_SESSION, f"{verb}: the session ended before it could start"
                )
            if time.monotonic() > deadline:
                raise ProtocolError(
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"{verb} waited past its deadline ({req.ttl_s:.3f}s) before it could start",
                )
            if req.verb in self.verbs.workers:
                result = self.verbs.workers[req.verb](conn, req, deadline)
            else:  # a bulk lookup or pin: its deadline is the client's, it ends soon
                result = self.verbs.inline[req.verb](conn, req)
            payload = ok_reply(req.id, result)
        except Exception as exc:
            perr = exc if isinstance(exc, ProtocolError) else _as_protocol_error(exc)
            self.metrics.failures.labels(verb, perr.code.value).inc()
            payload = error_reply(req.id, perr.code, perr.message)
        finally:
            if started:
                with self.jobs:
                    conn.running -= 1
                    self.jobs.notify_all()
        self.metrics.latency.labels(verb).observe(time.monotonic() - t0)
        self._push([_REPLY, bytes((conn.sock,)), conn.routing_id, payload])

    # -- connections ---------------------------------------------------------------------

    def transport(self, i: int) -> str:
        return self._transports[i]

    def add_connection(self, conn: Connection) -> None:
        self.conns[conn.key] = conn
        if conn.role is Role.ENGINE:
            self.engines[conn.engine_id] = conn
        self.metrics.engines.set(len(self.engines))

    def drop_connection(self, conn: Connection, reason: str) -> None:
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
                self.jobs.wait(min(left, 0.5))

    def unmap_later(self, mapped: MappedPools) -> None:
        """Unmap ``mapped`` now, or as soon as no copy uses it any more."""
        mapped.buffers = None  # type: ignore[assignment]
        with self._unmap_lock:
            self._to_unmap.append(mapped)
            self._to_unmap = [m for m in self._to_unmap if not m.close()]

    def _reap(self, now: float) -> None:
        self._refreeze_if_grown()
        lease = self.config.lease_s
        for conn in list(self.conns.values()):
            if conn.inflight == 0 and now - conn.last_seen > lease:
                if conn.role is Role.ENGINE:
                    self.metrics.lease_expiries.inc()
                    log.warning(
                        "engine %s (pid %d): no heartbeat for %.1fs; lease expired, its pins "
                        "and registration are released",
                        conn.engine_id,
                        conn.pid,
                        now - conn.last_seen,
                    )
                self.drop_connection(conn, "lease expired")
        with self._unmap_lock:
            self._to_unmap = [m for m in self._to_unmap if not m.close()]

    def _shutdown_sockets(self) -> None:
        # After a drain that timed out, a stuck request is abandoned, not waited for.
        self._executor.shutdown(wait=self._inflight == 0, cancel_futures=True)
        self._lane.shutdown(self.config.drain_timeout_s if self._inflight == 0 else 0.0)
        for conn in list(self.conns.values()):
            self.drop_connection(conn, "sidecar stopping")
        with self._push_lock:
            for s in self._push_sockets:
                s.close(linger=0)
            self._push_sockets.clear()
        for r in self._routers:
            r.close(linger=0)
        if self._replies is not None:
            self._replies.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        with contextlib.suppress(OSError):
            self.config.socket.unlink()
        if self.fd_inbox is not None:
            self.fd_inbox.close()
        self._ctx.destroy(linger=0)
        log.info("sockets closed")

    @property
    def inflight(self) -> int:
        return self._inflight


def _as_protocol_error(exc: Exception) -> ProtocolError:
    from hicache.controller.local import ControllerLayoutMismatch

    if isinstance(exc, ProtocolError):
        return exc
    if isinstance(exc, ControllerLayoutMismatch):
        return ProtocolError(ErrorCode.LAYOUT_MISMATCH, str(exc))
    if isinstance(exc, (ControllerError, HicacheError)):
        return ProtocolError(ErrorCode.CONTROLLER_ERROR, str(exc))
    _internal_errors.log(exc)
    return ProtocolError(
        ErrorCode.INTERNAL, f"internal error ({type(exc).__name__}); see the sidecar log"
    )
