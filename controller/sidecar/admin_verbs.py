"""The admin and introspection verbs of the sidecar (health, status, engines, clear,
evict, prefix pins, fsck, score, explain): each is the store operation behind it, over the
sessions and the controller that :class:`~hicache.controller.sidecar.handlers.VerbHandlers`
holds."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicache import __version__
from hicache.controller.admin import ops as admin_ops
from hicache.controller.sidecar.remote_status import remote_status
from hicache.controller.sidecar.sessions import Connection, ServedLayout, Sessions
from hicache.controller.store.miss_ops import ExplainHead
from hicache.controller.store.miss_reasons import tier_label
from hicache.controller.wire.fields import bad_args, split_hashes
from hicache.controller.wire.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    ProtocolError,
    Request,
)
from hicache.controller.wire.verbs import (
    ClearArgs,
    ClearReply,
    Empty,
    EvictArgs,
    EvictReply,
    ExplainArgs,
    FsckArgs,
    FsckReply,
    NoArgs,
    PinIdArgs,
    PinPrefixArgs,
    PinPrefixReply,
    ScoreArgs,
    ScoreReply,
)
from hicache.keys import namespace_hash, page_hashes, token_bytes
from hicache.resume import resumable_pages, window_pages
from hicache.types import ComponentType, Tier

if TYPE_CHECKING:
    from hicache.controller.sidecar.config import SidecarConfig
    from hicache.controller.store.local import LocalController

log = logging.getLogger("hicache.sidecar")

_TIERS = {"host": Tier.HOST, "disk": Tier.DISK}
_COMPONENTS = {c.name.lower(): c for c in ComponentType}


@dataclass
class Call:
    """One request being handled: its connection, its deadline, and how to report the
    progress of a long one."""

    conn: Connection
    request: Request
    deadline: float
    progress: Callable[[int, int], None]

    def remaining(self) -> float:
        """Seconds left to the deadline; raises DEADLINE_EXCEEDED once it has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ProtocolError(ErrorCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        return left


class AdminVerbs:
    """The admin verbs of :class:`VerbHandlers` (which sets the attributes they use)."""

    ctl: LocalController
    sessions: Sessions
    config: SidecarConfig
    endpoints: list[str]

    def metrics_snapshot(self) -> dict[str, Any]:
        out = self.ctl.stats()
        out["residency"] = self.ctl.store.residency()
        served = self.sessions.served
        out["page_size"] = served.page_size if served is not None else 0
        return out

    def health(self, call: Call, a: NoArgs) -> dict[str, Any]:
        checks = {"serving": not self.sessions.stopping}
        if Tier.DISK in self.ctl.store.tiers():
            # The writer thread is the disk tier's only way in: without it nothing lands.
            checks["disk_writer"] = any(
                t.name == "hicache-lmdb-writer" and t.is_alive() for t in threading.enumerate()
            )
        status = "ok" if all(checks.values()) else "unhealthy"
        return {"status": status, "checks": checks, **self.sessions.summary()}

    def status(self, call: Call, a: NoArgs) -> dict[str, Any]:
        stats = self.ctl.stats()
        served = self.sessions.served
        layout = None
        if served is not None:
            layout = {
                "model_id": served.layout.model_id,
                "page_size": served.page_size,
                "fingerprint": served.fingerprint.hex(),
                "components": [c.name.lower() for c in served.layout.components],
            }
        return {
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "endpoints": self.endpoints,
            "layout": layout,
            "entries": stats.get("entries", 0),
            "pins_active": stats.get("pins_active", 0),
            "host": stats.get("host", {}),
            "disk": stats.get("disk", {}),
            "remote": remote_status(self.ctl),
            "config": {
                "controller": self.ctl.config.to_dict(),
                "sidecar": self.config.to_dict(),
            },
            **self.sessions.summary(),
        }

    def engines(self, call: Call, a: NoArgs) -> dict[str, Any]:
        now = time.monotonic()
        rows = [
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
            for c in self.sessions.conns.values()
        ]
        return {"engines": sorted(rows, key=lambda r: (r["role"], r["engine_id"]))}

    # -- admin verbs ---------------------------------------------------------------------

    def _fingerprint(self) -> bytes | None:
        served = self.sessions.served
        return served.fingerprint if served is not None else None

    def clear(self, call: Call, a: ClearArgs) -> ClearReply:
        tiers = [_TIERS[t] for t in a.tiers]
        res = admin_ops.clear(self.ctl, self._fingerprint(), tiers, a.namespace, a.all_namespaces)
        scope = "*" if a.all_namespaces else repr(a.namespace)
        log.info(f"admin clear {a.tiers} namespace={scope}: {res}")
        return ClearReply(res.host_pages, res.disk_pages, res.kept_pages)

    def evict(self, call: Call, a: EvictArgs) -> EvictReply:
        comp = _COMPONENTS[a.component] if a.component else None
        freed = admin_ops.evict(self.ctl, _TIERS[a.tier], a.bytes, comp)
        return EvictReply(freed["pages"], freed["bytes"])

    def pin_prefix(self, call: Call, a: PinPrefixArgs) -> PinPrefixReply:
        served = self.sessions.served
        if served is None:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER,
                "no layout yet: a prefix can be named once an engine has connected (or with "
                "[layout] in the sidecar's config)",
            )
        keys = admin_ops.prefix_keys(
            self.ctl, served.fingerprint, served.page_size, a.tokens, a.namespace
        )
        receipt = admin_ops.pin_prefix(self.ctl, keys, a.ttl_s)
        if receipt is None:
            return PinPrefixReply(None, 0, 0)
        pages = sum(1 for k in keys if k.component is ComponentType.FULL)
        ttl = receipt.deadline - time.monotonic()
        return PinPrefixReply(receipt.pin_id, pages, pages * served.page_size, ttl)

    def _served_for(self, what: str) -> ServedLayout:
        served = self.sessions.served
        if served is None:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER,
                f"no layout yet: a prompt can be {what} once an engine has connected (or with "
                "[layout] in the sidecar's config)",
            )
        return served

    def score(self, call: Call, a: ScoreArgs) -> ScoreReply:
        """Per tier (counting the faster ones too), the longest prefix of the prompt that
        can be resumed, every component's rule applied (hicache/resume.py)."""
        served = self._served_for("scored")
        if (a.hashes is None) == (a.tokens is None):
            raise bad_args("score takes 'hashes' or 'tokens', exactly one of the two")
        components = served.layout.components
        if ComponentType.SWA in components and a.sliding_window is None:
            raise bad_args("this layout has SWA layers: give 'sliding_window' (tokens)")
        if a.tokens is not None:
            hashes = page_hashes(a.tokens, served.fingerprint, served.page_size, a.namespace)
        else:
            hashes = split_hashes(a.hashes)
        rows = self.ctl.store.presence(hashes, components)
        window = window_pages(a.sliding_window, served.page_size)
        resumable, kv_pages = {}, {}
        for tier in (Tier.HOST, Tier.DISK, Tier.REMOTE):
            rank = int(tier)

            def held(v: int, rank: int = rank) -> bool:
                return 0 < v <= rank

            name = tier.name.lower()
            resumable[name] = resumable_pages(rows, held, window)
            kv_pages[name] = resumable_pages({ComponentType.FULL: rows[ComponentType.FULL]}, held)
        return ScoreReply(served.page_size, len(hashes), resumable, kv_pages)

    def explain(self, call: Call, a: ExplainArgs) -> dict[str, Any]:
        """Page by page, where each page of a prompt is and why the others are not, or
        the same for an engine's last lookups as they were answered
        (controller/store/miss_ops.py)."""
        served = self._served_for("explained")
        if sum(x is not None for x in (a.hashes, a.tokens, a.engine)) != 1:
            raise bad_args("explain takes 'hashes', 'tokens' or 'engine', exactly one of them")
        store = self.ctl.store
        out: dict[str, Any] = {"page_size": served.page_size}
        if a.engine is not None:
            now = time.monotonic()
            out["engine"] = a.engine
            out["lookups"] = [
                {
                    "age_s": round(now - lk.at, 3),
                    "pages": lk.pages,
                    "first_miss": {
                        c.name.lower(): {"reason": r.value, "tier": tier_label(t)}
                        for c, (r, t) in lk.reasons.items()
                    },
                    "load_failures": [
                        {"reason": r.value, "tier": tier_label(t)} for r, t in lk.load_failures
                    ],
                    "runs": store.explain(lk.page_hashes, list(lk.rows), rows=lk.rows),
                }
                for lk in store.recent_lookups(a.engine, a.last or 1)
            ]
            return out
        head = None
        if a.tokens is not None:
            hashes = page_hashes(a.tokens, served.fingerprint, served.page_size, a.namespace)
            if hashes:
                root = namespace_hash(served.fingerprint, a.namespace)
                first = token_bytes(a.tokens[: served.page_size])
                head = ExplainHead(root, first, served.page_size)
        else:
            hashes = split_hashes(a.hashes)
        out["pages"] = len(hashes)
        out["runs"] = store.explain(hashes, served.layout.components, head)
        return out

    def unpin_prefix(self, call: Call, a: PinIdArgs) -> Empty:
        admin_ops.unpin(self.ctl, a.pin_id)
        return Empty()

    def fsck(self, call: Call, a: FsckArgs) -> FsckReply:
        res = admin_ops.fsck(self.ctl, repair=a.repair, progress=call.progress)
        log.info(f"admin fsck: {res.to_dict()}")
        return FsckReply(**res.to_dict())
