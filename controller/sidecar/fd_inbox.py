"""The sidecar's end of the descriptor socket: receives engines' memory descriptors under
tickets, and hands out the host pages' descriptors (the engine's end, and the socket's
rules, are in :mod:`hicache.controller.client.fd_pass`)."""

from __future__ import annotations

import array
import logging
import math
import mmap
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hicache.controller.client.fd_pass import (
    CONNECT_TIMEOUT_S,
    MAX_FDS,
    PEER_CREDENTIALS,
    TICKET_BYTES,
    TICKET_TTL_S,
)
from hicache.controller.wire.security import PeerCredentials

log = logging.getLogger("hicache.sidecar.fd_pass")


# What the sidecar answers a request for its host pages: (description, descriptors) or
# None when its pages are not shared.
HostShareSource = Callable[[], "tuple[bytes, list[int]] | None"]


class FdInbox:
    """The sidecar's end: accepts descriptors, keeps them under tickets until redeemed,
    and hands out its host pages' descriptors (``host_share``)."""

    def __init__(self, path: Path, host_share: HostShareSource | None = None) -> None:
        self.path = path
        self.host_share = host_share
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
        pid, uid, _gid = PEER_CREDENTIALS.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size)
        )
        if uid != os.geteuid():
            log.warning("descriptor socket: refused pid %d of uid %d (not this user)", pid, uid)
            return
        space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
        msg, ancillary, flags, _ = conn.recvmsg(1, space)
        if msg == b"H" and not ancillary:
            self._send_host_share(conn)
            return
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

    def _send_host_share(self, conn: socket.socket) -> None:
        try:
            share = None if self.host_share is None else self.host_share()
        except Exception as exc:  # never the inbox's end: this engine loads through ZeroMQ
            log.error("describing the shared host pages failed: %s", exc)
            share = None
        if share is None:
            conn.sendall((0).to_bytes(4, "big"))
            return
        header, fds = share
        payload = len(header).to_bytes(4, "big") + header
        rights = array.array("i", fds).tobytes()
        sent = conn.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
        if sent < len(payload):
            conn.sendall(payload[sent:])

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

    def map_descriptor(
        self,
        ticket: object,
        peer: PeerCredentials,
        dtype: torch.dtype,
        shape: list[int],
        offset: object,
    ) -> tuple[torch.Tensor, mmap.mmap]:
        """The memory under ``ticket`` as a ``dtype`` tensor of ``shape`` from byte
        ``offset``, and its mapping (closed by the caller once no tensor uses it). Raises
        ValueError saying what is wrong: a ticket that is not ``peer``'s, memory of
        another user, or too small."""
        if type(offset) is not int or offset < 0 or offset % dtype.itemsize:
            raise ValueError(f"a memfd buffer's offset must be a whole number of {dtype}")
        fd = self.take(ticket, peer)
        if fd is None:
            raise ValueError(
                "unknown, expired or foreign descriptor ticket: the registering process must "
                "hand its descriptor to the sidecar's descriptor socket first"
            )
        try:
            st = os.fstat(fd)
            nbytes = math.prod(shape) * dtype.itemsize
            if st.st_uid != peer.uid:
                raise ValueError("the descriptor's memory belongs to another user")
            if offset + nbytes > st.st_size or st.st_size == 0:
                raise ValueError(
                    f"the descriptor's memory holds {st.st_size} bytes, fewer than the "
                    f"{offset + nbytes} its offset and shape {shape} need"
                )
            mapping = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        # Through NumPy, whose array holds an export of the mapping while a tensor lives:
        # closing the mapping then fails (BufferError) instead of unmapping under a copy.
        raw = np.frombuffer(mapping, dtype=np.uint8, count=max(nbytes, 1), offset=offset)
        return torch.from_numpy(raw)[:nbytes].view(dtype).view(shape), mapping

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
