"""The one typed settings loader of every config of the controller and the sidecar.

A config is a dataclass whose annotations say each field's type. :func:`coerce` turns a
value from a TOML file, an environment variable or a flag into that type (sizes with
units, booleans from words, enums by value, lists from commas), naming the source and
the field when it cannot; :func:`config_to_dict` and :func:`config_from_dict` are the
JSON/msgpack-safe description of a config and its inverse, with unknown keys refused.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from hicache.types import ConfigError

C = TypeVar("C")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_size(value: Any, name: str) -> int:
    """Bytes from an int or a string with a unit (``4GiB``, ``512MB``, ``1048576``)."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}={value!r} is not a size; write e.g. 4GiB, 512MiB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclasses.dataclass(frozen=True)
class Field:
    """A config field as the loader reads it, from its annotation."""

    kind: Any  # bool, int, float, str, Path, list, or an enum class
    nullable: bool  # "none" (or nothing) sets it to None


def fields_of(cls: type) -> dict[str, Field]:
    """Each field of the config dataclass ``cls``, read from its type annotation."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        args = typing.get_args(hint) if union else (hint,)
        kinds = [a for a in args if a is not type(None)]
        kind = Path if Path in kinds else typing.get_origin(kinds[0]) or kinds[0]
        out[f.name] = Field(kind, len(kinds) < len(args))
    return out


def _expected(kind: Any) -> str:
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "one of: " + ", ".join(str(m.value) for m in kind)
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        list: "a list of strings (or one comma-separated string)",
        Path: "a path (a string)",
    }.get(kind, "a string")


def _from_string(text: str, kind: Any) -> Any:
    """``text`` (the environment, a flag, a quoted TOML value) as ``kind``; ValueError if
    it is not one. Enum values stay strings: the config classes check the choice."""
    word = text.strip()
    if kind is bool:
        if word.lower() not in _TRUE + _FALSE:
            raise ValueError(text)
        return word.lower() in _TRUE
    if kind in (int, float):
        return kind(word)
    if kind is list:
        return [v.strip() for v in text.split(",") if v.strip()]
    return text


def _is_a(value: Any, kind: Any) -> bool:
    """Whether a TOML (or Python) value is already of type ``kind``: a bool is not an int,
    an int is a float, and a path comes from a string only."""
    if kind is float:
        return type(value) in (int, float)
    if kind is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind is Path:
        return isinstance(value, os.PathLike)
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _parse(name: str, value: Any, field: Field) -> Any:
    if field.nullable and isinstance(value, str) and value.strip().lower() in ("", "none"):
        return None
    if name.endswith("_bytes"):
        return parse_size(value, name)
    try:
        if isinstance(value, str):
            return _from_string(value, field.kind)
        if _is_a(value, field.kind):
            return float(value) if field.kind is float else value
    except ValueError:
        pass
    raise ConfigError(f"{name}={value!r} is not {_expected(field.kind)}")


def coerce(name: str, value: Any, field: Field, source: str) -> Any:
    """``value`` (from TOML, the environment or a flag) as field ``name``'s type.

    Raises ConfigError naming ``source``, the field, the value and the type expected.
    """
    try:
        return _parse(name, value, field)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def did_you_mean(
    name: str, known: typing.Iterable[str], spell: typing.Callable[[str], str] = repr
) -> str:
    """``; did you mean X?`` with X the known name closest to ``name`` as ``spell`` writes
    it, or nothing when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {spell(close[0])}?" if close else ""


def config_to_dict(config: Any) -> dict[str, Any]:
    """A JSON/msgpack-safe description of a config (paths as strings, enums by value),
    the inverse of :func:`config_from_dict`."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if isinstance(v, enum.Enum):
            v = v.value
        elif isinstance(v, Path):
            v = str(v)
        elif isinstance(v, list):
            v = list(v)
        out[f.name] = v
    return out


def config_from_dict(cls: type[C], d: dict[str, Any], what: str) -> C:
    """Build the config ``cls`` from a mapping; an unknown key is an error naming the
    known ones (a typo must not pass silently). ``what``: the config, for the message."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"unknown {what} config key(s) {unknown}; known keys: {sorted(known)}")
    return cls(**d)
