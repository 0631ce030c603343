"""What the sidecar does for each verb: argument checks, then the controller call.

Handlers either run on the I/O thread (``inline``: they never wait on a copy or a disk
read) or on a worker (``workers``: they receive the request's deadline and never wait past
it). Every argument is checked before anything changes, so a bad request changes nothing.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache import __version__
from hicache.controller import admin_ops
from hicache.controller.device_share import RegistrationRefused, map_pools, open_ready_event
from hicache.controller.fair_lane import yield_to_io
from hicache.controller.protocol import (
    INLINE_MAX_PAGES,
    MAX_LOOKUP_HASHES,
    MAX_PIN_KEYS,
    PROTOCOL_VERSION,
    WORK_CHUNK_PAGES,
    Args,
    ErrorCode,
    ProtocolError,
    Request,
    Role,
    Verb,
    decode_component_list,
    decode_hashes,
    decode_keys,
    decode_layout,
    decode_refs,
    hash_column,
    page_count,
)
from hicache.controller.remote_sidecar import remote_status, verbs_on_workers
from hicache.controller.security import PeerCredentials
from hicache.controller.sidecar_config import BackupAck
from hicache.controller_api import PinReceipt
from hicache.keys import HASH_BYTES
from hicache.types import ComponentType, Tier

if TYPE_CHECKING:
    from hicache.controller.server import Connection, SidecarServer

log = logging.getLogger("hicache.sidecar")

_ENGINE_ID_CHARS = 200
_MAX_PIN_TTL_S = 86_400.0
_TIERS = {"host": Tier.HOST, "disk": Tier.DISK}
_COMPONENTS = {c.name.lower(): c for c in ComponentType}


_SETTLE_POLL_S = 0.05
_SETTLE_REPORT_S = 60.0  # a device copy still running is reported this often


def _ttl(a: Args, name: str = "ttl_s") -> float:
    return a.float(name, 0.001, _MAX_PIN_TTL_S)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ProtocolError(ErrorCode.DEADLINE_EXCEEDED, "the request's deadline passed")
    return left


class VerbHandlers:
    """The verbs of one :class:`SidecarServer`."""

    def __init__(self, server: SidecarServer) -> None:
        self.server = server
        self.ctl = server.controller
        self.inline = {
            Verb.HEARTBEAT: self.heartbeat,
            Verb.LOOKUP: self.lookup,
            Verb.PIN: self.pin,
            Verb.UNPIN: self.unpin,
            Verb.STATS: self.stats,
            Verb.BYE: self.bye,
            Verb.HEALTH: self.health,
            Verb.STATUS: self.status,
            Verb.ENGINES: self.engines,
            Verb.UNPIN_PREFIX: self.unpin_prefix,
        }
        self.workers = {
            Verb.REGISTER: self.register,
            Verb.BACKUP: self.backup,
            Verb.LOAD: self.load,
            Verb.PREFETCH: self.prefetch,
            Verb.CLEAR: self.clear,
            Verb.EVICT: self.evict,
            Verb.PIN_PREFIX: self.pin_prefix,
            Verb.FSCK: self.fsck,
        }
        if self.ctl.config.remote_enabled:
            verbs_on_workers(self)
        self.admin_allowed = frozenset(
            {Verb.HEARTBEAT, Verb.STATS, Verb.HEALTH, Verb.BYE} | {v for v in Verb if v.admin}
        )

    # -- handshake -----------------------------------------------------------------------

    def hello(
        self,
        sock: int,
        routing_id: bytes,
        req: Request,
        now: float,
        peer: PeerCredentials | None = None,
    ) -> dict[str, Any]:
        from hicache.controller.server import Connection

        srv = self.server
        a = Args(
            req.verb,
            req.args,
            ("role", "engine_id", "pid", "fingerprint", "layout", "page_size", "token"),
        )
        role = Role(a.str("role", choices=[r.value for r in Role]))
        engine_id = a.str("engine_id")
        if not 0 < len(engine_id) <= _ENGINE_ID_CHARS or engine_id == admin_ops.ADMIN_ENGINE:
            raise ProtocolError(
                ErrorCode.BAD_ARGS,
                f"engine_id must be 1..{_ENGINE_ID_CHARS} characters and not "
                f"{admin_ops.ADMIN_ENGINE!r}",
            )
        pid = a.int("pid", required=False) or 0
        layout, page_size = None, 0
        if role is Role.ADMIN:
            token = a.bytes("token", required=False) or b""
            if not srv.admin_token or not hmac.compare_digest(token, srv.admin_token):
                raise ProtocolError(
                    ErrorCode.FORBIDDEN,
                    f"admin connections need the admin token (in {srv.config.admin_token_path},"
                    " readable by the sidecar's user); hicachectl reads it from there",
                )
        else:
            fingerprint = a.bytes("fingerprint", length=16)
            page_size = a.int("page_size", 1, 1 << 20)
            layout = decode_layout(a.map("layout"), "hello: layout")
            if layout.fingerprint(page_size) != fingerprint:
                raise ProtocolError(
                    ErrorCode.BAD_ARGS,
                    "hello: the fingerprint does not match the layout and page size sent",
                )
            if srv.fingerprint is not None and fingerprint != srv.fingerprint:
                raise ProtocolError(
                    ErrorCode.LAYOUT_MISMATCH,
                    f"this sidecar serves layout {srv.layout.model_id!r} (page_size "
                    f"{srv.page_size}, fingerprint {srv.fingerprint.hex()}); the engine's is "
                    f"{layout.model_id!r} (page_size {page_size}, fingerprint "
                    f"{fingerprint.hex()}): run one sidecar per layout",
                )
            if srv.fingerprint is None:
                srv.layout, srv.page_size, srv.fingerprint = layout, page_size, fingerprint
            old = srv.engines.get(engine_id)
            if old is not None:  # the engine reconnected: its old session is void
                srv.drop_connection(old, "replaced by a new connection")
        conn = Connection(
            sock, routing_id, role, engine_id, pid, srv.transport(sock), now, now, layout, page_size
        )
        conn.peer = peer
        srv.add_connection(conn)
        if role is Role.ENGINE:
            log.info(f"engine {engine_id} (pid {pid}) connected over {conn.transport}")
        return {
            "protocol": PROTOCOL_VERSION,
            "server_version": __version__,
            "pid": os.getpid(),
            "lease_s": srv.config.lease_s,
            "heartbeat_interval_s": srv.config.heartbeat_interval_s,
            "max_message_bytes": srv.config.max_message_bytes,
        }

    # -- engine verbs (inline) -----------------------------------------------------------

    def heartbeat(self, conn: Connection, req: Request) -> dict[str, Any]:
        Args(req.verb, req.args, ())
        return {"lease_s": self.server.config.lease_s}

    def is_bulk(self, req: Request) -> bool:
        """A lookup or pin too large for the I/O thread: it runs on the fair lane."""
        return req.verb in (Verb.LOOKUP, Verb.PIN) and page_count(req.args, req.verb) > (
            INLINE_MAX_PAGES
        )

    def lookup(self, conn: Connection, req: Request) -> dict[str, Any]:
        a = Args(req.verb, req.args, ("hashes", "components"))
        raw = hash_column(a.bytes("hashes"), MAX_LOOKUP_HASHES)
        comps = decode_component_list(a.int_list("components", max_len=3))
        rows: dict[ComponentType, list[np.ndarray]] = {c: [] for c in comps}
        step = WORK_CHUNK_PAGES * HASH_BYTES
        for start in range(0, max(len(raw), 1), step):
            if start:
                yield_to_io()
            res = self.ctl.lookup(
                decode_hashes(raw[start : start + step]), comps, engine_id=conn.engine_id
            )
            for c in comps:
                rows[c].append(res.presence[c])
        return {"presence": [np.concatenate(rows[c]).astype(np.int8).tobytes() for c in comps]}

    def pin(self, conn: Connection, req: Request) -> dict[str, Any]:
        a = Args(req.verb, req.args, ("keys", "ttl_s"))
        keys = decode_keys(a.map("keys"), MAX_PIN_KEYS, yield_to_io)
        ttl = _ttl(a)
        receipt = self.ctl.pin(keys, ttl, engine_id=conn.engine_id)
        if receipt is None:
            return {"pin_id": None}
        return {"pin_id": receipt.pin_id, "ttl_s": receipt.deadline - time.monotonic()}

    def unpin(self, conn: Connection, req: Request) -> dict[str, Any]:
        a = Args(req.verb, req.args, ("pin_id",))
        self.ctl.unpin(PinReceipt(a.int("pin_id"), [], 0.0), engine_id=conn.engine_id)
        return {}

    def stats(self, conn: Connection, req: Request) -> dict[str, Any]:
        Args(req.verb, req.args, ())
        out = self.ctl.stats(engine_id=conn.engine_id)
        out["residency"] = admin_ops.residency(self.ctl)
        out["sidecar"] = self._sidecar_summary()
        return out

    def bye(self, conn: Connection, req: Request) -> dict[str, Any]:
        Args(req.verb, req.args, ())
        self.server.drop_connection(conn, "said bye")
        return {}

    # -- engine verbs (workers) ----------------------------------------------------------

    def register(self, conn: Connection, req: Request, deadline: float) -> dict[str, Any]:
        a = Args(req.verb, req.args, ("page_size", "device", "buffers"))
        page_size = a.int("page_size", 1, 1 << 20)
        if conn.layout is None or page_size != conn.page_size:
            raise ProtocolError(
                ErrorCode.BAD_ARGS,
                f"register: page_size {page_size} differs from the handshake's {conn.page_size}",
            )
        desc = {"device": a.str("device", choices=("cpu", "cuda")), "buffers": a.map("buffers")}
        srv = self.server
        # Copies of an earlier session may still run on the engine's memory; the engine
        # keeps the pages they touch until this reply says they have ended.
        srv.fence(conn, deadline)
        if conn.dropped:  # a newer connection of the engine came meanwhile: it registers
            raise ProtocolError(ErrorCode.NO_SESSION, "the session ended before register")
        try:
            mapped = map_pools(
                conn.layout, page_size, desc, srv.config.gpu_uuids, conn.peer, srv.fd_inbox
            )
        except RegistrationRefused as exc:
            srv.metrics.registrations.labels("refused").inc()
            raise ProtocolError(ErrorCode.REGISTRATION_REFUSED, str(exc)) from None
        first = not self.ctl.opened
        try:
            self.ctl.register_buffers(conn.layout, page_size, mapped.buffers, conn.engine_id)
            if first:  # the tiers were built just now, the index rebuilt from disk
                srv.freeze_long_lived()
        except BaseException:
            srv.metrics.registrations.labels("refused").inc()
            srv.unmap_later(mapped)
            raise
        old, conn.mapped = conn.mapped, mapped
        if old is not None:
            srv.unmap_later(old)
        if srv.engines.get(conn.engine_id) is not conn:
            # The session ended (lease, or a new connection) while this ran: undo.
            if srv.engines.get(conn.engine_id) is None:
                self.ctl.unregister(conn.engine_id)
            srv.unmap_later(mapped)
            conn.mapped = None
            raise ProtocolError(ErrorCode.NO_SESSION, "the session ended during register")
        srv.metrics.registrations.labels("ok").inc()
        buffers = mapped.buffers
        log.info(f"engine {conn.engine_id} registered {mapped.device} pools")
        return {
            "capacity": {c.name.lower(): buffers.capacity(c) for c in conn.layout.components},
            "fenced": True,
        }

    def backup(self, conn: Connection, req: Request, deadline: float) -> dict[str, Any]:
        a = Args(req.verb, req.args, ("refs", "ready_event"))
        refs = decode_refs(a.map("refs"))
        event = None
        raw_event = a.bytes("ready_event", required=False)
        if raw_event is not None:
            if conn.mapped.device != "cuda":
                raise ProtocolError(ErrorCode.BAD_ARGS, "ready_event is for CUDA pools only")
            try:
                event = open_ready_event(raw_event, conn.mapped.buffers.device)
            except RegistrationRefused as exc:
                raise ProtocolError(ErrorCode.BAD_ARGS, str(exc)) from None
        handle = self.ctl.backup(refs, event, engine_id=conn.engine_id)
        # Past the deadline too, no reply (not even an error) before the copy has ended.
        ok = bool(handle.wait(max(0.0, deadline - time.monotonic())))
        if not handle.done():
            # The reply tells the engine its pages are free again: not while a copy
            # still reads them (a GPU copy behind a busy stream ends on its own).
            ok = False
            waited_from = time.monotonic()
            next_report = waited_from + _SETTLE_REPORT_S
            while not handle.done():
                handle.wait(_SETTLE_POLL_S)
                if time.monotonic() > next_report:  # a device that stopped: say so, wait on
                    log.error(
                        "a backup copy of engine %s has not ended after %.0fs",
                        conn.engine_id,
                        time.monotonic() - waited_from,
                    )
                    next_report += _SETTLE_REPORT_S
        if ok and self.server.config.backup_ack is BackupAck.DISK:
            ok = self.ctl.flush(_remaining(deadline))
            keys = list({r.key: None for r in refs})
            ok = ok and all(Tier.DISK in t for t in self.ctl.tiers_of(keys))
        return {"ok": ok}

    def load(self, conn: Connection, req: Request, deadline: float) -> dict[str, Any]:
        a = Args(req.verb, req.args, ("refs", "pin_id", "timeout_s"))
        refs = decode_refs(a.map("refs"))
        pin = PinReceipt(a.int("pin_id"), [], 0.0)
        timeout = min(a.float("timeout_s", 0.0, 3600.0), _remaining(deadline))
        return {"ok": bool(self.ctl.load(refs, pin, timeout, engine_id=conn.engine_id))}

    def prefetch(self, conn: Connection, req: Request, deadline: float) -> dict[str, Any]:
        a = Args(req.verb, req.args, ("keys",))
        keys = decode_keys(a.map("keys"))
        handle = self.ctl.prefetch(keys, engine_id=conn.engine_id)
        return {"ok": bool(handle.wait(_remaining(deadline)))}

    # -- queries -------------------------------------------------------------------------

    def _sidecar_summary(self) -> dict[str, Any]:
        srv = self.server
        return {
            "uptime_s": time.monotonic() - srv.started,
            "engines": len(srv.engines),
            "connections": len(srv.conns),
            "inflight": srv.inflight,
            "stopping": srv.stopping,
        }

    def metrics_snapshot(self) -> dict[str, Any]:
        out = self.ctl.stats()
        out["residency"] = admin_ops.residency(self.ctl)
        out["page_size"] = self.server.page_size
        return out

    def health(self, conn: Connection, req: Request) -> dict[str, Any]:
        Args(req.verb, req.args, ())
        srv = self.server
        checks = {"serving": not srv.stopping}
        if self.ctl.store.disk is not None:
            # The writer thread is the disk tier's only way in: without it nothing lands.
            checks["disk_writer"] = any(
                t.name == "hicache-lmdb-writer" and t.is_alive() for t in threading.enumerate()
            )
        status = "ok" if all(checks.values()) else "unhealthy"
        return {"status": status, "checks": checks, **self._sidecar_summary()}

    def status(self, conn: Connection, req: Request) -> dict[str, Any]:
        Args(req.verb, req.args, ())
        srv = self.server
        stats = self.ctl.stats()
        layout = None
        if srv.layout is not None:
            layout = {
                "model_id": srv.layout.model_id,
                "page_size": srv.page_size,
                "fingerprint": srv.fingerprint.hex(),
                "components": [c.name.lower() for c in srv.layout.components],
            }
        return {
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "endpoints": srv.endpoints,
            "layout": layout,
            "entries": stats.get("entries", 0),
            "pins_active": stats.get("pins_active", 0),
            "host": stats.get("host", {}),
            "disk": stats.get("disk", {}),
            "remote": remote_status(self.ctl),
            "config": {
                "controller": self.ctl.config.to_dict(),
                "sidecar": srv.config.to_dict(),
            },
            **self._sidecar_summary(),
        }

    def engines(self, conn: Connection, req: Request) -> dict[str, Any]:
        Args(req.verb, req.args, ())
        now = time.monotonic()
        rows = []
        for c in self.server.conns.values():
            rows.append(
                {
                    "engine_id": c.engine_id,
                    "role": c.role.value,
                    "pid": c.pid,
                    "transport": c.transport,
                    "registered": c.mapped is not None,
                    "device": c.mapped.device if c.mapped is not None else None,
                    "connected_s": now - c.since,
                    "idle_s": now - c.last_seen,
                    "inflight": c.inflight,
                    "requests": c.requests,
                }
            )
        return {"engines": sorted(rows, key=lambda r: (r["role"], r["engine_id"]))}

    # -- admin verbs ---------------------------------------------------------------------

    def clear(self, conn: Connection, req: Request, deadline: float) -> dict[str, Any]:
        a = Args(req.verb, req.args, ("tiers", "namespace", "all_namespaces"))
        tiers = a.args.get("tiers")
        if not isinstance(tiers, list) or not tiers or any(t not in _TIERS for t in tiers):
            raise ProtocolError(ErrorCode.BAD_ARGS, "clear: 'tiers' must list 'host' and/or 'disk'")
        namespace = a.str("namespace", required=False)
        all_ns = a.bool("all_namespaces")
        res = admin_ops.clear(
            self.ctl, self.server.fingerprint, [_TIERS[t] for t in tiers], namespace, all_ns
        )
        log.info(f"admin clear {tiers} namespace={'*' if all_ns else namespace!r}: {res.to_dict()}")
        return res.to_dict()

    def evict(self, conn: Connection, req: Request, deadline: float) -> dict[str, Any]:
        a = Args(req.verb, req.args, ("tier", "bytes", "component"))
        tier = _TIERS[a.str("tier", choices=tuple(_TIERS))]
        comp = a.str("component", required=False, choices=tuple(_COMPONENTS))
        return admin_ops.evict(
            self.ctl, tier, a.int("bytes", 1), _COMPONENTS[comp] if comp else None
        )

    def _prefix_keys(self, a: Args) -> list:
        srv = self.server
        tokens = a.args.get("tokens")
        if (
            not isinstance(tokens, list)
            or not tokens
            or not all(type(t) is int and -(1 << 63) <= t < 1 << 63 for t in tokens)
        ):
            raise ProtocolError(ErrorCode.BAD_ARGS, "'tokens' must be a non-empty list of int64")
        if srv.fingerprint is None:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER,
                "no layout yet: a prefix can be named once an engine has connected (or with "
                "[layout] in the sidecar's config)",
            )
        namespace = a.str("namespace", required=False)
        return admin_ops.prefix_keys(self.ctl, srv.fingerprint, srv.page_size, tokens, namespace)

    def pin_prefix(self, conn: Connection, req: Request, deadline: float) -> dict[str, Any]:
        a = Args(req.verb, req.args, ("tokens", "namespace", "ttl_s"))
        ttl = _ttl(a)
        keys = self._prefix_keys(a)
        receipt = admin_ops.pin_prefix(self.ctl, keys, ttl)
        pages = sum(1 for k in keys if k.component is ComponentType.FULL)
        if receipt is None:
            return {"pin_id": None, "pages": 0, "tokens": 0}
        return {
            "pin_id": receipt.pin_id,
            "pages": pages,
            "tokens": pages * self.server.page_size,
            "ttl_s": receipt.deadline - time.monotonic(),
        }

    def unpin_prefix(self, conn: Connection, req: Request) -> dict[str, Any]:
        a = Args(req.verb, req.args, ("pin_id",))
        admin_ops.unpin(self.ctl, a.int("pin_id"))
        return {}

    def fsck(self, conn: Connection, req: Request, deadline: float) -> dict[str, Any]:
        a = Args(req.verb, req.args, ("repair",))
        repair = a.bool("repair")

        def progress(done: int, total: int) -> None:
            self.server.progress(conn, req, done, total)

        res = admin_ops.fsck(self.ctl, repair=repair, progress=progress)
        log.info(f"admin fsck: {res.to_dict()}")
        return res.to_dict()
