"""The sidecar's wire protocol: message vocabulary, msgpack framing and validation.

Every message is one ZeroMQ frame holding one msgpack map (no pickle, no msgpack
extension types). An engine or admin tool talks through a DEALER socket to the
sidecar's ROUTER socket; requests carry an ``id`` that the reply repeats, so a client may
have several requests in flight. See docs/protocol.md for the full description.

Request::

    {"v": 1, "id": <int>, "verb": <str>, "ttl_ms": <int>, "args": {...}}

Reply::

    {"id": <int>, "ok": true, "result": {...}}
    {"id": <int|nil>, "ok": false, "error": {"code": <str>, "message": <str>}}
    {"id": <int>, "progress": {"done": <int>, "total": <int>}}   (long admin verbs)

Page references travel as columns (one ``bin`` per field) rather than one map per page:
a load of ten thousand pages is four byte strings, which msgpack packs and unpacks at
memory speed.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from hicache.controller_api import PageKey, PageRef
from hicache.keys import HASH_BYTES
from hicache.types import ComponentType, ConfigError, HicacheError

if TYPE_CHECKING:
    from hicache.layout import ModelLayout

PROTOCOL_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
SOCKET_NAME = "hicache.sock"
ADMIN_TOKEN_NAME = "admin.token"

# Bounds on single values inside a message, whatever the message size limit: a name or a
# dtype is never long, and no legitimate request lists more than a million pages.
_MAX_STR = 4096
_MAX_PAGES = 1 << 20
_MAX_TTL_MS = 3_600_000

# Per-request work (docs/protocol.md, "Limits"): a lookup names at most this many
# hashes and a pin at most this many keys (4 M tokens of pages of 16); more is refused
# with bad_args, and SidecarController splits its own larger lookups. Requests above
# INLINE_MAX_PAGES leave the I/O thread for the fair lane (controller/fair_lane.py) and
# are worked through in chunks of WORK_CHUNK_PAGES, the I/O thread running in between.
MAX_LOOKUP_HASHES = 1 << 18
MAX_PIN_KEYS = 1 << 18
INLINE_MAX_PAGES = 1024
WORK_CHUNK_PAGES = 1024
_COMPONENT_TAGS = frozenset(int(c) for c in ComponentType)

# Bounds on what one message may decode to. Every empty msgpack map or array is one byte
# and becomes a Python object of 56 bytes or more, so a message within max_message_bytes
# could otherwise expand some 70-fold (16 MiB into a gigabyte, and a second of the I/O
# thread). No legitimate message holds more than a few hundred maps and arrays (the
# largest: an `engines` reply, one map per connection) or a map of more than a few dozen
# entries. The one long array is pin_prefix's token list, at least one byte per token, so
# arrays are bounded by the message's size; so are strings and binaries (page columns).
_MAX_CONTAINERS = 1 << 14  # maps and arrays in one message, nested ones included
_MAX_MAP_ENTRIES = 1 << 12
# What finding the id of an undecodable request may buffer (an envelope field is small).
_ID_PEEK_BYTES = 1 << 12


class Role(enum.Enum):
    """What a connection may do, fixed by its handshake."""

    ENGINE = "engine"
    ADMIN = "admin"


class ErrorCode(enum.Enum):
    """Why a request was refused; the ``code`` of an error reply."""

    BAD_MESSAGE = "bad_message"  # not one msgpack map, or a bad envelope
    TOO_LARGE = "too_large"  # over max_message_bytes: not decoded at all
    UNKNOWN_VERB = "unknown_verb"
    BAD_ARGS = "bad_args"  # a missing, mistyped or out-of-range argument
    NO_SESSION = "no_session"  # no handshake on this connection (or the sidecar restarted)
    OUT_OF_ORDER = "out_of_order"  # e.g. a second hello, or a load before register
    VERSION_MISMATCH = "version_mismatch"
    LAYOUT_MISMATCH = "layout_mismatch"
    FORBIDDEN = "forbidden"  # an admin verb on an engine connection, a bad admin token
    REGISTRATION_REFUSED = "registration_refused"  # device memory could not be mapped
    DEADLINE_EXCEEDED = "deadline_exceeded"
    BUSY = "busy"  # too many requests in flight; retry later
    SHUTTING_DOWN = "shutting_down"
    CONTROLLER_ERROR = "controller_error"  # the controller refused the call
    INTERNAL = "internal"  # a bug: the sidecar logged it


class ProtocolError(HicacheError):
    """A message the sidecar (or client) refuses; ``code`` says which kind of refusal."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Verb(enum.Enum):
    """Every request a connection can make. ``admin``: only on an admin connection."""

    HELLO = "hello"
    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    LOOKUP = "lookup"
    BACKUP = "backup"
    PIN = "pin"
    LOAD = "load"
    UNPIN = "unpin"
    PREFETCH = "prefetch"
    STATS = "stats"
    BYE = "bye"
    HEALTH = "health"
    STATUS = "status"
    ENGINES = "engines"
    CLEAR = "clear"
    EVICT = "evict"
    PIN_PREFIX = "pin_prefix"
    UNPIN_PREFIX = "unpin_prefix"
    FSCK = "fsck"

    @property
    def admin(self) -> bool:
        return self in _ADMIN_VERBS

    @property
    def needs_registration(self) -> bool:
        """Verbs that address the engine's device memory."""
        return self in (Verb.BACKUP, Verb.LOAD)


_ADMIN_VERBS = frozenset(
    {
        Verb.STATUS,
        Verb.ENGINES,
        Verb.CLEAR,
        Verb.EVICT,
        Verb.PIN_PREFIX,
        Verb.UNPIN_PREFIX,
        Verb.FSCK,
    }
)
_VERBS = {v.value: v for v in Verb}


@dataclass(frozen=True)
class Request:
    """A decoded, envelope-checked request (its ``args`` are checked per verb later)."""

    id: int
    verb: Verb
    ttl_s: float
    args: dict[str, Any]


# -- framing ------------------------------------------------------------------------------


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def pack(obj: Any) -> bytes:
    """One message as msgpack bytes (``bin`` for bytes, ``str`` for text)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, max_bytes: int) -> Any:
    """Decode one message; raises ProtocolError (TOO_LARGE or BAD_MESSAGE).

    What is built stays within a small multiple of the message's size: a message with
    more than ``_MAX_CONTAINERS`` maps and arrays, a map of more than ``_MAX_MAP_ENTRIES``
    entries, or an array, string or binary longer than the message itself is refused
    (BAD_MESSAGE) while it is decoded, without building the rest.
    """
    if len(data) > max_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"message of {len(data)} bytes exceeds the limit of {max_bytes} bytes; "
            "split the request",
        )
    containers = 0

    def count_container(container: Any) -> Any:
        nonlocal containers
        containers += 1
        if containers > _MAX_CONTAINERS:
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE,
                f"a message holds at most {_MAX_CONTAINERS} maps and arrays; no request needs more",
            )
        return container

    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_no_ext,
            object_hook=count_container,
            list_hook=count_container,
            # Each item takes at least one byte, and msgpack allocates an array's slots
            # from its header, before reading them: bound by what this message can hold.
            max_array_len=len(data),
            max_map_len=min(len(data) // 2, _MAX_MAP_ENTRIES),
            max_str_len=len(data),
            max_bin_len=len(data),
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE, f"not a valid msgpack message ({type(exc).__name__}: {exc})"
        ) from None


def _peek_request_id(data: bytes) -> int | None:
    """The ``id`` of a request that could not be decoded, so that the error reply can name
    it and its sender need not wait out its timeout. Only the envelope's keys and ``id``
    are built; the fields before it are skipped. None when the message is not a map with
    an integer ``id`` among its first five fields."""
    head = msgpack.Unpacker(
        io.BytesIO(data),
        read_size=_ID_PEEK_BYTES,
        max_buffer_size=_ID_PEEK_BYTES,
        raw=False,
        max_array_len=0,
        max_map_len=0,
        ext_hook=_no_ext,
    )
    try:
        for _ in range(min(head.read_map_header(), 5)):
            key = head.unpack()
            if key == "id":
                req_id = head.unpack()
                return req_id if type(req_id) is int and 0 <= req_id < 1 << 63 else None
            head.skip()
    except Exception:  # not a map, a key that is not a short string, a huge field, ...
        return None
    return None


def encode_request(req_id: int, verb: Verb, args: dict[str, Any], ttl_s: float) -> bytes:
    ttl_ms = max(1, min(_MAX_TTL_MS, math.ceil(ttl_s * 1000)))
    return pack(
        {"v": PROTOCOL_VERSION, "id": req_id, "verb": verb.value, "ttl_ms": ttl_ms, "args": args}
    )


def decode_request(data: bytes, max_bytes: int) -> Request:
    """Decode and check a request's envelope; raises ProtocolError saying what is wrong.

    The error carries the request id when one could be read, so the reply can name it.
    """
    try:
        msg = unpack(data, max_bytes)
    except ProtocolError as exc:
        exc.request_id = _peek_request_id(data)  # type: ignore[attr-defined]
        raise
    if not isinstance(msg, dict):
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE, f"a request is a msgpack map, got {type(msg).__name__}"
        )
    req_id = msg.get("id")
    if type(req_id) is not int or not 0 <= req_id < 1 << 63:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a request needs an integer 'id' >= 0")
    try:
        version = msg.get("v")
        # ``type(...) is int``: 1.0 and true equal 1 in Python, but are not version 1.
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"protocol version {version!r} is not supported; this sidecar speaks "
                f"version {PROTOCOL_VERSION}: upgrade the client or the sidecar",
            )
        verb_name = msg.get("verb")
        if not isinstance(verb_name, str):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "a request needs a string 'verb'")
        verb = _VERBS.get(verb_name)
        if verb is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_VERB,
                f"unknown verb {verb_name[:64]!r}; known verbs: {', '.join(sorted(_VERBS))}",
            )
        ttl_ms = msg.get("ttl_ms")
        if type(ttl_ms) is not int or not 0 < ttl_ms <= _MAX_TTL_MS:
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE,
                f"'ttl_ms' must be an integer in 1..{_MAX_TTL_MS} (the request's deadline)",
            )
        args = msg.get("args")
        if not isinstance(args, dict):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "a request needs an 'args' map")
        extra = set(msg) - {"v", "id", "verb", "ttl_ms", "args"}
        if extra:
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE, f"unknown envelope field(s) {sorted(map(str, extra))}"
            )
    except ProtocolError as exc:
        exc.request_id = req_id  # type: ignore[attr-defined]
        raise
    return Request(req_id, verb, ttl_ms / 1000.0, args)


def ok_reply(req_id: int, result: dict[str, Any]) -> bytes:
    return pack({"id": req_id, "ok": True, "result": result})


def error_reply(req_id: int | None, code: ErrorCode, message: str) -> bytes:
    return pack({"id": req_id, "ok": False, "error": {"code": code.value, "message": message}})


def progress_reply(req_id: int, done: int, total: int) -> bytes:
    return pack({"id": req_id, "progress": {"done": done, "total": total}})


# -- argument checks ----------------------------------------------------------------------


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_ARGS, message)


class Args:
    """Typed access to a request's ``args`` map; every getter raises BAD_ARGS on misuse."""

    def __init__(self, verb: Verb, args: dict[str, Any], allowed: Sequence[str]) -> None:
        extra = set(args) - set(allowed)
        if extra:
            raise _bad(
                f"{verb.value}: unknown argument(s) {sorted(map(str, extra))}; "
                f"allowed: {sorted(allowed)}"
            )
        self.verb = verb
        self.args = args

    def _get(self, name: str, required: bool) -> Any:
        if name not in self.args:
            if required:
                raise _bad(f"{self.verb.value}: missing argument {name!r}")
            return None
        return self.args[name]

    def int(self, name: str, lo: int = 0, hi: int = 1 << 62, required: bool = True) -> Any:
        v = self._get(name, required)
        if v is None and not required:
            return None
        if type(v) is not int or not lo <= v <= hi:
            raise _bad(f"{self.verb.value}: {name!r} must be an integer in {lo}..{hi}")
        return v

    def float(self, name: str, lo: float, hi: float, required: bool = True) -> Any:
        v = self._get(name, required)
        if v is None and not required:
            return None
        if type(v) not in (int, float) or not (math.isfinite(v) and lo <= v <= hi):
            raise _bad(f"{self.verb.value}: {name!r} must be a number in {lo}..{hi}")
        return float(v)

    def str(self, name: str, required: bool = True, choices: Sequence[str] = ()) -> Any:
        v = self._get(name, required)
        if v is None and not required:
            return None
        if not isinstance(v, str) or len(v) > _MAX_STR:
            raise _bad(f"{self.verb.value}: {name!r} must be a string of <= {_MAX_STR} chars")
        if choices and v not in choices:
            raise _bad(f"{self.verb.value}: {name!r} must be one of {list(choices)}, got {v!r}")
        return v

    def bytes(self, name: str, length: int | None = None, required: bool = True) -> Any:
        v = self._get(name, required)
        if v is None and not required:
            return None
        if not isinstance(v, bytes) or (length is not None and len(v) != length):
            size = "" if length is None else f" of {length} bytes"
            raise _bad(f"{self.verb.value}: {name!r} must be binary{size}")
        return v

    def bool(self, name: str, required: bool = True) -> Any:
        v = self._get(name, required)
        if v is None and not required:
            return None
        if not isinstance(v, bool):
            raise _bad(f"{self.verb.value}: {name!r} must be true or false")
        return v

    def map(self, name: str, required: bool = True) -> Any:
        v = self._get(name, required)
        if v is None and not required:
            return None
        if not isinstance(v, dict):
            raise _bad(f"{self.verb.value}: {name!r} must be a map")
        return v

    def int_list(self, name: str, max_len: int = 64, required: bool = True) -> Any:
        v = self._get(name, required)
        if v is None and not required:
            return None
        if (
            not isinstance(v, list)
            or len(v) > max_len
            or not all(type(x) is int and 0 <= x < 1 << 62 for x in v)
        ):
            raise _bad(f"{self.verb.value}: {name!r} must be a list of <= {max_len} integers")
        return v


# -- layouts ------------------------------------------------------------------------------

_MAX_LAYERS = 4096
_LAYOUT_INTS = ("num_kv_heads", "head_dim", "conv_dim", "conv_kernel", "tp_rank", "tp_size")
_LAYOUT_STRS = ("model_id", "dtype", "state_dtype")


def decode_layout(v: Any, where: str) -> ModelLayout:
    """A layout sent on the wire, every field's type checked before the layout is built:
    raises BAD_ARGS naming the field (``where``: the verb and argument, for the message)."""
    from hicache.layout import ModelLayout  # torch: not for hicachectl, which never calls this

    if not isinstance(v, dict):
        raise _bad(f"{where} must be a map of layout fields")
    known = {f.name for f in dataclasses.fields(ModelLayout)}
    unknown = set(v) - known
    if unknown:
        raise _bad(f"{where}: unknown field(s) {sorted(map(str, unknown))}; known: {sorted(known)}")
    kinds = v.get("layer_kinds")
    if (
        not isinstance(kinds, list)
        or not 0 < len(kinds) <= _MAX_LAYERS
        or not all(isinstance(k, str) and len(k) <= 16 for k in kinds)
    ):
        raise _bad(f"{where}.layer_kinds must be a list of 1..{_MAX_LAYERS} layer kind names")
    for name in _LAYOUT_INTS:
        if name in v and (type(v[name]) is not int or not 0 <= v[name] < 1 << 30):
            raise _bad(f"{where}.{name} must be an integer in 0..{(1 << 30) - 1}")
    for name in _LAYOUT_STRS:
        if name in v and (not isinstance(v[name], str) or not 0 < len(v[name]) <= _MAX_STR):
            raise _bad(f"{where}.{name} must be a string of 1..{_MAX_STR} characters")
    shape = v.get("ssm_state_shape", [])
    if (
        not isinstance(shape, list)
        or len(shape) > 8
        or not all(type(n) is int and 0 < n < 1 << 30 for n in shape)
    ):
        raise _bad(f"{where}.ssm_state_shape must be a list of <= 8 positive integers")
    try:
        return ModelLayout.from_dict(v)
    except (ConfigError, TypeError, KeyError, ValueError) as exc:
        raise _bad(f"{where}: bad layout ({exc})") from None


# -- page columns -------------------------------------------------------------------------


def _column(v: Any, name: str, itemsize: int, n: int | None) -> bytes:
    if not isinstance(v, bytes) or len(v) % itemsize:
        raise _bad(f"page column {name!r} must be binary, a multiple of {itemsize} bytes")
    if n is not None and len(v) != n * itemsize:
        raise _bad(f"page column {name!r} holds {len(v) // itemsize} items, expected {n}")
    return v


_COMPONENT_BY_TAG = {int(c): c for c in ComponentType}


def _components(raw: bytes) -> list[ComponentType]:
    tags = np.frombuffer(raw, dtype=np.uint8)
    if tags.size > _MAX_PAGES:
        raise _bad(f"at most {_MAX_PAGES} pages per request")
    bad = set(np.unique(tags).tolist()) - _COMPONENT_TAGS
    if bad:
        raise _bad(f"unknown component tag(s) {sorted(bad)}; known: {sorted(_COMPONENT_TAGS)}")
    by_tag = _COMPONENT_BY_TAG  # a dict lookup: an enum call per page costs ~1 µs
    return [by_tag[t] for t in tags.tolist()]


def _split_hashes(raw: bytes) -> list[bytes]:
    return [raw[i : i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]


def encode_hashes(hashes: Sequence[bytes]) -> bytes:
    if any(len(h) != HASH_BYTES for h in hashes):
        raise ValueError(f"page hashes must be {HASH_BYTES} bytes")
    return b"".join(hashes)


def hash_column(v: Any, limit: int = _MAX_PAGES) -> bytes:
    """A ``hashes`` argument checked (whole hashes, at most ``limit``), not yet split."""
    raw = _column(v, "hashes", HASH_BYTES, None)
    if len(raw) // HASH_BYTES > limit:
        raise _bad(f"{len(raw) // HASH_BYTES} hashes in one request; at most {limit}: split it")
    return raw


def decode_hashes(v: Any, limit: int = _MAX_PAGES) -> list[bytes]:
    return _split_hashes(hash_column(v, limit))


def page_count(args: dict[str, Any], verb: Verb) -> int:
    """How many pages a lookup or pin names, read from its column's length without
    decoding it (0 when the column is malformed: the handler refuses it)."""
    column = args.get("hashes") if verb is Verb.LOOKUP else args.get("keys")
    if isinstance(column, dict):
        column = column.get("h")
    return len(column) // HASH_BYTES if isinstance(column, bytes) else 0


def encode_refs(refs: Sequence[PageRef]) -> dict[str, bytes]:
    """Page references as four columns: component tags, hashes, parents, device indices."""
    return {
        "c": bytes(int(r.component) for r in refs),
        "h": encode_hashes([r.page_hash for r in refs]),
        "p": encode_hashes([r.parent_hash for r in refs]),
        "d": np.asarray([r.device_index for r in refs], dtype="<i8").tobytes(),
    }


def decode_refs(v: Any) -> list[PageRef]:
    if not isinstance(v, dict) or set(v) != {"c", "h", "p", "d"}:
        raise _bad("'refs' must be a map of the columns c, h, p and d")
    comps = _components(_column(v["c"], "c", 1, None))
    n = len(comps)
    hashes = _split_hashes(_column(v["h"], "h", HASH_BYTES, n))
    parents = _split_hashes(_column(v["p"], "p", HASH_BYTES, n))
    index = np.frombuffer(_column(v["d"], "d", 8, n), dtype="<i8")
    if index.size and index.min() < 0:
        raise _bad("device indices must be >= 0")
    return [PageRef(c, h, p, d) for c, h, p, d in zip(comps, hashes, parents, index.tolist())]


def encode_keys(keys: Sequence[PageKey]) -> dict[str, bytes]:
    return {
        "c": bytes(int(k.component) for k in keys),
        "h": encode_hashes([k.page_hash for k in keys]),
    }


def decode_keys(
    v: Any, limit: int = _MAX_PAGES, between_chunks: Callable[[], None] | None = None
) -> list[PageKey]:
    """The keys of a ``keys`` argument (at most ``limit``); ``between_chunks`` is called
    after each WORK_CHUNK_PAGES keys built, so that a long decode lets others run."""
    if not isinstance(v, dict) or set(v) != {"c", "h"}:
        raise _bad("'keys' must be a map of the columns c and h")
    tags = _column(v["c"], "c", 1, None)
    if len(tags) > limit:
        raise _bad(f"{len(tags)} keys in one request; at most {limit}: split it")
    comps = _components(tags)
    raw = _column(v["h"], "h", HASH_BYTES, len(comps))
    keys: list[PageKey] = []
    for start in range(0, len(comps), WORK_CHUNK_PAGES):
        if start and between_chunks is not None:
            between_chunks()
        end = min(start + WORK_CHUNK_PAGES, len(comps))
        hashes = _split_hashes(raw[start * HASH_BYTES : end * HASH_BYTES])
        keys += [PageKey(c, h) for c, h in zip(comps[start:end], hashes)]
    return keys


def decode_component_list(values: list[int]) -> list[ComponentType]:
    bad = [v for v in values if v not in _COMPONENT_TAGS]
    if bad:
        raise _bad(f"unknown component tag(s) {bad}; known: {sorted(_COMPONENT_TAGS)}")
    return [ComponentType(v) for v in values]


# -- endpoints ----------------------------------------------------------------------------


def default_runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/hicache``, else a per-user directory under the temp dir."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "hicache"
    return Path(tempfile.gettempdir()) / f"hicache-{os.getuid()}"


def default_endpoint() -> str:
    """The endpoint a client uses when none is given: ``$HICACHE_ENDPOINT`` or the default
    Unix socket."""
    env = os.environ.get("HICACHE_ENDPOINT")
    if env:
        return normalize_endpoint(env)
    return "ipc://" + str(default_runtime_dir() / SOCKET_NAME)


def normalize_endpoint(endpoint: str | os.PathLike) -> str:
    """``ipc://…`` and ``tcp://…`` pass; a bare path becomes an ``ipc://`` endpoint."""
    s = os.fspath(endpoint)
    if s.startswith(("ipc://", "tcp://")):
        return s
    if "://" in s:
        raise HicacheError(f"endpoint {s!r}: only ipc:// and tcp:// are supported")
    return "ipc://" + str(Path(s).absolute())


def socket_dir(endpoint: str) -> Path | None:
    """The directory of an ``ipc://`` endpoint's socket (where the admin token lives)."""
    if endpoint.startswith("ipc://"):
        return Path(endpoint[len("ipc://") :]).parent
    return None
