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

What each verb takes and answers is :mod:`hicache.controller.wire.verbs`; the field
types (page columns, layouts) are :mod:`hicache.controller.wire.fields`.
"""

from __future__ import annotations

import enum
import io
import logging
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from hicache.controller_api import ControllerError
from hicache.types import HicacheError, LayoutMismatchError

if TYPE_CHECKING:
    pass

PROTOCOL_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
SOCKET_NAME = "hicache.sock"
ADMIN_TOKEN_NAME = "admin.token"

_MAX_TTL_MS = 3_600_000
# Shared by the sidecar and its clients: how often a waiting thread looks again (a copy
# that must settle, a reply), and the heartbeat interval the sidecar asks for by default.
SETTLE_POLL_S = 0.05
DEFAULT_HEARTBEAT_INTERVAL_S = 3.0

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
    """Every request a connection can make (each one's spec: :mod:`~hicache.controller.
    wire.verbs`)."""

    HELLO = "hello"
    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    LOOKUP = "lookup"
    BACKUP = "backup"
    PIN = "pin"
    LOAD = "load"
    UNPIN = "unpin"
    STORE_BEGIN = "store_begin"
    STORE_COMMIT = "store_commit"
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
    SCORE = "score"
    EXPLAIN = "explain"


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


# -- errors of handlers -------------------------------------------------------------------

_TRACEBACK_INTERVAL_S = 60.0
_log = logging.getLogger("hicache.sidecar")


class _TracebackLimiter:
    """Logs the traceback of an unexpected error at most once per ``interval_s``; the
    others in between are counted and reported with the next one. Anyone who can connect
    can trigger a bug as often as they like: the log must not grow with them."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last = -interval_s
        self._suppressed = 0
        self._lock = threading.Lock()

    def log(self, exc: BaseException) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval_s:
                self._suppressed += 1
                return
            self._last, suppressed, self._suppressed = now, self._suppressed, 0
        _log.error(
            "internal error (%d more since the last traceback, not shown)",
            suppressed,
            exc_info=(type(exc), exc, exc.__traceback__),
        )


_internal_errors = _TracebackLimiter(_TRACEBACK_INTERVAL_S)


def as_protocol_error(exc: Exception) -> ProtocolError:
    """The error reply an exception of a handler becomes: a controller's refusal says
    why; anything else is a bug, logged (with a rate-limited traceback) as ``internal``."""
    if isinstance(exc, ProtocolError):
        return exc
    if isinstance(exc, LayoutMismatchError):
        return ProtocolError(ErrorCode.LAYOUT_MISMATCH, str(exc))
    if isinstance(exc, (ControllerError, HicacheError)):
        return ProtocolError(ErrorCode.CONTROLLER_ERROR, str(exc))
    _internal_errors.log(exc)
    return ProtocolError(
        ErrorCode.INTERNAL, f"internal error ({type(exc).__name__}); see the sidecar log"
    )
