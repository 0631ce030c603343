"""The field types of the sidecar protocol: how each argument and result is checked when
it is decoded and built when it is encoded.

A verb's arguments and its result are dataclass records (:mod:`hicache.controller.
wire.verbs`) whose fields name a codec here; :func:`decode_record` checks a map against
a record (unknown names, missing ones, each value's type and range: BAD_ARGS naming the
field) and :func:`encode_record` builds the map. Page references travel as columns (one
``bin`` per field) rather than one map per page: a load of ten thousand pages is four
byte strings, which msgpack packs and unpacks at memory speed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from hicache.controller.wire.protocol import ErrorCode, ProtocolError
from hicache.controller_api import PageKey, PageRef, page_keys_of, page_refs_of
from hicache.engine_keys import checked_engine_keys
from hicache.keys import HASH_BYTES
from hicache.types import ComponentType, ConfigError

if TYPE_CHECKING:
    from hicache.layout import ModelLayout

# Bounds on single values inside a message, whatever the message size limit: a name or a
# dtype is never long, and no legitimate request lists more than a million pages.
MAX_STR_CHARS = 4096
MAX_PAGES = 1 << 20
_COMPONENT_TAGS = frozenset(int(c) for c in ComponentType)
_COMPONENT_BY_TAG = {int(c): c for c in ComponentType}
_REF_COLUMNS = frozenset({"c", "h", "p", "d", "e"})

# Per-request work (docs/protocol.md, "Limits"): a lookup names at most this many
# hashes and a pin at most this many keys (4 M tokens of pages of 16); more is refused
# with bad_args, and SidecarController splits its own larger lookups. Requests above
# INLINE_MAX_PAGES leave the I/O thread for the fair lane (controller/sidecar/fair_lane.py) and
# are worked through in chunks of WORK_CHUNK_PAGES, the I/O thread running in between.
MAX_LOOKUP_HASHES = 1 << 18
MAX_PIN_KEYS = 1 << 18
INLINE_MAX_PAGES = 1024
WORK_CHUNK_PAGES = 1024


def yield_to_io() -> None:
    """Let the I/O thread run now (it may be waiting for the GIL or the store lock this
    thread just released), instead of at the interpreter's next forced switch."""
    time.sleep(0)


def bad_args(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_ARGS, message)


# -- codecs -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Int:
    lo: int = 0
    hi: int = 1 << 62

    def decode(self, v: Any, where: str) -> int:
        if type(v) is not int or not self.lo <= v <= self.hi:
            raise bad_args(f"{where} must be an integer in {self.lo}..{self.hi}")
        return v

    def encode(self, v: int) -> int:
        return int(v)


@dataclasses.dataclass(frozen=True)
class Float:
    lo: float
    hi: float

    def decode(self, v: Any, where: str) -> float:
        if type(v) not in (int, float) or not (math.isfinite(v) and self.lo <= v <= self.hi):
            raise bad_args(f"{where} must be a number in {self.lo}..{self.hi}")
        return float(v)

    def encode(self, v: float) -> float:
        return float(v)


@dataclasses.dataclass(frozen=True)
class Str:
    choices: tuple[str, ...] = ()

    def decode(self, v: Any, where: str) -> str:
        if not isinstance(v, str) or len(v) > MAX_STR_CHARS:
            raise bad_args(f"{where} must be a string of <= {MAX_STR_CHARS} chars")
        if self.choices and v not in self.choices:
            raise bad_args(f"{where} must be one of {list(self.choices)}, got {v!r}")
        return v

    def encode(self, v: str) -> str:
        return v


@dataclasses.dataclass(frozen=True)
class Bin:
    length: int | None = None

    def decode(self, v: Any, where: str) -> bytes:
        if not isinstance(v, bytes) or (self.length is not None and len(v) != self.length):
            size = "" if self.length is None else f" of {self.length} bytes"
            raise bad_args(f"{where} must be binary{size}")
        return v

    def encode(self, v: bytes) -> bytes:
        return bytes(v)


@dataclasses.dataclass(frozen=True)
class Bool:
    def decode(self, v: Any, where: str) -> bool:
        if not isinstance(v, bool):
            raise bad_args(f"{where} must be true or false")
        return v

    def encode(self, v: bool) -> bool:
        return bool(v)


@dataclasses.dataclass(frozen=True)
class Map:
    """A map checked by its consumer (a registration's buffers, a stats document)."""

    def decode(self, v: Any, where: str) -> dict:
        if not isinstance(v, dict):
            raise bad_args(f"{where} must be a map")
        return v

    def encode(self, v: dict) -> dict:
        return v


@dataclasses.dataclass(frozen=True)
class Nullable:
    """``inner``, or nil (a pin that pinned nothing has no id)."""

    inner: Any

    def decode(self, v: Any, where: str) -> Any:
        return None if v is None else self.inner.decode(v, where)

    def encode(self, v: Any) -> Any:
        return None if v is None else self.inner.encode(v)


@dataclasses.dataclass(frozen=True)
class BinList:
    """One ``bin`` per component (a lookup's presence rows)."""

    def decode(self, v: Any, where: str) -> list[bytes]:
        if not isinstance(v, list) or not all(isinstance(x, bytes) for x in v):
            raise bad_args(f"{where} must be a list of binaries")
        return v

    def encode(self, v: Sequence[bytes]) -> list[bytes]:
        return list(v)


@dataclasses.dataclass(frozen=True)
class Components:
    """Component tags, at most one of each kind of component."""

    def decode(self, v: Any, where: str) -> list[ComponentType]:
        if (
            not isinstance(v, list)
            or len(v) > len(_COMPONENT_TAGS)
            or not all(type(x) is int and 0 <= x < 1 << 62 for x in v)
        ):
            raise bad_args(f"{where} must be a list of <= {len(_COMPONENT_TAGS)} integers")
        bad = [x for x in v if x not in _COMPONENT_TAGS]
        if bad:
            raise bad_args(f"unknown component tag(s) {bad}; known: {sorted(_COMPONENT_TAGS)}")
        return [ComponentType(x) for x in v]

    def encode(self, v: Sequence[ComponentType]) -> list[int]:
        return [int(c) for c in v]


@dataclasses.dataclass(frozen=True)
class Tokens:
    """A prefix's token ids: a non-empty list of int64."""

    def decode(self, v: Any, where: str) -> list[int]:
        if (
            not isinstance(v, list)
            or not v
            or not all(type(t) is int and -(1 << 63) <= t < 1 << 63 for t in v)
        ):
            raise bad_args("'tokens' must be a non-empty list of int64")
        return v

    def encode(self, v: Sequence[int]) -> list[int]:
        return [int(t) for t in v]


@dataclasses.dataclass(frozen=True)
class TierNames:
    """A non-empty list of the tiers an admin names: ``host`` and/or ``disk``."""

    def decode(self, v: Any, where: str) -> list[str]:
        if not isinstance(v, list) or not v or any(t not in ("host", "disk") for t in v):
            raise bad_args(f"{where} must list 'host' and/or 'disk'")
        return v

    def encode(self, v: Sequence[str]) -> list[str]:
        return list(v)


@dataclasses.dataclass(frozen=True)
class Hashes:
    """Page hashes as one column, not split (a lookup splits it as it works through it)."""

    limit: int = MAX_PAGES

    def decode(self, v: Any, where: str) -> bytes:
        return hash_column(v, self.limit)

    def encode(self, v: bytes | Sequence[bytes]) -> bytes:
        return v if isinstance(v, bytes) else encode_hashes(v)


@dataclasses.dataclass(frozen=True)
class Refs:
    def decode(self, v: Any, where: str) -> list[PageRef]:
        return decode_refs(v)

    def encode(self, v: Sequence[PageRef]) -> dict[str, bytes]:
        return encode_refs(v)


@dataclasses.dataclass(frozen=True)
class Keys:
    """Page keys as two columns; built in chunks with ``between_chunks`` called between
    them, so a decode of many thousand keys lets the I/O thread run."""

    limit: int = MAX_PAGES
    between_chunks: Callable[[], None] | None = None

    def decode(self, v: Any, where: str) -> list[PageKey]:
        return decode_keys(v, self.limit, self.between_chunks)

    def encode(self, v: Sequence[PageKey]) -> dict[str, bytes]:
        return encode_keys(v)


@dataclasses.dataclass(frozen=True)
class Layout:
    def decode(self, v: Any, where: str) -> ModelLayout:
        return decode_layout(v, where.replace("'", ""))  # "hello: layout.model_id ..."

    def encode(self, v: ModelLayout) -> dict:
        return v.to_dict()


# -- records ------------------------------------------------------------------------------

R = TypeVar("R")


def wire(codec: Any, optional: bool = False) -> Any:
    """A record field carried as ``codec``; an optional one may be absent (or nil)."""
    if optional:
        return dataclasses.field(default=None, metadata={"codec": codec})
    return dataclasses.field(metadata={"codec": codec})


def field_names(record: type) -> list[str]:
    return [f.name for f in dataclasses.fields(record)]


def decode_record(record: type[R], values: Any, where: str) -> R:
    """``values`` (a request's args, or a reply's result) as ``record``; raises BAD_ARGS
    naming the first unknown, missing or mistyped field. ``where``: the verb, for the
    messages."""
    if not isinstance(values, dict):
        raise bad_args(f"{where}: expected a map of {field_names(record)}")
    fields = dataclasses.fields(record)
    allowed = {f.name for f in fields}
    unknown = set(values) - allowed
    if unknown:
        raise bad_args(
            f"{where}: unknown argument(s) {sorted(map(str, unknown))}; allowed: {sorted(allowed)}"
        )
    kw = {}
    for f in fields:
        v = values.get(f.name)
        optional = f.default is None
        if f.name not in values and not optional:
            raise bad_args(f"{where}: missing argument {f.name!r}")
        if v is None and optional:
            continue
        kw[f.name] = f.metadata["codec"].decode(v, f"{where}: {f.name!r}")
    return record(**kw)


def encode_record(value: Any) -> dict[str, Any]:
    """A record as the map that goes on the wire (optional fields left out when None)."""
    out = {}
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if v is None and f.default is None:
            continue
        out[f.name] = f.metadata["codec"].encode(v)
    return out


# -- page columns -------------------------------------------------------------------------


def _column(v: Any, name: str, itemsize: int, n: int | None) -> bytes:
    if not isinstance(v, bytes) or len(v) % itemsize:
        raise bad_args(f"page column {name!r} must be binary, a multiple of {itemsize} bytes")
    if n is not None and len(v) != n * itemsize:
        raise bad_args(f"page column {name!r} holds {len(v) // itemsize} items, expected {n}")
    return v


def _components(raw: bytes) -> list[ComponentType]:
    tags = np.frombuffer(raw, dtype=np.uint8)
    if tags.size > MAX_PAGES:
        raise bad_args(f"at most {MAX_PAGES} pages per request")
    listed = tags.tolist()
    # A set, not np.unique: its first call imports numpy.ma (9 ms, a first pin's).
    bad = set(listed) - _COMPONENT_TAGS
    if bad:
        raise bad_args(f"unknown component tag(s) {sorted(bad)}; known: {sorted(_COMPONENT_TAGS)}")
    by_tag = _COMPONENT_BY_TAG  # a dict lookup: an enum call per page costs ~1 µs
    return [by_tag[t] for t in listed]


def split_hashes(raw: bytes) -> list[bytes]:
    return [raw[i : i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]


def encode_hashes(hashes: Sequence[bytes]) -> bytes:
    if hashes and set(map(len, hashes)) != {HASH_BYTES}:
        raise ValueError(f"page hashes must be {HASH_BYTES} bytes")
    return b"".join(hashes)


def hash_column(v: Any, limit: int = MAX_PAGES) -> bytes:
    """A ``hashes`` argument checked (whole hashes, at most ``limit``), not yet split."""
    raw = _column(v, "hashes", HASH_BYTES, None)
    if len(raw) // HASH_BYTES > limit:
        raise bad_args(f"{len(raw) // HASH_BYTES} hashes in one request; at most {limit}: split it")
    return raw


def decode_hashes(v: Any, limit: int = MAX_PAGES) -> list[bytes]:
    return split_hashes(hash_column(v, limit))


def page_count(args: dict[str, Any], column_name: str) -> int:
    """How many pages a request's column names, read from its length without decoding it
    (0 when the column is malformed: its decode refuses it)."""
    column = args.get(column_name)
    if isinstance(column, dict):
        column = column.get("h")
    return len(column) // HASH_BYTES if isinstance(column, bytes) else 0


def encode_refs(refs: Sequence[PageRef]) -> dict[str, Any]:
    """Page references as four columns: component tags, hashes, parents, device indices;
    a fifth, ``e``, of engine keys (empty for none) when one of them carries one."""
    out: dict[str, Any] = {
        "c": bytes([r.component for r in refs]),
        "h": encode_hashes([r.page_hash for r in refs]),
        "p": encode_hashes([r.parent_hash for r in refs]),
        "d": np.asarray([r.device_index for r in refs], dtype="<i8").tobytes(),
    }
    if any(r.engine_key is not None for r in refs):
        out["e"] = [r.engine_key or b"" for r in refs]
    return out


def decode_refs(v: Any) -> list[PageRef]:
    if not isinstance(v, dict) or not {"c", "h", "p", "d"} <= set(v) <= _REF_COLUMNS:
        raise bad_args("'refs' must be a map of the columns c, h, p and d (and e)")
    comps = _components(_column(v["c"], "c", 1, None))
    n = len(comps)
    hashes = split_hashes(_column(v["h"], "h", HASH_BYTES, n))
    parents = split_hashes(_column(v["p"], "p", HASH_BYTES, n))
    index = np.frombuffer(_column(v["d"], "d", 8, n), dtype="<i8")
    if index.size and index.min() < 0:
        raise bad_args("device indices must be >= 0")
    if "e" not in v:
        return page_refs_of(comps, hashes, parents, index.tolist())
    try:
        keys = checked_engine_keys(v["e"], n)
    except ValueError as exc:
        raise bad_args(f"'refs.e': {exc}") from None
    return page_refs_of(comps, hashes, parents, index.tolist(), keys)


def encode_keys(keys: Sequence[PageKey]) -> dict[str, bytes]:
    return {
        "c": bytes([k.component for k in keys]),
        "h": encode_hashes([k.page_hash for k in keys]),
    }


def decode_keys(
    v: Any, limit: int = MAX_PAGES, between_chunks: Callable[[], None] | None = None
) -> list[PageKey]:
    """The keys of a ``keys`` argument (at most ``limit``); ``between_chunks`` is called
    after each WORK_CHUNK_PAGES keys built, so that a long decode lets others run."""
    if not isinstance(v, dict) or set(v) != {"c", "h"}:
        raise bad_args("'keys' must be a map of the columns c and h")
    tags = _column(v["c"], "c", 1, None)
    if len(tags) > limit:
        raise bad_args(f"{len(tags)} keys in one request; at most {limit}: split it")
    comps = _components(tags)
    raw = _column(v["h"], "h", HASH_BYTES, len(comps))
    keys: list[PageKey] = []
    for start in range(0, len(comps), WORK_CHUNK_PAGES):
        if start and between_chunks is not None:
            between_chunks()
        end = min(start + WORK_CHUNK_PAGES, len(comps))
        hashes = split_hashes(raw[start * HASH_BYTES : end * HASH_BYTES])
        keys += page_keys_of(comps[start:end], hashes)
    return keys


# -- layouts ------------------------------------------------------------------------------

_MAX_LAYERS = 4096
_LAYOUT_INTS = ("num_kv_heads", "head_dim", "conv_dim", "conv_kernel", "tp_rank", "tp_size")
_LAYOUT_STRS = ("model_id", "dtype", "state_dtype")


def decode_layout(v: Any, where: str) -> ModelLayout:
    """A layout sent on the wire, every field's type checked before the layout is built:
    raises BAD_ARGS naming the field (``where``: the verb and argument, for the message)."""
    from hicache.layout import ModelLayout  # torch: not for hicachectl, which never calls this

    if not isinstance(v, dict):
        raise bad_args(f"{where} must be a map of layout fields")
    known = {f.name for f in dataclasses.fields(ModelLayout)}
    unknown = set(v) - known
    if unknown:
        raise bad_args(
            f"{where}: unknown field(s) {sorted(map(str, unknown))}; known: {sorted(known)}"
        )
    kinds = v.get("layer_kinds")
    if (
        not isinstance(kinds, list)
        or not 0 < len(kinds) <= _MAX_LAYERS
        or not all(isinstance(k, str) and len(k) <= 16 for k in kinds)
    ):
        raise bad_args(f"{where}.layer_kinds must be a list of 1..{_MAX_LAYERS} layer kind names")
    for name in _LAYOUT_INTS:
        if name in v and (type(v[name]) is not int or not 0 <= v[name] < 1 << 30):
            raise bad_args(f"{where}.{name} must be an integer in 0..{(1 << 30) - 1}")
    for name in _LAYOUT_STRS:
        if name in v and (not isinstance(v[name], str) or not 0 < len(v[name]) <= MAX_STR_CHARS):
            raise bad_args(f"{where}.{name} must be a string of 1..{MAX_STR_CHARS} characters")
    shape = v.get("ssm_state_shape", [])
    if (
        not isinstance(shape, list)
        or len(shape) > 8
        or not all(type(n) is int and 0 < n < 1 << 30 for n in shape)
    ):
        raise bad_args(f"{where}.ssm_state_shape must be a list of <= 8 positive integers")
    tensors = v.get("state_tensors", [])
    if (
        not isinstance(tensors, list)
        or len(tensors) > 64
        or not all(
            isinstance(t, dict)
            and set(t) == {"name", "shape", "dtype"}
            and isinstance(t["name"], str)
            and 0 < len(t["name"]) <= 64
            and isinstance(t["dtype"], str)
            and isinstance(t["shape"], list)
            and 0 < len(t["shape"]) <= 8
            and all(type(n) is int and 0 < n < 1 << 30 for n in t["shape"])
            for t in tensors
        )
    ):
        raise bad_args(
            f"{where}.state_tensors must be a list of <= 64 maps of name, shape (positive "
            "integers) and dtype"
        )
    try:
        return ModelLayout.from_dict(v)
    except (ConfigError, TypeError, KeyError, ValueError) as exc:
        raise bad_args(f"{where}: bad layout ({exc})") from None
