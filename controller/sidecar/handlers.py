"""What the sidecar does for each verb: the controller call behind it.

Every handler receives the verb's argument record, already decoded and checked against
the verb's spec (:mod:`hicache.controller.wire.verbs`) before it runs, and returns the
verb's result record. Handlers see the sessions and the controller, never the server:
those that run on a worker or the lane (the spec says which) receive the request's
deadline in their :class:`Call` and never wait past it.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache import __version__
from hicache.controller.admin.ops import ADMIN_ENGINE
from hicache.controller.sidecar.admin_verbs import AdminVerbs, Call
from hicache.controller.sidecar.device_map import RegistrationRefused, map_pools, open_ready_event
from hicache.controller.sidecar.sessions import Connection, ServedLayout, Sessions
from hicache.controller.store.miss_reasons import MissReason
from hicache.controller.wire.fields import WORK_CHUNK_PAGES, bad_args, split_hashes, yield_to_io
from hicache.controller.wire.protocol import (
    PROTOCOL_VERSION,
    SETTLE_POLL_S,
    ErrorCode,
    ProtocolError,
    Role,
    Verb,
)
from hicache.controller.wire.verbs import (
    BackupArgs,
    Empty,
    HeartbeatReply,
    HelloArgs,
    HelloReply,
    KeysArgs,
    LoadArgs,
    LookupArgs,
    LookupReply,
    NoArgs,
    OkReply,
    PinArgs,
    PinReply,
    RegisterArgs,
    RegisterReply,
    StoreBeginArgs,
    StoreBeginReply,
    StoreCommitArgs,
    StoreCommitReply,
    UnpinArgs,
)
from hicache.controller_api import PinReceipt
from hicache.keys import HASH_BYTES
from hicache.types import ComponentType, Tier

if TYPE_CHECKING:
    from hicache.controller.sidecar.config import SidecarConfig
    from hicache.controller.sidecar.fd_inbox import FdInbox
    from hicache.controller.sidecar.metrics import SidecarMetrics
    from hicache.controller.store.local import LocalController
    from hicache.controller.wire.security import PeerCredentials

log = logging.getLogger("hicache.sidecar")

ENGINE_ID_CHARS = 200
_TIERS = {"host": Tier.HOST, "disk": Tier.DISK}
_COMPONENTS = {c.name.lower(): c for c in ComponentType}
_SETTLE_REPORT_S = 60.0  # a device copy still running is reported this often


class VerbHandlers(AdminVerbs):
    """The verbs of one sidecar, over its sessions and its controller (the admin and
    introspection verbs in :class:`~hicache.controller.sidecar.admin_verbs.AdminVerbs`)."""

    def __init__(
        self,
        sessions: Sessions,
        controller: LocalController,
        config: SidecarConfig,
        metrics: SidecarMetrics,
        endpoints: list[str],
        on_tiers_opened: Callable[[], None],
    ) -> None:
        """``endpoints``: the addresses served (filled in when the server binds);
        ``on_tiers_opened``: called once the first registration has built the tiers."""
        self.sessions = sessions
        self.ctl = controller
        self.config = config
        self.metrics = metrics
        self.endpoints = endpoints
        self.on_tiers_opened = on_tiers_opened
        self.admin_token = b""  # set by the server once it has loaded or written it
        self.instance = secrets.randbits(62)  # HelloReply.instance
        self.fd_inbox: FdInbox | None = None  # memory descriptors (controller/client/fd_pass.py)
        self.handlers: dict[Verb, Callable[[Call, Any], Any]] = {
            Verb.REGISTER: self.register,
            Verb.HEARTBEAT: self.heartbeat,
            Verb.LOOKUP: self.lookup,
            Verb.BACKUP: self.backup,
            Verb.PIN: self.pin,
            Verb.LOAD: self.load,
            Verb.UNPIN: self.unpin,
            Verb.PREFETCH: self.prefetch,
            Verb.STORE_BEGIN: self.store_begin,
            Verb.STORE_COMMIT: self.store_commit,
            Verb.STATS: self.stats,
            Verb.BYE: self.bye,
            Verb.HEALTH: self.health,
            Verb.STATUS: self.status,
            Verb.ENGINES: self.engines,
            Verb.CLEAR: self.clear,
            Verb.EVICT: self.evict,
            Verb.PIN_PREFIX: self.pin_prefix,
            Verb.UNPIN_PREFIX: self.unpin_prefix,
            Verb.FSCK: self.fsck,
            Verb.SCORE: self.score,
            Verb.EXPLAIN: self.explain,
        }
        self.remote_tier = self.ctl.config.remote_enabled  # see VerbSpec.place

    # -- handshake -----------------------------------------------------------------------

    def hello(
        self,
        key: tuple[int, bytes],
        transport: str,
        peer: PeerCredentials | None,
        a: HelloArgs,
        now: float,
    ) -> HelloReply:
        """Open a session for the connection ``key`` (a ROUTER index and routing id)."""
        role = Role(a.role)
        if not 0 < len(a.engine_id) <= ENGINE_ID_CHARS or a.engine_id == ADMIN_ENGINE:
            raise bad_args(
                f"engine_id must be 1..{ENGINE_ID_CHARS} characters and not {ADMIN_ENGINE!r}"
            )
        layout, page_size = None, 0
        if role is Role.ADMIN:
            if not self.admin_token or not hmac.compare_digest(a.token or b"", self.admin_token):
                raise ProtocolError(
                    ErrorCode.FORBIDDEN,
                    f"admin connections need the admin token (in {self.config.admin_token_path},"
                    " readable by the sidecar's user); hicachectl reads it from there",
                )
        else:
            for name in ("fingerprint", "layout", "page_size"):
                if getattr(a, name) is None:
                    raise bad_args(f"hello: missing argument {name!r}")
            layout, page_size, fingerprint = a.layout, a.page_size, a.fingerprint
            if layout.fingerprint(page_size) != fingerprint:
                raise bad_args(
                    "hello: the fingerprint does not match the layout and page size sent"
                )
            served = self.sessions.served
            if served is not None and fingerprint != served.fingerprint:
                for comp in layout.components:  # every lookup of that engine misses
                    self.ctl.store.count_miss(MissReason.LAYOUT, None, comp)
                raise ProtocolError(
                    ErrorCode.LAYOUT_MISMATCH,
                    f"this sidecar serves layout {served.layout.model_id!r} (page_size "
                    f"{served.page_size}, fingerprint {served.fingerprint.hex()}); the "
                    f"engine's is {layout.model_id!r} (page_size {page_size}, fingerprint "
                    f"{fingerprint.hex()}): run one sidecar per layout",
                )
            if served is None:
                self.sessions.served = ServedLayout(layout, page_size, fingerprint)
                if not self.ctl.opened:
                    # An engine that only attaches (and copies its own pages) registers no
                    # pools: the tiers are built now, off the I/O thread, so that its host
                    # pages can be mapped; a register meanwhile waits for them.
                    threading.Thread(
                        target=self._open_layout, args=(layout, page_size), daemon=True
                    ).start()
        conn = Connection(
            key[0], key[1], role, a.engine_id, a.pid or 0, transport, now, now, layout, page_size
        )
        conn.peer = peer
        self.sessions.add(conn)
        if role is Role.ENGINE:
            log.info(f"engine {a.engine_id} (pid {conn.pid}) connected over {transport}")
        return HelloReply(
            protocol=PROTOCOL_VERSION,
            server_version=__version__,
            pid=os.getpid(),
            lease_s=self.config.lease_s,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            max_message_bytes=self.config.max_message_bytes,
            instance=self.instance,
        )

    # -- engine verbs --------------------------------------------------------------------

    def heartbeat(self, call: Call, a: NoArgs) -> HeartbeatReply:
        return HeartbeatReply(self.config.lease_s)

    def lookup(self, call: Call, a: LookupArgs) -> LookupReply:
        rows: dict[ComponentType, list[np.ndarray]] = {c: [] for c in a.components}
        step = WORK_CHUNK_PAGES * HASH_BYTES
        for start in range(0, max(len(a.hashes), 1), step):
            if start:
                yield_to_io()
            res = self.ctl.lookup(
                split_hashes(a.hashes[start : start + step]),
                a.components,
                engine_id=call.conn.engine_id,
                tenant=a.tenant,
                prefill_tokens_per_s=a.prefill_tokens_per_s,
            )
            for c in a.components:
                rows[c].append(res.presence[c])
        return LookupReply(
            [np.concatenate(rows[c]).astype(np.int8).tobytes() for c in a.components]
        )

    def pin(self, call: Call, a: PinArgs) -> PinReply:
        receipt = self.ctl.pin(a.keys, a.ttl_s, engine_id=call.conn.engine_id)
        if receipt is None:
            return PinReply(None)
        if a.under is not None and not self.ctl.store.pin_held(a.under):
            # Checked after pinning: held then, ``under`` held the pages from its own pin
            # until this one took them over, so a copy made under it read them whole.
            self.ctl.unpin(receipt, engine_id=call.conn.engine_id)
            return PinReply(None)
        ttl = receipt.deadline - time.monotonic()
        pages = self.ctl.store.pinned_host_pages(receipt.pin_id, a.keys) if a.host_pages else None
        return PinReply(receipt.pin_id, ttl, None if pages is None else pages.tobytes())

    def unpin(self, call: Call, a: UnpinArgs) -> Empty:
        pin = PinReceipt(a.pin_id, [], 0.0)
        self.ctl.unpin(pin, engine_id=call.conn.engine_id, loaded_s=a.loaded_s, disk_s=a.disk_s)
        return Empty()

    def _open_layout(self, layout: Any, page_size: int) -> None:
        try:
            self.ctl.open_layout(layout, page_size)
        except Exception as exc:  # a register meets the same error and reports it
            log.error("building the tiers for %s failed: %s", layout.model_id, exc)

    def store_begin(self, call: Call, a: StoreBeginArgs) -> StoreBeginReply:
        engine_id = call.conn.engine_id
        store_id, pages = self.ctl.begin_store(a.refs, a.ttl_s, engine_id, a.tenant)
        return StoreBeginReply(store_id, np.asarray(pages, dtype="<i4").tobytes())

    def store_commit(self, call: Call, a: StoreCommitArgs) -> StoreCommitReply:
        n = self.ctl.commit_store(a.store_id, a.written, engine_id=call.conn.engine_id)
        return StoreCommitReply(n)

    def stats(self, call: Call, a: NoArgs) -> dict[str, Any]:
        out = self.ctl.stats(engine_id=call.conn.engine_id)
        out["residency"] = self.ctl.store.residency()
        out["sidecar"] = self.sessions.summary()
        return out

    def bye(self, call: Call, a: NoArgs) -> Empty:
        self.sessions.drop(call.conn, "said bye")
        return Empty()

    def register(self, call: Call, a: RegisterArgs) -> RegisterReply:
        conn, sessions = call.conn, self.sessions
        if conn.layout is None or a.page_size != conn.page_size:
            raise bad_args(
                f"register: page_size {a.page_size} differs from the handshake's {conn.page_size}"
            )
        # Copies of an earlier session may still run on the engine's memory; the engine
        # keeps the pages they touch until this reply says they have ended.
        sessions.fence(conn, call.deadline)
        if conn.dropped:  # a newer connection of the engine came meanwhile: it registers
            raise ProtocolError(ErrorCode.NO_SESSION, "the session ended before register")
        desc = {"device": a.device, "buffers": a.buffers}
        try:
            mapped = map_pools(
                conn.layout, a.page_size, desc, self.config.gpu_uuids, conn.peer, self.fd_inbox
            )
        except RegistrationRefused as exc:
            self.metrics.registrations.labels("refused").inc()
            raise ProtocolError(ErrorCode.REGISTRATION_REFUSED, str(exc)) from None
        first = not self.ctl.opened
        try:
            self.ctl.register_buffers(conn.layout, a.page_size, mapped.buffers, conn.engine_id)
            if first:  # the tiers were built just now, the index rebuilt from disk
                self.on_tiers_opened()
        except BaseException:
            self.metrics.registrations.labels("refused").inc()
            sessions.unmap_later(mapped)
            raise
        old, conn.mapped = conn.mapped, mapped
        if old is not None:
            sessions.unmap_later(old)
        if sessions.engines.get(conn.engine_id) is not conn:
            # The session ended (lease, or a new connection) while this ran: undo.
            if sessions.engines.get(conn.engine_id) is None:
                self.ctl.unregister(conn.engine_id)
            sessions.unmap_later(mapped)
            conn.mapped = None
            raise ProtocolError(ErrorCode.NO_SESSION, "the session ended during register")
        self.metrics.registrations.labels("ok").inc()
        buffers = mapped.buffers
        log.info(f"engine {conn.engine_id} registered {mapped.device} pools")
        capacity = {c.name.lower(): buffers.capacity(c) for c in conn.layout.components}
        return RegisterReply(capacity, fenced=True)

    def backup_event(self, conn: Connection, a: BackupArgs) -> Any:
        """The engine's event a backup's copy waits on (None: it names none); BAD_ARGS
        for one that cannot be opened."""
        if a.ready_event is None:
            return None
        if conn.mapped.device != "cuda":
            raise bad_args("ready_event is for CUDA pools only")
        try:
            return open_ready_event(a.ready_event, conn.mapped.buffers.device)
        except RegistrationRefused as exc:
            raise bad_args(str(exc)) from None

    def backup(self, call: Call, a: BackupArgs) -> OkReply:
        conn = call.conn
        event = self.backup_event(conn, a)
        handle = self.ctl.backup(a.refs, event, engine_id=conn.engine_id, tenant=a.tenant)
        # Past the deadline too, no reply (not even an error) before the copy has ended.
        ok = bool(handle.wait(max(0.0, call.deadline - time.monotonic())))
        if not handle.done():
            # The reply tells the engine its pages are free again: not while a copy
            # still reads them (a GPU copy behind a busy stream ends on its own).
            ok = False
            waited_from = time.monotonic()
            next_report = waited_from + _SETTLE_REPORT_S
            while not handle.done():
                handle.wait(SETTLE_POLL_S)
                if time.monotonic() > next_report:  # a device that stopped: say so, wait on
                    log.error(
                        "a backup copy of engine %s has not ended after %.0fs",
                        conn.engine_id,
                        time.monotonic() - waited_from,
                    )
                    next_report += _SETTLE_REPORT_S
        if ok:
            ok = self.ctl.acknowledged(a.refs, self.config.backup_ack, call.remaining())
        return OkReply(ok)

    def load(self, call: Call, a: LoadArgs) -> OkReply:
        timeout = min(a.timeout_s, call.remaining())
        engine_id = call.conn.engine_id
        pin = self.load_pin(a, engine_id)
        if pin is None:
            return OkReply(False)
        try:
            return OkReply(self.ctl.load(a.refs, pin, timeout, engine_id=engine_id).ok)
        finally:
            if a.pin_id is None:
                self.ctl.unpin(pin, engine_id=engine_id)

    def load_pin(self, a: LoadArgs, engine_id: str) -> PinReceipt | None:
        """The pin a load runs under: the one it names, or (``pin_ttl_s``) one taken now
        over its own pages, which the caller releases when the load ends; None when a
        page is absent (nothing pinned)."""
        if (a.pin_id is None) == (a.pin_ttl_s is None):
            raise bad_args("load: give exactly one of pin_id and pin_ttl_s")
        if a.pin_id is not None:
            return PinReceipt(a.pin_id, [], 0.0)
        keys = list(dict.fromkeys(r.key for r in a.refs))
        return self.ctl.pin(keys, a.pin_ttl_s, engine_id=engine_id)

    def prefetch(self, call: Call, a: KeysArgs) -> OkReply:
        handle = self.ctl.prefetch(a.keys, engine_id=call.conn.engine_id)
        return OkReply(bool(handle.wait(call.remaining())))

    # -- queries -------------------------------------------------------------------------
