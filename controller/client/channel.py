"""The sidecar connection: one DEALER socket with request ids, its credentials, its
config, and the errors a call can end in. Used by the engine's client
(:mod:`hicache.controller.client.sidecar_client`) and by ``hicachectl``."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from hicache.controller.wire.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    SETTLE_POLL_S,
    ErrorCode,
    ProtocolError,
    Verb,
    encode_request,
    unpack,
)
from hicache.controller.wire.verbs import SPECS
from hicache.controller_api import ControllerError
from hicache.types import ConfigError, LayoutMismatchError

log = logging.getLogger("hicache.sidecar.client")

POLL_SLICE_S = SETTLE_POLL_S  # a waiting thread releases the socket this often


def yield_cpu() -> None:
    """Let a thread waiting for this core run now (``sched_yield``), then go on.

    A parted load (``inflight.split_load``) wakes the sidecar's threads one after another (its
    I/O thread, a worker, its reader) while this engine reads from disk, on a core of its
    own as it seems. After the processes sat idle the kernel often queues a woken thread
    on the core this engine is busy on, where it waits for this thread's time slice: on
    the 2-core development box 2-4 ms a hop, in a 64 MiB load of 9 ms, in most loads
    after a 50 ms pause and in most first loads after a restart, against 0.2-0.4 ms back
    to back. Giving the core away once the sidecar's part is sent, and after each 1 MiB
    read (``disk_share.YIELD_EVERY_BYTES``, about 0.2 ms), holds such a thread up that
    long at most, for a syscall that costs under a microsecond when no thread waits."""
    _sched_yield()


_sched_yield = getattr(os, "sched_yield", lambda: None)


class SidecarUnavailable(ControllerError):
    """The sidecar did not answer in time, or cannot be reached, or the breaker is open."""


class RemoteError(ControllerError):
    """The sidecar answered with an error; ``code`` is its :class:`ErrorCode` value."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class RemoteLayoutMismatch(RemoteError, LayoutMismatchError):
    """The sidecar serves another layout."""


# Errors that no retry can fix: the engine's configuration is wrong.
FATAL_CODES = {
    ErrorCode.LAYOUT_MISMATCH.value,
    ErrorCode.VERSION_MISMATCH.value,
    ErrorCode.REGISTRATION_REFUSED.value,
    ErrorCode.FORBIDDEN.value,
    ErrorCode.BAD_ARGS.value,
}


@dataclass
class SidecarClientConfig:
    """Timeouts, breaker and credentials of a sidecar client (seconds, files)."""

    request_timeout_s: float = 5.0
    lookup_timeout_s: float = 0.25
    backup_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    # A registration may wait for the sidecar to build its tiers at the first one (its host
    # pool allocated and page-locked: about 1.4 s per 4 GiB on an H200 host), so it is
    # given at least this long.
    register_timeout_s: float = 120.0
    load_timeout_margin_s: float = 1.0  # added to a load's own timeout for the round trip
    breaker_failures: int = 3
    reconnect_interval_s: float = 1.0
    heartbeat_interval_s: float | None = None  # None: as the sidecar asks in its handshake
    # The engine's critical-path calls (lookup, pin, load) poll for their reply without
    # sleeping for up to this long (docs/protocol.md): for an engine whose thread waits on
    # them with nothing else of the process running; 0 (the default) sleeps.
    reply_spin_s: float = 0.0
    # pin() sends nothing and the load pins its own pages on arrival, sparing a round trip
    # (docs/protocol.md, "A load that pins its own pages"): for a client whose pins are
    # always followed by a load of those pages from this same client.
    pin_at_load: bool = False
    # Map the sidecar's shared host pages (an ipc:// sidecar whose host_shared is on) and
    # copy load-backs of pages on host here (controller/client/host_share.py).
    engine_copies: bool = True
    # With engine_copies, a CPU engine of a sidecar in another process also reads pages
    # only on disk itself, from the sidecar's LMDB file (controller/client/disk_share.py).
    engine_disk_reads: bool = True
    # With engine_disk_reads, pages of this size (bytes) or more only on disk are read
    # part here, part by the sidecar, side by side (two processes: two cores busy); the
    # smaller ones are read here alone.
    engine_split_read_bytes: int = 64 << 10
    # This engine's prefill rate, tokens per second, sent with its lookups for the
    # sidecar's cost rule (None: not reported; the client's ``prefill_rate`` attribute
    # changes it at run time).
    prefill_tokens_per_s: float | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    tcp_token_file: str | Path | None = None
    curve_server_public_key_file: str | Path | None = None
    curve_client_cert_file: str | Path | None = None  # the client's secret cert

    def __post_init__(self) -> None:
        for name in (
            "request_timeout_s",
            "lookup_timeout_s",
            "backup_timeout_s",
            "connect_timeout_s",
            "register_timeout_s",
            "reconnect_interval_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not self.reply_spin_s >= 0:
            raise ConfigError(f"reply_spin_s must be >= 0 seconds, got {self.reply_spin_s}")
        if self.engine_split_read_bytes < 0:
            raise ConfigError("engine_split_read_bytes must be >= 0")
        if self.breaker_failures < 1:
            raise ConfigError("breaker_failures must be >= 1")


def configure_auth(sock: zmq.Socket, endpoint: str, config: SidecarClientConfig) -> None:
    """Set a DEALER's TCP credentials from ``config`` (Unix sockets need none)."""
    if not endpoint.startswith("tcp://"):
        return
    if config.curve_server_public_key_file and config.curve_client_cert_file:
        import zmq.auth

        server_public, _ = zmq.auth.load_certificate(str(config.curve_server_public_key_file))
        public, secret = zmq.auth.load_certificate(str(config.curve_client_cert_file))
        if secret is None:
            raise ConfigError(f"{config.curve_client_cert_file} holds no secret key")
        sock.curve_serverkey = server_public
        sock.curve_publickey = public
        sock.curve_secretkey = secret
    elif config.tcp_token_file:
        sock.plain_username = b"hicache"
        sock.plain_password = Path(config.tcp_token_file).read_text().strip().encode()
    else:
        raise ConfigError(
            f"{endpoint} is TCP: give tcp_token_file or the CURVE key files; the sidecar "
            "answers nothing to a TCP connection without credentials"
        )


class Channel:
    """One DEALER socket with request ids: several requests may be in flight.

    Thread-safe: the socket is only touched under a lock, and never held while a thread
    blocks. A thread waiting for a reply files whatever replies are there by request id;
    when none is its own, one waiting thread (the *reader*) sleeps on the socket's file
    descriptor without the lock, the others on a condition that every filed reply
    signals. So a request sent by one thread goes out at once while another waits for a
    long one (a backup's reply comes when its copy has ended), where a waiter holding the
    lock through its poll kept every other thread's request back until some reply came.
    """

    def __init__(self, endpoint: str, config: SidecarClientConfig) -> None:
        self.endpoint = endpoint
        self.config = config
        self._ctx = zmq.Context.instance()
        self._lock = threading.RLock()
        self._filed = threading.Condition(self._lock)  # signalled when replies are filed
        self._reading = False  # a thread sleeps on the socket's descriptor (_await_input)
        # What wakes the reader when another thread filed replies (the descriptor is
        # edge-triggered: that thread's use of the socket may have taken its signal).
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._ids = itertools.count(1)
        self._replies: dict[int, dict] = {}
        self._expected: dict[int, Verb] = {}  # requests sent, not yet answered
        self._progress: dict[int, Callable[[int, int], None]] = {}
        self._sock: zmq.Socket | None = None
        self._poller: tuple[zmq.Socket, Any] | None = None  # the reader's, for this socket
        self.generation = 0
        self.last_reply = 0.0

    def reset(self) -> None:
        """A fresh socket; requests in flight on the old one will never be answered."""
        with self._lock:
            self.close()
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a peer that is not connected
            s.setsockopt(zmq.RECONNECT_IVL, 100)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            configure_auth(s, self.endpoint, self.config)
            s.connect(self.endpoint)
            self._sock = s
            self.generation += 1

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
                self._poller = None
            self._replies.clear()
            self._expected.clear()
            self._progress.clear()
            self._wake_reader()
            self._filed.notify_all()

    def send(
        self,
        verb: Verb,
        args: Any,
        ttl_s: float,
        progress: Callable[[int, int], None] | None = None,
        connect_wait_s: float = 0.0,
        reply_wanted: bool = True,
    ) -> int:
        """Send a request (``args``: the verb's argument record); returns its id. Raises
        SidecarUnavailable when it cannot go (no connection to the sidecar within
        ``connect_wait_s``). Without ``reply_wanted`` its reply is dropped on arrival,
        unread (a request whose outcome changes nothing for the sender)."""
        req_id = next(self._ids)
        data = encode_request(req_id, verb, SPECS[verb].encode_args(args), ttl_s)
        with self._lock:
            if self._sock is None:
                self.reset()
            try:
                try:
                    self._sock.send(data, zmq.NOBLOCK)
                except zmq.Again:
                    # With IMMEDIATE, POLLOUT means a connection is up (a fresh socket
                    # connects asynchronously).
                    if not self._sock.poll(int(connect_wait_s * 1000), zmq.POLLOUT):
                        raise
                    self._sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                raise SidecarUnavailable(
                    f"the sidecar at {self.endpoint} is not reachable (is it running?)"
                ) from None
            if reply_wanted:
                self._expected[req_id] = verb
            if progress is not None:
                self._progress[req_id] = progress
            if self._reading:  # the send may have taken the descriptor's signal of a reply
                self._drain()
        return req_id

    def _drain(self) -> int:
        """File every reply that is there, without waiting (the lock held); how many
        were read. Waiting threads are told, the reader woken."""
        if self._sock is None:
            return 0
        read = 0
        try:
            while True:
                try:
                    data = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return read
                read += 1
                self._file(data)
        finally:
            if read:
                self._filed.notify_all()
                if self._reading:
                    self._wake_reader()

    def _wake_reader(self) -> None:
        with contextlib.suppress(OSError):  # full (the reader is being woken already)
            self._wake_w.send(b"\0")

    def _await_input(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for replies (the lock held, and released meanwhile):
        as the reader, on the socket's descriptor, unless another thread is; then on the
        condition that filed replies signal. The caller drains after it."""
        sock = self._sock
        if self._reading or sock is None:
            self._filed.wait(timeout_s)
            return
        self._reading = True
        try:
            # Input there already does not signal the descriptor again: take it first.
            if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            if self._poller is None or self._poller[0] is not sock:
                poller = select.poll()  # no descriptor-number limit, unlike select()
                poller.register(sock.getsockopt(zmq.FD), select.POLLIN)
                poller.register(self._wake_r, select.POLLIN)
                self._poller = (sock, poller)
            poller = self._poller[1]
            saved = self._lock._release_save()  # wholly, as Condition.wait does
            try:
                poller.poll(max(1, math.ceil(timeout_s * 1000)))
            except OSError:  # interrupted, or the socket closed meanwhile
                pass
            finally:
                self._lock._acquire_restore(saved)
            with contextlib.suppress(OSError):  # empty
                while self._wake_r.recv(64):
                    pass
        finally:
            self._reading = False
            self._filed.notify_all()  # another waiter may read now

    def wait_input(self, timeout_s: float) -> None:
        """File the replies there; when there were none, wait up to ``timeout_s`` for
        some (or for another thread to file some) and file them."""
        with self._lock:
            if not self._drain():
                self._await_input(timeout_s)
                self._drain()

    def _file(self, data: bytes) -> None:
        """File one reply by its request id (one that is not expected is dropped)."""
        try:
            msg = unpack(data, self.config.max_message_bytes)
            req_id = msg.get("id")
        except Exception:
            log.warning("undecodable reply from the sidecar dropped")
            return
        self.last_reply = time.monotonic()
        if "progress" in msg:
            cb = self._progress.get(req_id)
            p = msg["progress"]
            if cb is not None and isinstance(p, dict):
                cb(int(p.get("done", 0)), int(p.get("total", 0)))
        elif req_id in self._expected:
            msg["verb"] = self._expected.pop(req_id)
            self._progress.pop(req_id, None)
            self._replies[req_id] = msg
        # else: the reply to a request given up on; dropped

    def poll(self, req_id: int) -> dict | None:
        """The reply to ``req_id`` if it has come (never blocks)."""
        with self._lock:
            if req_id not in self._replies:
                self._drain()
            return self._replies.pop(req_id, None)

    def arrived(self, req_id: int) -> bool:
        """Whether the reply to ``req_id`` has come (read in, still to be taken)."""
        with self._lock:
            if req_id not in self._replies:
                self._drain()
            return req_id in self._replies

    def forget(self, req_id: int) -> None:
        with self._lock:
            self._expected.pop(req_id, None)
            self._progress.pop(req_id, None)
            self._replies.pop(req_id, None)

    def wait(self, req_id: int, timeout_s: float, forget: bool = True, spin_s: float = 0.0) -> Any:
        """The result record of ``req_id``; raises RemoteError for an error reply and
        SidecarUnavailable when none came within ``timeout_s`` (after which a late reply
        is still filed for :meth:`poll` unless ``forget``). For the first ``spin_s`` the
        socket is polled without sleeping: a caller that blocks on the reply anyway
        spares itself the wake-up of a sleeping thread, which on an idle host costs tens
        of microseconds per call."""
        now = time.monotonic()
        end, spin_end = now + timeout_s, now + spin_s
        with self._lock:
            while True:
                msg = self._replies.pop(req_id, None)
                if msg is None:
                    self._drain()
                    msg = self._replies.pop(req_id, None)
                if msg is not None:
                    break
                now = time.monotonic()
                if now >= end or req_id not in self._expected:
                    if forget or req_id not in self._expected:
                        self.forget(req_id)
                    raise SidecarUnavailable(
                        f"no reply from the sidecar at {self.endpoint} within {timeout_s:.3f}s"
                    )
                if now < spin_end:  # polled again at once, the lock let go in between
                    saved = self._lock._release_save()
                    self._lock._acquire_restore(saved)
                    continue
                self._await_input(min(end - now, POLL_SLICE_S))
        return result_of(msg)

    def call(
        self,
        verb: Verb,
        args: Any,
        timeout_s: float,
        progress: Callable[[int, int], None] | None = None,
        connect_wait_s: float = 0.0,
        spin_s: float = 0.0,
    ) -> Any:
        """Send and wait (``timeout_s`` counts from the send; ``spin_s`` as in :meth:`wait`)."""
        rid = self.send(verb, args, timeout_s, progress, connect_wait_s)
        return self.wait(rid, timeout_s, spin_s=spin_s)


def result_of(msg: dict) -> Any:
    """A reply's result, as the record of the verb it answers (a map for an open
    document); raises RemoteError for an error reply or one that is not what the verb
    answers."""
    if msg.get("ok") is True:
        try:
            return SPECS[msg["verb"]].decode_reply(msg.get("result"))
        except ProtocolError as exc:
            raise RemoteError(exc.code.value, exc.message) from None
    err = msg.get("error") if isinstance(msg.get("error"), dict) else {}
    code, message = str(err.get("code", "internal")), str(err.get("message", "no message"))
    if code == ErrorCode.LAYOUT_MISMATCH.value:
        raise RemoteLayoutMismatch(code, message)
    raise RemoteError(code, message)
