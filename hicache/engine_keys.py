"""An engine's own name for a page, carried beside the page hash so that the sidecar's KV
events name the page as the engine's own events do.

vLLM names an offloaded block by its block hash and its KV cache group; its KV events say
``block_hashes`` (the hash as ``bytes``, or as the ``int`` of its low 64 bits when
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is on, vLLM's default), ``group_idx``,
``kv_cache_spec_kind``, ``block_size`` and, for a sliding window group,
``kv_cache_spec_sliding_window``. :func:`pack_engine_key` packs those into a few bytes
that travel with a page reference (``PageRef.engine_key``) and stay in the page's index
entry; :func:`unpack_engine_key` reads them back. Layout: a flags byte (bit 0: the hash
is an int), the kind's code (:data:`SPEC_KINDS`), the group (2 bytes), the block size and
the sliding window (4 bytes each, big-endian; window 0: none), then the hash (8 bytes for
an int).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_ENGINE_KEY_BYTES",
    "SPEC_KINDS",
    "EngineKey",
    "checked_engine_keys",
    "pack_engine_key",
    "unpack_engine_key",
]

#: vLLM's ``KVCacheSpecKind`` values, by code (``unknown`` for any other).
SPEC_KINDS = (
    "unknown",
    "full_attention",
    "mla_attention",
    "sliding_window",
    "sliding_window_mla",
    "mamba",
    "chunked_local_attention",
    "sink_full_attention",
    "encoder_only_attention",
    "cross_attention",
)
_CODE = {k: i for i, k in enumerate(SPEC_KINDS)}
_HEAD = struct.Struct(">BBHII")
_INT_HASH = 1
#: The longest engine key a page reference may carry (a 32-byte hash and the head).
MAX_ENGINE_KEY_BYTES = 64


@dataclass(frozen=True)
class EngineKey:
    """What an engine's KV events say of one block (see the module docstring)."""

    block_hash: bytes | int
    group_idx: int
    kind: str
    block_size: int
    sliding_window: int | None = None


def pack_engine_key(key: EngineKey) -> bytes:
    """``key`` as the bytes a page reference carries."""
    flags = 0
    if isinstance(key.block_hash, int):
        flags |= _INT_HASH
        digest = (key.block_hash & ((1 << 64) - 1)).to_bytes(8, "big")
    else:
        digest = bytes(key.block_hash)
    head = _HEAD.pack(
        flags, _CODE.get(key.kind, 0), key.group_idx, key.block_size, key.sliding_window or 0
    )
    out = head + digest
    if len(out) > MAX_ENGINE_KEY_BYTES:
        raise ValueError(f"an engine's block hash of {len(digest)} bytes is too long")
    return out


def unpack_engine_key(data: bytes) -> EngineKey:
    """The key :func:`pack_engine_key` packed; ValueError for bytes it did not write."""
    if len(data) <= _HEAD.size:
        raise ValueError(f"an engine key of {len(data)} bytes is too short")
    flags, code, group, block_size, window = _HEAD.unpack_from(data)
    digest = data[_HEAD.size :]
    block_hash: bytes | int = digest
    if flags & _INT_HASH:
        if len(digest) != 8:
            raise ValueError("an int block hash is 8 bytes")
        block_hash = int.from_bytes(digest, "big")
    kind = SPEC_KINDS[code] if code < len(SPEC_KINDS) else "unknown"
    return EngineKey(block_hash, group, kind, block_size, window or None)


def checked_engine_keys(keys: Any, n: int) -> list[bytes | None]:
    """The engine keys of ``n`` page references as a message carries them (one ``bin``
    each, empty for none), each one checked; ValueError naming what is wrong."""
    if not isinstance(keys, list) or len(keys) != n:
        raise ValueError(f"one engine key per ref ({n}) expected")
    for k in keys:
        if not isinstance(k, bytes) or len(k) > MAX_ENGINE_KEY_BYTES:
            raise ValueError(f"an engine key is a binary of <= {MAX_ENGINE_KEY_BYTES} bytes")
        if k:
            unpack_engine_key(k)
    return [k or None for k in keys]
