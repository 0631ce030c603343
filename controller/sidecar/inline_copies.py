"""Copies begun on the sidecar's I/O thread: the copy is issued there, and the reply sent
from there once the copy has ended.

A load of pages all on host, or a small backup, waits on nothing but its copy. Handing it
to a worker costs two thread switches (to the worker, and back through the reply socket)
and a worker woken cold, which on a GPU host were most of a small load's or backup's time
through the sidecar (docs/performance.md). Here the I/O thread checks the request, holds
its pages (a load: as it would a pin of the same size, at most ``INLINE_MAX_PAGES``; a
backup: books host pages for at most ``BACKUP_MAX_PAGES``), issues the copy on the load or
backup stream, and goes on serving; each loop turn it asks the copies in flight whether
they have ended (a CUDA event query, which never blocks; a backup's ended parts are
published then) and answers those that have. A load that must first read a page from
disk, a backup whose acknowledgement waits on the disk writer (``backup_ack=disk``), and
larger ones still run on a worker.

The I/O thread never waits on a copy: while copies are in flight it polls its sockets
without sleeping (``SPIN_S``), then in 1 ms slices, so a copy that takes long costs
little CPU. A CPU engine's copy is a memcpy on the thread that issues it, so only small
ones (``CPU_COPY_MAX_BYTES``) start here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicache.controller.config import BackupAck
from hicache.controller.wire.protocol import Verb, as_protocol_error, error_reply, ok_reply
from hicache.controller.wire.verbs import OkReply
from hicache.controller_api import PinReceipt

if TYPE_CHECKING:
    from collections.abc import Callable

    from hicache.controller.sidecar.handlers import VerbHandlers
    from hicache.controller.sidecar.metrics import SidecarMetrics
    from hicache.controller.sidecar.sessions import Connection, Sessions
    from hicache.controller.store.local import LocalController
    from hicache.controller.wire.protocol import Request
    from hicache.controller.wire.verbs import BackupArgs, LoadArgs, VerbSpec

log = logging.getLogger(__name__)

SPIN_S = 0.05  # a copy in flight is checked without sleeping for this long, then each 1 ms
CPU_COPY_MAX_BYTES = 4 << 20  # a CPU copy up to this size runs on the I/O thread
# A backup of more pages goes to a worker: booking its host pages would hold the I/O
# thread (and every engine's lookups) longer than handing it over costs.
BACKUP_MAX_PAGES = 256


class _Backup:
    """A backup issued here, as the I/O thread asks after it: :meth:`done` publishes
    the parts whose copies ended (never blocking); :meth:`finish` is the reply a worker
    would give, False for one that ended past the request's deadline. A device error
    seen while asking ends it: :meth:`finish` raises it, and the engine gets it as the
    error reply a worker's wait would have given."""

    def __init__(self, handle: Any, deadline: float) -> None:
        self.handle = handle
        self.deadline = deadline
        self._error: Exception | None = None

    def done(self) -> bool:
        if self._error is not None:
            return True
        try:
            return self.handle.done()
        except Exception as exc:  # an event's query raised: the I/O thread serves on
            log.error("a backup's copy failed: %s", exc)
            self._error = exc
            return True

    def finish(self) -> bool:
        if self._error is not None:
            raise self._error
        if time.monotonic() > self.deadline:
            return False
        return bool(self.handle.wait(0.0))


@dataclass
class _InFlight:
    sock: int
    conn: Connection
    spec: VerbSpec
    req: Request
    copy: Any  # a DeviceLoad or a _Backup: done() never blocks, finish() -> ok
    t0: float
    issued: float
    own_pin: PinReceipt | None  # the pin a load took over its own pages, released at its end


class InlineCopies:
    """The loads and backups whose copies the I/O thread issued and has not answered yet."""

    def __init__(
        self,
        controller: LocalController,
        sessions: Sessions,
        metrics: SidecarMetrics,
        send: Callable[[int, bytes, bytes], None],
        verbs: VerbHandlers,
    ) -> None:
        """``verbs``: the handlers whose checks these copies share (a load's pin, a
        backup's event) and the sidecar's settings."""
        self.ctl = controller
        self.verbs = verbs
        self.sessions = sessions
        self.metrics = metrics
        self._send = send  # (router index, routing id, payload): the server's reply path
        self._flight: list[_InFlight] = []

    def __len__(self) -> int:
        return len(self._flight)

    def poll_ms(self, idle_ms: int) -> int:
        """How long the I/O loop may block in its next poll."""
        if not self._flight:
            return idle_ms
        return 0 if time.monotonic() - self._flight[0].issued < SPIN_S else 1

    def start(self, conn: Connection, spec: VerbSpec, req: Request, args: Any, t0: float) -> bool:
        """Begin the load or backup ``args`` of ``conn`` here; False, with nothing done,
        when it is for a worker (see the module). The reply goes out now for a load that
        fails at once, or once its copy has ended. Raises as the worker's handler would
        (the caller answers with the error)."""
        if spec.verb is Verb.BACKUP:
            return self._start_backup(conn, spec, req, args, t0)
        return self._start_load(conn, spec, req, args, t0)

    def _too_large_for_cpu(self, conn: Connection, pages: int) -> bool:
        if conn.mapped.device == "cuda":
            return False
        layout = conn.layout
        page_bytes = max(layout.page_bytes(c, conn.page_size) for c in layout.components)
        return pages * page_bytes > CPU_COPY_MAX_BYTES

    def _start_backup(
        self, conn: Connection, spec: VerbSpec, req: Request, args: BackupArgs, t0: float
    ) -> bool:
        config = self.verbs.config
        if (
            config.backup_ack is not BackupAck.HOST  # its reply waits on the disk writer
            or len(args.refs) > BACKUP_MAX_PAGES
            or self._too_large_for_cpu(conn, len(args.refs))
        ):
            return False
        event = self.verbs.backup_event(conn, args)
        if not self.sessions.job_started(conn):  # fencing counts it as a running job
            return False
        try:
            handle = self.ctl.backup(args.refs, event, engine_id=conn.engine_id, tenant=args.tenant)
        except BaseException:
            self.sessions.job_ended(conn)
            raise
        deadline = t0 + min(req.ttl_s, config.max_request_ttl_s)
        self._fly(conn, spec, req, _Backup(handle, deadline), t0, None)
        return True

    def _start_load(
        self, conn: Connection, spec: VerbSpec, req: Request, args: LoadArgs, t0: float
    ) -> bool:
        if self._too_large_for_cpu(conn, len(args.refs)):
            return False
        if not self.sessions.job_started(conn):  # fencing counts it as a running job
            return False
        own_pin = None
        try:
            pin = self.verbs.load_pin(args, conn.engine_id)
            if pin is None:  # a page is absent: the load fails, nothing was pinned
                load: Any = False
            else:
                own_pin = pin if args.pin_id is None else None
                load = self.ctl.start_load(args.refs, pin, engine_id=conn.engine_id)
        except BaseException:
            self._release(own_pin, conn)
            self.sessions.job_ended(conn)
            raise
        if load is None:  # a page to read from disk first: a worker's job
            self._release(own_pin, conn)
            self.sessions.job_ended(conn)
            return False
        if isinstance(load, bool):
            self.sessions.inflight += 1
            conn.inflight += 1
            self._release(own_pin, conn)
            self._answer(conn, spec, req, t0, load)
        else:
            self._fly(conn, spec, req, load, t0, own_pin)
        return True

    def _fly(
        self, conn: Connection, spec: VerbSpec, req: Request, copy: Any, t0: float,
        own_pin: PinReceipt | None,
    ) -> None:  # fmt: skip
        """Count ``copy`` in flight until :meth:`reap` answers it."""
        self.sessions.inflight += 1
        conn.inflight += 1
        now = time.monotonic()
        self._flight.append(_InFlight(conn.sock, conn, spec, req, copy, t0, now, own_pin))

    def _release(self, own_pin: PinReceipt | None, conn: Connection) -> None:
        """Release the pin a load took over its own pages (none: it named one)."""
        if own_pin is not None:
            self.ctl.unpin(own_pin, engine_id=conn.engine_id)

    def reap(self) -> None:
        """Answer every copy that has ended."""
        if not self._flight:
            return
        still = []
        for f in self._flight:
            if not f.copy.done():
                still.append(f)
                continue
            try:
                ok = f.copy.finish()
                self._release(f.own_pin, f.conn)
            except Exception as exc:  # a failed release or copy: the transfer did not happen
                self._reply_error(f, exc)
                continue
            self._answer(f.conn, f.spec, f.req, f.t0, ok)
        self._flight = still

    def _answer(self, conn: Connection, spec: VerbSpec, req: Request, t0: float, ok: bool):
        payload = ok_reply(req.id, spec.encode_reply(OkReply(ok)))
        self._ended(conn, req, t0, payload)

    def _reply_error(self, f: _InFlight, exc: Exception) -> None:
        perr = as_protocol_error(exc)
        self.metrics.failures.labels(f.req.verb.value, perr.code.value).inc()
        self._ended(f.conn, f.req, f.t0, error_reply(f.req.id, perr.code, perr.message))

    def _ended(self, conn: Connection, req: Request, t0: float, payload: bytes) -> None:
        self.sessions.job_ended(conn)
        self.sessions.inflight -= 1
        conn.inflight -= 1
        conn.last_seen = time.monotonic()
        self.metrics.latency.labels(req.verb.value).observe(time.monotonic() - t0)
        self._send(conn.sock, conn.routing_id, payload)
