"""Every wire verb, defined once: its argument and result records, where it runs, who may
send it and whether it needs a registration.

The server decodes a request's ``args`` into the verb's argument record before its
handler runs (a bad request changes nothing), and the engine's client and ``hicachectl``
encode their requests from the same records and decode the replies into the result
records. docs/protocol.md's verb table is checked against this one
(tests/controller/wire/test_sidecar_verb_specs.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicache.controller.wire.fields import (
    INLINE_MAX_PAGES,
    MAX_LOOKUP_HASHES,
    MAX_PIN_KEYS,
    Bin,
    BinList,
    Bool,
    Components,
    Float,
    Hashes,
    Int,
    Keys,
    Layout,
    Map,
    Nullable,
    Refs,
    Str,
    TierNames,
    Tokens,
    decode_record,
    encode_record,
    page_count,
    wire,
    yield_to_io,
)
from hicache.controller.wire.protocol import ErrorCode, ProtocolError, Role, Verb

if TYPE_CHECKING:
    from hicache.controller_api import PageKey, PageRef
    from hicache.layout import ModelLayout
    from hicache.types import ComponentType

MAX_PIN_TTL_S = 86_400.0  # the longest pin a request may ask for (a day)
MAX_LOAD_TIMEOUT_S = 3600.0
PAGE_SIZE = Int(1, 1 << 20)
COMPONENT_NAMES = ("full", "swa", "mamba")
TIER_NAMES = ("host", "disk")


class Runs(enum.Enum):
    """Where a verb's handler runs."""

    IO = "I/O"  # on the I/O thread: it never waits on a copy or a disk read
    WORKER = "worker"  # on a worker, with the request's deadline
    # On the I/O thread when small; above INLINE_MAX_PAGES pages on the fair lane.
    IO_OR_LANE = "I/O or lane"
    # A copy begun on the I/O thread and answered there once it has ended, when small (a
    # load: its pages on host; controller/sidecar/inline_copies.py); otherwise on a worker.
    IO_OR_WORKER = "I/O or worker"


class Place(enum.Enum):
    """Where one request runs, as :meth:`VerbSpec.place` decides it."""

    IO = "I/O thread"
    INLINE_COPY = "a copy begun on the I/O thread (a worker when its pages are not on host)"
    LANE = "the fair lane"
    WORKER = "a worker"


# -- argument records ---------------------------------------------------------------------


@dataclass(frozen=True)
class NoArgs:
    pass


@dataclass(frozen=True)
class HelloArgs:
    role: str = wire(Str(tuple(r.value for r in Role)))
    engine_id: str = wire(Str())
    pid: int | None = wire(Int(), optional=True)
    fingerprint: bytes | None = wire(Bin(16), optional=True)
    layout: ModelLayout | None = wire(Layout(), optional=True)
    page_size: int | None = wire(PAGE_SIZE, optional=True)
    token: bytes | None = wire(Bin(), optional=True)


@dataclass(frozen=True)
class RegisterArgs:
    page_size: int = wire(PAGE_SIZE)
    device: str = wire(Str(("cpu", "cuda")))
    buffers: dict = wire(Map())  # checked by sidecar.device_map.map_pools


@dataclass(frozen=True)
class LookupArgs:
    hashes: bytes = wire(Hashes(MAX_LOOKUP_HASHES))  # 16-byte hashes, one column
    components: list[ComponentType] = wire(Components())
    tenant: str | None = wire(Str(), optional=True)  # whose lookup (counted to it)
    # The engine's prefill rate, tokens per second (the cost rule; kept until the next)
    prefill_tokens_per_s: float | None = wire(Float(0.0, 1e12), optional=True)


@dataclass(frozen=True)
class BackupArgs:
    refs: list[PageRef] = wire(Refs())
    ready_event: bytes | None = wire(Bin(), optional=True)
    tenant: str | None = wire(Str(), optional=True)  # whose new pages are (its quotas)


@dataclass(frozen=True)
class StoreBeginArgs:
    """Host pages for a store the engine copies itself (its device indices are not used)."""

    refs: list[PageRef] = wire(Refs())
    ttl_s: float = wire(Float(0.001, MAX_PIN_TTL_S))
    tenant: str | None = wire(Str(), optional=True)  # whose new pages are (its quotas)


@dataclass(frozen=True)
class StoreCommitArgs:
    store_id: int = wire(Int())
    written: bool = wire(Bool())  # False: the engine could not write them; give them back


@dataclass(frozen=True)
class PinArgs:
    keys: list[PageKey] = wire(Keys(MAX_PIN_KEYS, yield_to_io))
    ttl_s: float = wire(Float(0.001, MAX_PIN_TTL_S))
    # The engine maps the shared host pages: answer each key's host page (host_share.py).
    host_pages: bool | None = wire(Bool(), optional=True)
    # Pinned only if the pin ``under`` (another session's: vLLM's scheduler) still exists
    # once these keys are pinned: a failure otherwise (engine_blocks.py, handed pages).
    under: int | None = wire(Int(), optional=True)


@dataclass(frozen=True)
class LoadArgs:
    """A load under the pin ``pin_id``, or (``pin_ttl_s`` instead) one that pins its own
    pages for that long and releases them when it ends: exactly one of the two."""

    refs: list[PageRef] = wire(Refs())
    timeout_s: float = wire(Float(0.0, MAX_LOAD_TIMEOUT_S))
    pin_id: int | None = wire(Int(), optional=True)
    pin_ttl_s: float | None = wire(Float(0.001, MAX_PIN_TTL_S), optional=True)


@dataclass(frozen=True)
class PinIdArgs:
    pin_id: int = wire(Int())


@dataclass(frozen=True)
class UnpinArgs:
    pin_id: int = wire(Int())
    # The engine copied the pinned pages from the shared host pages, in this many seconds.
    loaded_s: float | None = wire(Float(0.0, MAX_LOAD_TIMEOUT_S), optional=True)
    # Of those, it read the pages only on disk from LMDB itself, in this many seconds.
    disk_s: float | None = wire(Float(0.0, MAX_LOAD_TIMEOUT_S), optional=True)


@dataclass(frozen=True)
class KeysArgs:
    keys: list[PageKey] = wire(Keys())


@dataclass(frozen=True)
class ClearArgs:
    tiers: list[str] = wire(TierNames())
    all_namespaces: bool = wire(Bool())
    namespace: str | None = wire(Str(), optional=True)


@dataclass(frozen=True)
class EvictArgs:
    tier: str = wire(Str(TIER_NAMES))
    bytes: int = wire(Int(1))
    component: str | None = wire(Str(COMPONENT_NAMES), optional=True)


@dataclass(frozen=True)
class PinPrefixArgs:
    tokens: list[int] = wire(Tokens())
    ttl_s: float = wire(Float(0.001, MAX_PIN_TTL_S))
    namespace: str | None = wire(Str(), optional=True)


@dataclass(frozen=True)
class FsckArgs:
    repair: bool = wire(Bool())


@dataclass(frozen=True)
class ScoreArgs:
    """A prompt's pages: its page hashes, or its tokens (and namespace) hashed by the
    sidecar with the served layout; exactly one of the two."""

    hashes: bytes | None = wire(Hashes(MAX_LOOKUP_HASHES), optional=True)
    tokens: list[int] | None = wire(Tokens(), optional=True)
    namespace: str | None = wire(Str(), optional=True)
    sliding_window: int | None = wire(Int(1), optional=True)  # tokens; needed with SWA


@dataclass(frozen=True)
class ExplainArgs:
    """What to explain, exactly one of: a prompt's page hashes; its tokens (and
    namespace), hashed by the sidecar with the served layout; or an engine's last
    ``last`` lookups (``engine``: its engine id, as ``hicachectl engines`` lists it)."""

    hashes: bytes | None = wire(Hashes(MAX_LOOKUP_HASHES), optional=True)
    tokens: list[int] | None = wire(Tokens(), optional=True)
    namespace: str | None = wire(Str(), optional=True)
    engine: str | None = wire(Str(), optional=True)
    last: int | None = wire(Int(1), optional=True)


# -- result records -----------------------------------------------------------------------


@dataclass(frozen=True)
class Empty:
    pass


@dataclass(frozen=True)
class HelloReply:
    protocol: int = wire(Int())
    server_version: str = wire(Str())
    pid: int = wire(Int())
    lease_s: float = wire(Float(0.0, float("inf")))
    heartbeat_interval_s: float = wire(Float(0.0, float("inf")))
    max_message_bytes: int = wire(Int())
    # This sidecar process's random id: a pin id or a host page names something only in
    # the instance that issued it (a session of another may hand it on).
    instance: int | None = wire(Int(), optional=True)


@dataclass(frozen=True)
class RegisterReply:
    capacity: dict = wire(Map())  # slots or states per component name
    fenced: bool = wire(Bool())  # every request of the engine's earlier sessions ended


@dataclass(frozen=True)
class HeartbeatReply:
    lease_s: float = wire(Float(0.0, float("inf")))


@dataclass(frozen=True)
class LookupReply:
    presence: list[bytes] = wire(BinList())  # int8 per page, one row per component asked


@dataclass(frozen=True)
class OkReply:
    ok: bool = wire(Bool())


@dataclass(frozen=True)
class StoreBeginReply:
    store_id: int = wire(Int())
    # int32 per ref: the host page to write, -1 held already (nothing to write), -2 no room.
    host_pages: bytes = wire(Bin())


@dataclass(frozen=True)
class StoreCommitReply:
    pages: int = wire(Int())  # published; 0 for a store past its deadline or aborted


@dataclass(frozen=True)
class PinReply:
    pin_id: int | None = wire(Nullable(Int()))  # nil: a page was absent, nothing pinned
    ttl_s: float | None = wire(Float(0.0, float("inf")), optional=True)
    # Asked for (PinArgs.host_pages) and shared: int32 per key, -1 for a page not on host.
    host_pages: bytes | None = wire(Bin(), optional=True)


@dataclass(frozen=True)
class ClearReply:
    host_pages: int = wire(Int())
    disk_pages: int = wire(Int())
    kept_pages: int = wire(Int())  # in scope but pinned, busy, or the head of a kept page


@dataclass(frozen=True)
class EvictReply:
    pages: int = wire(Int())
    bytes: int = wire(Int())


@dataclass(frozen=True)
class PinPrefixReply:
    pin_id: int | None = wire(Nullable(Int()))
    pages: int = wire(Int())
    tokens: int = wire(Int())
    ttl_s: float | None = wire(Float(0.0, float("inf")), optional=True)


@dataclass(frozen=True)
class FsckReply:
    checked: int = wire(Int())
    ok: int = wire(Int())
    corrupt: int = wire(Int())
    foreign: int = wire(Int())
    repaired: int = wire(Int())
    layout_unchecked: int = wire(Int())


@dataclass(frozen=True)
class ScoreReply:
    page_size: int = wire(Int())
    pages: int = wire(Int())  # of the prompt
    resumable: dict = wire(Map())  # pages per tier name, counting the faster tiers too
    kv_pages: dict = wire(Map())  # the leading run of FULL pages alone, the same way


# A document whose shape is the controller's (stats, status, health, the engine table):
# decoded as a map; the admin tools print it as it comes.
OPEN = None


# -- the table ----------------------------------------------------------------------------

ENGINE = frozenset({Role.ENGINE})
ADMIN = frozenset({Role.ADMIN})
BOTH = ENGINE | ADMIN


@dataclass(frozen=True)
class VerbSpec:
    """One verb: what it takes, what it answers, where it runs, who may send it."""

    verb: Verb
    args: type
    reply: type | None  # None: an open document (OPEN)
    runs: Runs
    roles: frozenset[Role]
    needs_registration: bool = False  # it addresses the engine's device memory
    pages_column: str | None = None  # IO_OR_LANE/IO_OR_WORKER: the argument whose size decides
    # It waits on the remote cluster when a remote tier is configured: never on the I/O
    # thread, which serves every engine.
    waits_on_remote: bool = False

    def place(self, args: Any, remote_tier: bool) -> Place:
        """Where a request of this verb with (undecoded) ``args`` runs; the one answer the
        server acts on."""
        if self.waits_on_remote and remote_tier:
            return Place.WORKER
        if self.runs is Runs.IO:
            return Place.IO
        if self.runs is Runs.WORKER:
            return Place.WORKER
        large = page_count(args, self.pages_column) > INLINE_MAX_PAGES
        if self.runs is Runs.IO_OR_LANE:
            return Place.LANE if large else Place.IO
        return Place.WORKER if large else Place.INLINE_COPY

    def decode_args(self, args: Any) -> Any:
        """The request's arguments as this verb's record; BAD_ARGS naming what is wrong."""
        return decode_record(self.args, args, self.verb.value)

    def encode_args(self, args: Any) -> dict[str, Any]:
        """The argument record as the map sent; a map is sent as it is (what a probe or a
        test of the server's checks builds by hand)."""
        return args if isinstance(args, dict) else encode_record(args)

    def encode_reply(self, reply: Any) -> dict[str, Any]:
        return reply if self.reply is None else encode_record(reply)

    def decode_reply(self, result: Any) -> Any:
        """A reply's ``result`` as this verb's record (a map for an open document)."""
        if self.reply is None:
            if not isinstance(result, dict):
                raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{self.verb.value}: bad reply")
            return result
        try:
            return decode_record(self.reply, result, f"{self.verb.value} reply")
        except ProtocolError as exc:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, exc.message) from None


def _spec(verb: Verb, args: type, reply: type | None, runs: Runs, roles, **kw: Any) -> VerbSpec:
    return VerbSpec(verb, args, reply, runs, roles, **kw)


SPECS: dict[Verb, VerbSpec] = {
    s.verb: s
    for s in (
        _spec(Verb.HELLO, HelloArgs, HelloReply, Runs.IO, BOTH),
        _spec(Verb.REGISTER, RegisterArgs, RegisterReply, Runs.WORKER, ENGINE),
        _spec(Verb.HEARTBEAT, NoArgs, HeartbeatReply, Runs.IO, BOTH),
        _spec(
            Verb.LOOKUP,
            LookupArgs,
            LookupReply,
            Runs.IO_OR_LANE,
            ENGINE,
            pages_column="hashes",
            waits_on_remote=True,
        ),
        _spec(
            Verb.BACKUP,
            BackupArgs,
            OkReply,
            Runs.IO_OR_WORKER,
            ENGINE,
            needs_registration=True,
            pages_column="refs",
        ),
        _spec(Verb.PIN, PinArgs, PinReply, Runs.IO_OR_LANE, ENGINE, pages_column="keys"),
        _spec(
            Verb.LOAD,
            LoadArgs,
            OkReply,
            Runs.IO_OR_WORKER,
            ENGINE,
            needs_registration=True,
            pages_column="refs",
        ),
        _spec(Verb.UNPIN, UnpinArgs, Empty, Runs.IO, ENGINE),
        _spec(Verb.STORE_BEGIN, StoreBeginArgs, StoreBeginReply, Runs.IO, ENGINE),
        _spec(Verb.STORE_COMMIT, StoreCommitArgs, StoreCommitReply, Runs.IO, ENGINE),
        _spec(Verb.PREFETCH, KeysArgs, OkReply, Runs.WORKER, ENGINE),
        _spec(Verb.STATS, NoArgs, OPEN, Runs.IO, BOTH),
        _spec(Verb.BYE, NoArgs, Empty, Runs.IO, BOTH),
        _spec(Verb.HEALTH, NoArgs, OPEN, Runs.IO, BOTH),
        _spec(Verb.STATUS, NoArgs, OPEN, Runs.IO, ADMIN, waits_on_remote=True),
        _spec(Verb.ENGINES, NoArgs, OPEN, Runs.IO, ADMIN),
        _spec(Verb.CLEAR, ClearArgs, ClearReply, Runs.WORKER, ADMIN),
        _spec(Verb.EVICT, EvictArgs, EvictReply, Runs.WORKER, ADMIN),
        _spec(Verb.PIN_PREFIX, PinPrefixArgs, PinPrefixReply, Runs.WORKER, ADMIN),
        _spec(Verb.UNPIN_PREFIX, PinIdArgs, Empty, Runs.IO, ADMIN),
        _spec(Verb.FSCK, FsckArgs, FsckReply, Runs.WORKER, ADMIN),
        _spec(Verb.SCORE, ScoreArgs, ScoreReply, Runs.WORKER, BOTH),
        _spec(Verb.EXPLAIN, ExplainArgs, OPEN, Runs.WORKER, ADMIN, waits_on_remote=True),
    )
}
assert set(SPECS) == set(Verb), "every verb has a spec"
