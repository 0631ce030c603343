"""Memory file descriptors from engine to sidecar: a Unix socket beside the sidecar's own.

ZeroMQ carries no file descriptors, so an engine whose pools are anonymous shared memory
(a ``memfd``, as SGLang's ``"allocator": "shm"`` host pools are) hands their descriptors
to the sidecar over this side channel with ``SCM_RIGHTS``, then registers the pools over
ZeroMQ naming the **tickets** the sidecar answered: ``{"kind": "memfd", "ticket", "dtype",
"shape", "offset"}`` (device_share.py maps them; docs/protocol.md, "Registration").

* The socket is ``<socket_path>.fd``, created 0600 in the sidecar's private directory.
* A connecting peer's ``SO_PEERCRED`` must show the sidecar's own uid; any other is
  dropped unanswered. One message per connection: up to ``MAX_FDS`` descriptors and no
  payload beyond one byte; the reply is 16 random bytes per descriptor.
* A ticket is redeemed once, only by a registration from the process that sent the
  descriptor (the kernel's pid on both sockets), and expires after ``TICKET_TTL_S``
  unredeemed (its descriptor is closed).
"""

from __future__ import annotations

import array
import logging
import os
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

from hicache.controller.security import PeerCredentials

log = logging.getLogger("hicache.sidecar.fd_pass")

MAX_FDS = 8
TICKET_BYTES = 16
TICKET_TTL_S = 60.0
CONNECT_TIMEOUT_S = 2.0
_UCRED = struct.Struct("3i")  # pid, uid, gid


def fd_socket_path(socket_path: str | os.PathLike) -> Path:
    """The descriptor socket beside the sidecar's socket ``socket_path``."""
    return Path(f"{os.fspath(socket_path)}.fd")


def send_fds(
    path: str | os.PathLike, fds: list[int], timeout_s: float = CONNECT_TIMEOUT_S
) -> list[bytes]:
    """Hand ``fds`` to the sidecar listening at ``path``; returns one ticket per fd.
    Raises OSError when the sidecar is not there or does not answer."""
    if not 1 <= len(fds) <= MAX_FDS:
        raise ValueError(f"send 1..{MAX_FDS} descriptors at once, not {len(fds)}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(os.fspath(path))
        rights = array.array("i", fds).tobytes()
        sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
        want = TICKET_BYTES * len(fds)
        reply = b""
        while len(reply) < want:
            chunk = sock.recv(want - len(reply))
            if not chunk:
                raise OSError("the sidecar closed the descriptor socket without tickets")
            reply += chunk
    return [reply[i : i + TICKET_BYTES] for i in range(0, want, TICKET_BYTES)]


class FdInbox:
    """The sidecar's end: accepts descriptors, keeps them under tickets until redeemed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._held: dict[bytes, tuple[int, int, float]] = {}  # ticket -> (fd, pid, since)
        self._closed = False
        self.path.unlink(missing_ok=True)  # the sidecar's directory: a leftover of a crash
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(os.fspath(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        self._sock.listen(16)
        self._sock.settimeout(0.5)
        self._thread = threading.Thread(target=self._serve, name="hicache-fd-inbox", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                self._expire(time.monotonic())
                continue
            except OSError:
                return
            with conn:
                try:
                    self._receive(conn)
                except OSError as exc:
                    log.warning("descriptor socket: %s", exc)

    def _receive(self, conn: socket.socket) -> None:
        conn.settimeout(CONNECT_TIMEOUT_S)
        pid, uid, _gid = _UCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        if uid != os.geteuid():
            log.warning("descriptor socket: refused pid %d of uid %d (not this user)", pid, uid)
            return
        space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
        _msg, ancillary, flags, _ = conn.recvmsg(1, space)
        fds: list[int] = []
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(data) - len(data) % array.array("i").itemsize
                fds.extend(array.array("i", data[:usable]))
        if flags & socket.MSG_CTRUNC or not fds:
            for fd in fds:
                os.close(fd)
            log.warning("descriptor socket: pid %d sent no or too many descriptors", pid)
            return
        now = time.monotonic()
        tickets = [secrets.token_bytes(TICKET_BYTES) for _ in fds]
        with self._lock:
            for ticket, fd in zip(tickets, fds):
                self._held[ticket] = (fd, pid, now)
        conn.sendall(b"".join(tickets))

    def _expire(self, now: float) -> None:
        with self._lock:
            stale = [t for t, (_, _, since) in self._held.items() if now - since > TICKET_TTL_S]
            for t in stale:
                os.close(self._held.pop(t)[0])

    def take(self, ticket: object, peer: PeerCredentials) -> int | None:
        """The descriptor under ``ticket`` when ``peer`` is the process that sent it (the
        caller owns it then and closes it); None otherwise."""
        if not isinstance(ticket, bytes) or len(ticket) != TICKET_BYTES:
            return None
        with self._lock:
            held = self._held.get(ticket)
            if held is None or held[1] != peer.pid:
                return None
            del self._held[ticket]
        return held[0]

    def close(self) -> None:
        """Stop accepting, close every unredeemed descriptor and remove the socket."""
        self._closed = True
        self._sock.close()
        self._thread.join(timeout=2.0)
        with self._lock:
            for fd, _, _ in self._held.values():
                os.close(fd)
            self._held.clear()
        self.path.unlink(missing_ok=True)
