"""The sidecar's ZeroMQ server: a ROUTER socket in front of a :class:`LocalController`.

Layers: :mod:`~hicache.controller.wire.security` (the private socket directory, the admin
token, TCP authentication, peer credentials), :mod:`~hicache.controller.sidecar.sessions` (the
connections, engines, leases, fencing and unmapping), :mod:`~hicache.controller.
sidecar.handlers` (what each verb does) and this module: the loop and the dispatch.

Threading model
---------------
* **The I/O thread** (:meth:`SidecarServer.serve`) owns every ZeroMQ socket. It decodes
  each message, checks it against the verb's spec (:mod:`~hicache.controller.
  wire.verbs`: who may send it, whether it needs a registration, its arguments), keeps
  the sessions, answers the cheap verbs itself and hands the rest on. Nothing it does
  waits on a copy or a disk read, so a lookup is answered while loads and backups run.
* **Workers** (a thread pool) run register, backup, load, prefetch and the long admin
  verbs, and pass their replies back through an inproc socket. A small load of pages all
  on host and a small backup are the exception: the I/O thread issues the copy and answers
  once it has ended, never waiting on it (:mod:`~hicache.controller.sidecar.inline_copies`).
* **The lane** (:mod:`~hicache.controller.sidecar.fair_lane`) runs lookups and pins too large
  for the I/O thread, one engine's request after another's.

Anything malformed is answered with an error reply and changes nothing (see
:mod:`hicache.controller.wire.protocol` for the codes); only a message past four times
``max_message_bytes`` is dropped unread by ZeroMQ itself, with its connection.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import zmq

from hicache.controller.client.fd_pass import fd_socket_path
from hicache.controller.sidecar import host_share
from hicache.controller.sidecar.admin_verbs import Call
from hicache.controller.sidecar.config import SidecarConfig
from hicache.controller.sidecar.fair_lane import FairLane
from hicache.controller.sidecar.fd_inbox import FdInbox
from hicache.controller.sidecar.handlers import VerbHandlers
from hicache.controller.sidecar.inline_copies import InlineCopies
from hicache.controller.sidecar.metrics import SidecarMetrics
from hicache.controller.sidecar.prestart import prestart
from hicache.controller.sidecar.sessions import Connection, ServedLayout, Sessions
from hicache.controller.wire.protocol import (
    ErrorCode,
    ProtocolError,
    Request,
    Verb,
    as_protocol_error,
    decode_request,
    error_reply,
    ok_reply,
    progress_reply,
)
from hicache.controller.wire.security import (
    SidecarError,
    load_admin_token,
    peer_credentials,
    private_dir,
    secure_tcp,
)
from hicache.controller.wire.verbs import ADMIN, SPECS, Place, VerbSpec

if TYPE_CHECKING:
    from hicache.controller.store.local import LocalController
    from hicache.layout import ModelLayout

__all__ = ["Connection", "SidecarError", "SidecarServer"]

log = logging.getLogger("hicache.sidecar")

_REPLY = b"R"
_PROGRESS = b"P"
_REFREEZE_MIN_ENTRIES = 100_000  # index growth that earns another gc.freeze()
_MAX_BATCH = 256  # messages read per socket per loop turn, so no socket starves another
_POLL_MS = 100
# libzmq drops (with the connection) any frame past this multiple of max_message_bytes;
# below it the sidecar reads the message and answers TOO_LARGE itself.
_HARD_LIMIT_FACTOR = 4


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
        self.metrics = metrics or SidecarMetrics(lambda: self.verbs.metrics_snapshot())
        served = None
        if layout is not None:
            served = ServedLayout(layout[0], layout[1], layout[0].fingerprint(layout[1]))
        self.sessions = Sessions(controller, self.metrics, served)
        self.endpoints: list[str] = []
        self.verbs = VerbHandlers(
            self.sessions,
            controller,
            self.config,
            self.metrics,
            self.endpoints,
            self.freeze_long_lived,
        )
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
        self._inline = InlineCopies(controller, self.sessions, self.metrics, self._send, self.verbs)
        self._last_reap = 0.0

    @property
    def admin_token(self) -> bytes:
        return self.verbs.admin_token

    @property
    def inflight(self) -> int:
        return self.sessions.inflight

    # -- binding -------------------------------------------------------------------------

    def _router(self) -> zmq.Socket:
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, _HARD_LIMIT_FACTOR * self.config.max_message_bytes)
        s.setsockopt(zmq.RCVHWM, 10_000)
        s.setsockopt(zmq.SNDHWM, 10_000)
        return s

    def _bind_ipc(self) -> str:
        path = self.config.socket
        private_dir(path.parent, "socket_path")
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
        router = self._router()
        self._auth = secure_tcp(self._ctx, router, self.config)
        router.bind(self.config.tcp_endpoint)
        self._routers.append(router)
        self._transports.append("tcp")
        return router.getsockopt_string(zmq.LAST_ENDPOINT)

    def bind(self) -> list[str]:
        """Create and bind the sockets; returns the endpoints served."""
        path = self.config.admin_token_path
        beside_socket = path.parent == self.config.socket.parent
        setting = "socket_path" if beside_socket else "admin_token_file"
        self.verbs.admin_token = load_admin_token(path, setting)
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._replies.bind(self._reply_addr)
        prestart(self._executor, self.config.worker_threads, self._lane, self._push_socket)
        self.endpoints.append(self._bind_ipc())
        ctl = self.verbs.ctl
        self.verbs.fd_inbox = FdInbox(
            fd_socket_path(self.config.socket), host_share=lambda: host_share.describe(ctl)
        )
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
        self.frozen_at_entries = self.controller.store.indexed_pages()
        log.info("%d long-lived objects left out of garbage collection", gc.get_freeze_count())

    def _refreeze_if_grown(self) -> None:
        """Freeze again once the index has grown by half (and by ``_REFREEZE_MIN_ENTRIES``)
        since the last freeze: a sidecar that started empty and filled its disk would
        otherwise be back to collections that scan most of its index."""
        if self.frozen_at_entries < 0:
            return
        n = self.controller.store.indexed_pages()
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
        sessions = self.sessions
        while True:
            if self._stop.is_set() and drain_deadline is None:
                sessions.stopping = True
                drain_deadline = time.monotonic() + self.config.drain_timeout_s
                log.info("stopping: %d requests in flight to finish", sessions.inflight)
            if drain_deadline is not None:
                if sessions.inflight == 0:
                    break
                if time.monotonic() > drain_deadline:
                    log.error("drain timed out with %d requests in flight", sessions.inflight)
                    break
            events = dict(poller.poll(self._inline.poll_ms(_POLL_MS)))
            for i, r in enumerate(self._routers):
                if r in events:
                    self._read_router(i, r)
            if self._replies in events:
                self._read_replies()
            self._inline.reap()
            now = time.monotonic()
            if now - self._last_reap > min(1.0, self.config.lease_s / 4):
                self._last_reap = now
                self._refreeze_if_grown()
                sessions.reap(now, self.config.lease_s)
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
                self.sessions.inflight -= 1
                conn = self.sessions.conns.get((i, rid))
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
            error = ProtocolError(ErrorCode.BAD_MESSAGE, "a request is exactly one frame")
            self._reject(i, rid, None, "invalid", error)
            return
        try:
            req = decode_request(frames[1].bytes, self.config.max_message_bytes)
        except ProtocolError as exc:
            self._reject(i, rid, getattr(exc, "request_id", None), "invalid", exc)
            return
        verb = req.verb.value
        self.metrics.requests.labels(verb).inc()
        peer = peer_credentials(frames[1]) if self._transports[i] == "ipc" else None
        conn = self.sessions.find((i, rid), peer)
        if conn is not None:
            conn.last_seen = t0
            conn.requests += 1
        spec = SPECS[req.verb]
        try:
            self._check_allowed(conn, spec)
            deadline = t0 + min(req.ttl_s, self.config.max_request_ttl_s)
            if req.verb is Verb.HELLO:
                args = spec.decode_args(req.args)
                reply = self.verbs.hello((i, rid), self._transports[i], peer, args, t0)
            else:
                place = spec.place(req.args, self.verbs.remote_tier)
                if place is Place.IO:
                    args = spec.decode_args(req.args)
                    call = Call(conn, req, deadline, _no_progress)
                    reply = self.verbs.handlers[req.verb](call, args)
                elif place is Place.INLINE_COPY and self._start_inline(conn, spec, req, t0):
                    return  # answered once its copy has ended (inline_copies.py)
                else:
                    self._dispatch(conn, spec, req, deadline, t0, place)
                    return
            result = spec.encode_reply(reply)
        except ProtocolError as exc:
            self._reject(i, rid, req.id, verb, exc)
            return
        except Exception as exc:
            self._reject(i, rid, req.id, verb, as_protocol_error(exc))
            return
        self._send(i, rid, ok_reply(req.id, result))
        self.metrics.latency.labels(verb).observe(time.monotonic() - t0)

    def _check_allowed(self, conn: Connection | None, spec: VerbSpec) -> None:
        verb = spec.verb
        if self.sessions.stopping:
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down")
        if verb is Verb.HELLO:
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
        if conn.role not in spec.roles:
            kind, other = ("an admin", "engine") if spec.roles == ADMIN else ("an engine", "admin")
            raise ProtocolError(
                ErrorCode.FORBIDDEN,
                f"{verb.value} is {kind} verb; {other} connections may not use it",
            )
        if spec.needs_registration and conn.mapped is None:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER,
                f"{verb.value} before register: register the engine's device pools first",
            )

    def _check_capacity(self) -> None:
        inflight = self.sessions.inflight
        if inflight >= self.config.max_inflight_requests:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"{inflight} requests in flight (max_inflight_requests); retry later",
            )

    def _start_inline(self, conn: Connection, spec: VerbSpec, req: Request, t0: float) -> bool:
        """Begin a small load on this thread when its pages are all on host; False: it
        goes to a worker."""
        self._check_capacity()
        return self._inline.start(conn, spec, req, spec.decode_args(req.args), t0)

    def _dispatch(
        self,
        conn: Connection,
        spec: VerbSpec,
        req: Request,
        deadline: float,
        t0: float,
        place: Place,
    ) -> None:
        sessions = self.sessions
        self._check_capacity()
        sessions.inflight += 1
        conn.inflight += 1
        if place is Place.LANE:
            # A large lookup or pin: on the lane, one engine's request after another's.
            self._lane.submit(conn.engine_id, lambda: self._run_job(conn, spec, req, deadline, t0))
        else:
            self._executor.submit(self._run_job, conn, spec, req, deadline, t0)

    # -- workers -------------------------------------------------------------------------

    def _push(self, frames: list[bytes]) -> None:
        self._push_socket().send_multipart(frames)

    def _push_socket(self) -> zmq.Socket:  # this thread's, opened at its first use
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(self._reply_addr)
            self._local.push = sock
            with self._push_lock:
                self._push_sockets.append(sock)
        return sock

    def _run_job(
        self, conn: Connection, spec: VerbSpec, req: Request, deadline: float, t0: float
    ) -> None:
        verb = req.verb.value

        def progress(done: int, total: int) -> None:
            reply = progress_reply(req.id, done, total)
            self._push([_PROGRESS, bytes((conn.sock,)), conn.routing_id, reply])

        started = self.sessions.job_started(conn)
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
            args = spec.decode_args(req.args)
            reply = self.verbs.handlers[req.verb](Call(conn, req, deadline, progress), args)
            payload = ok_reply(req.id, spec.encode_reply(reply))
        except Exception as exc:
            perr = exc if isinstance(exc, ProtocolError) else as_protocol_error(exc)
            self.metrics.failures.labels(verb, perr.code.value).inc()
            payload = error_reply(req.id, perr.code, perr.message)
        finally:
            if started:
                self.sessions.job_ended(conn)
        self.metrics.latency.labels(verb).observe(time.monotonic() - t0)
        self._push([_REPLY, bytes((conn.sock,)), conn.routing_id, payload])

    # -- stopping ------------------------------------------------------------------------

    def _shutdown_sockets(self) -> None:
        # After a drain that timed out, a stuck request is abandoned, not waited for.
        drained = self.sessions.inflight == 0
        self._executor.shutdown(wait=drained, cancel_futures=True)
        self._lane.shutdown(self.config.drain_timeout_s if drained else 0.0)
        self.sessions.drop_all("sidecar stopping")
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
        if self.verbs.fd_inbox is not None:
            self.verbs.fd_inbox.close()
        self._ctx.destroy(linger=0)
        log.info("sockets closed")


def _no_progress(done: int, total: int) -> None:
    """Verbs answered on the I/O thread report no progress: they are short."""
