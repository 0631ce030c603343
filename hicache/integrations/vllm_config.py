"""The ``hicache_*`` options of vLLM's ``kv_connector_extra_config``: read by the spec
(:mod:`hicache.integrations.vllm`), its scheduler-side manager and its workers, so kept in
a module of their own that none of them imports back."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache import ConfigError

_EXTRA_PREFIX = "hicache_"


@dataclass(frozen=True)
class HiCacheVllmConfig:
    """The ``hicache_*`` keys of ``kv_connector_extra_config`` (without the prefix).

    * ``socket``: the sidecar's endpoint (default: ``hicache serve``'s default socket);
    * ``engine_id``: this deployment's name in the sidecar (default: host:pid:random),
      suffixed ``-scheduler`` and ``-worker<rank>`` per process;
    * ``lookup_wait_ms``: how long the first lookup of a request waits, inside a scheduler
      step, for the sidecar's answer; past it the request is asked again next step;
    * ``lookup_deadline_ms``: an answer not there by then is a miss;
    * ``request_timeout_s``: pins, unpins and the handshake;
    * ``pin_ttl_s``: how long a pin holds pages that vLLM is about to load;
    * ``pin_wait_ms``: how long a scheduler step that plans loads waits for their pins,
      whose host pages then go to the workers with the loads (they copy at once); a pin
      answered later leaves its load to pin in the worker first;
    * ``load_timeout_s``: one load (disk reads included); past it vLLM recomputes;
    * ``store_timeout_s``: one store's acknowledgement; past it the store is dropped;
    * ``staging_bytes``: the shared staging area each worker registers with the sidecar;
      a store larger than its free part is cut (the rest dropped and counted), a load is
      done in parts;
    * ``layerwise``: a hit is loaded inside the step that computes the request's suffix,
      each attention layer waiting only for its own blocks (vLLM's ``wait_for_layer_load``),
      instead of whole before the request is scheduled (default off; only for a model with
      one KV cache group and a local sidecar, else the whole-block path runs);
    * ``store_ahead``: a store's host pages are asked for when vLLM announces it, a
      step before it submits it, so that the store copies at once, its pages already
      handed out (default on; only where the worker copies into the sidecar's shared
      host pages); ``store_ahead_jobs`` bounds the stores asked for ahead at once (past
      it a store asks for its pages when it runs); one not submitted when due has its
      pages given back a step later;
    * ``read_ahead``: a request's lookup has the sidecar start reading the pages of its
      leading hit that are only on disk or the remote tier to host, not waited for, so
      that by the time its load is pinned they may be there (default on);
    * ``prefill_tokens_per_s``: this engine's prefill rate, sent with its lookups for the
      sidecar's cost rule; unset, the scheduler measures it from its own steps that
      compute at least ``prefill_min_tokens`` prompt tokens (hicache/prefill_rate.py).
    """

    socket: str | None = None
    engine_id: str | None = None
    lookup_wait_ms: float = 5.0
    lookup_deadline_ms: float = 500.0
    request_timeout_s: float = 2.0
    pin_ttl_s: float = 60.0
    pin_wait_ms: float = 2.0
    load_timeout_s: float = 10.0
    store_timeout_s: float = 10.0
    staging_bytes: int = 256 << 20
    layerwise: bool = False
    store_ahead: bool = True
    store_ahead_jobs: int = 16
    read_ahead: bool = True
    prefill_tokens_per_s: float | None = None
    prefill_min_tokens: int = 256

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("socket", "engine_id") or f.type == "bool" or value is None:
                continue
            if not value > 0:
                raise ConfigError(f"hicache_{f.name} must be > 0, got {value!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> HiCacheVllmConfig:
        """Read the ``hicache_*`` keys; an unknown one is an error naming the known ones."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in extra.items():
            if not key.startswith(_EXTRA_PREFIX):
                continue
            name = key[len(_EXTRA_PREFIX) :]
            if name not in fields:
                known = ", ".join(_EXTRA_PREFIX + n for n in fields)
                raise ConfigError(f"unknown kv_connector_extra_config key {key!r}; known: {known}")
            kind = fields[name].type
            if value is None and "None" in kind:
                values[name] = None
                continue
            if kind == "bool":
                values[name] = _flag(key, value)
                continue
            try:
                if "int" in kind and "float" not in kind:
                    values[name] = int(value)
                elif "float" in kind:
                    values[name] = float(value)
                else:
                    values[name] = str(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{key} must be a number, got {value!r}") from None
        return cls(**values)


def _flag(key: str, value: Any) -> bool:
    """A boolean option given as a JSON boolean or as ``true``/``false``, ``1``/``0``."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{key} must be true or false, got {value!r}")
