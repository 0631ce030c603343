"""Memory file descriptors between engine and sidecar (engine half): a Unix socket beside
the sidecar's own. The sidecar's end is :mod:`hicache.controller.sidecar.fd_inbox`.

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

The other way, an engine asks for the sidecar's **host pages** (``b"H"``, no
descriptor): the reply is a 4-byte big-endian length, a msgpack map that describes them
(controller/client/host_share.py) and their memfd descriptors, which the engine maps read-only
to copy its load-backs itself. A sidecar whose pages are not shared answers a length of 0.
"""

from __future__ import annotations

import array
import logging
import os
import socket
import struct
from pathlib import Path

log = logging.getLogger("hicache.sidecar.fd_pass")

MAX_FDS = 8
TICKET_BYTES = 16
TICKET_TTL_S = 60.0
CONNECT_TIMEOUT_S = 2.0
PEER_CREDENTIALS = struct.Struct("3i")  # pid, uid, gid


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


def receive_fds(
    path: str | os.PathLike, timeout_s: float = CONNECT_TIMEOUT_S
) -> tuple[bytes, list[int]]:
    """The sidecar's host-page description and descriptors (the caller owns and closes
    them); ``(b"", [])`` when it shares none. Raises OSError when the sidecar is not there
    or answers short."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(os.fspath(path))
        sock.sendall(b"H")
        space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
        data, ancillary, flags, _ = sock.recvmsg(1 << 16, space)
        fds: list[int] = []
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", raw[: len(raw) - len(raw) % 4]))
        try:
            if flags & socket.MSG_CTRUNC or len(data) < 4:
                raise OSError("the sidecar's host-page reply was cut short")
            want = 4 + int.from_bytes(data[:4], "big")
            while len(data) < want:
                chunk = sock.recv(want - len(data))
                if not chunk:
                    raise OSError("the sidecar closed the descriptor socket mid-reply")
                data += chunk
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
    return data[4:want], fds
