"""Loads begun on the sidecar's I/O thread: the copy is issued there, and the reply sent
from there once the copy has ended.

A load of pages all on host waits on nothing but its copy. Handing it to a worker costs
two thread switches (to the worker, and back through the reply socket) and a worker
woken cold, which on a GPU host were most of a small load's time through the sidecar
(docs/performance.md). Here the I/O thread checks the request and holds its pages as it
would a pin of the same size (at most ``INLINE_MAX_PAGES`` pages), issues the copy on the
load stream, and goes on serving; each loop turn it asks the copies in flight whether they
have ended (a CUDA event query, which never blocks) and answers those that have. A load
that must first read a page from disk, or one too large, still runs on a worker.

The I/O thread never waits on a copy: while copies are in flight it polls its sockets
without sleeping (``SPIN_S``), then in 1 ms slices, so a copy that takes long costs
little CPU. A CPU engine's copy is a memcpy on the thread that issues it, so only small
ones (``CPU_COPY_MAX_BYTES``) start here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache.controller.wire.protocol import as_protocol_error, error_reply, ok_reply
from hicache.controller.wire.verbs import OkReply
from hicache.controller_api import PinReceipt

if TYPE_CHECKING:
    from collections.abc import Callable

    from hicache.controller.sidecar.metrics import SidecarMetrics
    from hicache.controller.sidecar.sessions import Connection, Sessions
    from hicache.controller.store.local import LocalController
    from hicache.controller.store.page_copies import DeviceLoad
    from hicache.controller.wire.protocol import Request
    from hicache.controller.wire.verbs import LoadArgs, VerbSpec

SPIN_S = 0.05  # a copy in flight is checked without sleeping for this long, then each 1 ms
CPU_COPY_MAX_BYTES = 4 << 20  # a CPU load up to this size copies on the I/O thread


@dataclass
class _InFlight:
    sock: int
    conn: Connection
    spec: VerbSpec
    req: Request
    load: DeviceLoad
    t0: float
    issued: float
    own_pin: PinReceipt | None  # the pin the load took over its own pages, released at its end


class InlineLoads:
    """The loads whose copies the I/O thread issued and has not answered yet."""

    def __init__(
        self,
        controller: LocalController,
        sessions: Sessions,
        metrics: SidecarMetrics,
        send: Callable[[int, bytes, bytes], None],
        pin_for: Callable[[LoadArgs, str], PinReceipt | None],
    ) -> None:
        """``pin_for``: the pin a load runs under (``VerbHandlers.load_pin``)."""
        self.ctl = controller
        self.pin_for = pin_for
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

    def start(
        self, conn: Connection, spec: VerbSpec, req: Request, args: LoadArgs, t0: float
    ) -> bool:
        """Begin the load ``args`` of ``conn`` here; False, with nothing done, when it is
        for a worker (a page on disk only, a CPU copy too large). The reply goes out now
        for a load that fails at once, or once its copy has ended. Raises as
        :meth:`LocalController.load` does (the caller answers with the error)."""
        mapped = conn.mapped
        if mapped.device != "cuda":
            layout = conn.layout
            page_bytes = max(layout.page_bytes(c, conn.page_size) for c in layout.components)
            if len(args.refs) * page_bytes > CPU_COPY_MAX_BYTES:
                return False
        if not self.sessions.job_started(conn):  # fencing counts it as a running job
            return False
        own_pin = None
        try:
            pin = self.pin_for(args, conn.engine_id)
            if pin is None:  # a page is absent: the load fails, nothing was pinned
                load: DeviceLoad | bool | None = False
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
        self.sessions.inflight += 1
        conn.inflight += 1
        if isinstance(load, bool):
            self._release(own_pin, conn)
            self._answer(conn, spec, req, t0, load)
        else:
            now = time.monotonic()
            self._flight.append(_InFlight(conn.sock, conn, spec, req, load, t0, now, own_pin))
        return True

    def _release(self, own_pin: PinReceipt | None, conn: Connection) -> None:
        """Release the pin a load took over its own pages (none: it named one)."""
        if own_pin is not None:
            self.ctl.unpin(own_pin, engine_id=conn.engine_id)

    def reap(self) -> None:
        """Answer every load whose copy has ended."""
        if not self._flight:
            return
        still = []
        for f in self._flight:
            if not f.load.done():
                still.append(f)
                continue
            try:
                ok = f.load.finish()
                self._release(f.own_pin, f.conn)
            except Exception as exc:  # the release failed: the load did not happen
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
