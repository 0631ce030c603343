"""Token keys and the stable page hash chain.

Tokens are held as little-endian int64 bytes, so that comparing a node's key with a
query is one ``memcmp`` and cutting a page out of it is a slice. Storage keys chain:

    h_0 = H(layout fingerprint ‖ extra_key)
    h_i = H(h_{i-1} ‖ tokens of page i)

with blake2b-128, so that equal prefixes under the same layout and namespace get equal
hashes in every process, on every machine, across restarts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

import numpy as np

if TYPE_CHECKING:
    import torch

TOKEN_BYTES = 8
HASH_BYTES = 16
_TOKEN_DTYPE = np.dtype("<i8")

TokenInput = Union[Sequence[int], np.ndarray, "torch.Tensor"]


def token_array(tokens: TokenInput) -> np.ndarray:
    """``tokens`` as a 1-D little-endian int64 array (no copy when it already is one)."""
    if hasattr(tokens, "detach"):  # a torch tensor (torch is not imported for light tools)
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens, dtype=_TOKEN_DTYPE)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    return arr


# From this many key bytes on, a tree walk is faster over a view of the token array than
# over a key built first (the copy costs more than the view's slices; 8k tokens: ~1.5 µs
# saved, 1k tokens: ~0.4 µs lost).
VIEW_MIN_KEY_BYTES = 16 << 10


def token_view(arr: np.ndarray) -> memoryview:
    """The key bytes of ``arr`` (a :func:`token_array`) as a byte view, copied only when
    ``arr`` is not contiguous: what a tree walk reads without building the key."""
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return memoryview(arr).cast("B")


def walk_key(arr: np.ndarray) -> bytes | memoryview:
    """What a tree walk over the tokens ``arr`` reads fastest: their key bytes, or for a
    long query a byte view of them (:data:`VIEW_MIN_KEY_BYTES`)."""
    if arr.size * TOKEN_BYTES >= VIEW_MIN_KEY_BYTES:
        return token_view(arr)
    return arr.tobytes()


def token_bytes(tokens: TokenInput) -> bytes:
    """The key bytes of ``tokens``."""
    return token_array(tokens).tobytes()


def bytes_to_tokens(key: bytes) -> np.ndarray:
    return np.frombuffer(key, dtype=_TOKEN_DTYPE)


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def namespace_hash(fingerprint: bytes, extra_key: str | None) -> bytes:
    """``h_0``: the seed of every chain in one (layout, namespace)."""
    ns = b"" if extra_key is None else b"\x01" + extra_key.encode("utf-8")
    return _h(b"hicache-ns|" + fingerprint + b"|" + ns)


def chain_page_hashes(prev_hash: bytes, key: bytes, page_size: int) -> list[bytes]:
    """Hashes of the whole pages of ``key`` (token bytes), chained from ``prev_hash``.

    A tail shorter than a page gets no hash.
    """
    step = page_size * TOKEN_BYTES
    out: list[bytes] = []
    h = prev_hash
    for off in range(0, len(key) - step + 1, step):
        h = _h(h + key[off : off + step])
        out.append(h)
    return out


def page_hashes(
    tokens: TokenInput, fingerprint: bytes, page_size: int, extra_key: str | None = None
) -> list[bytes]:
    """The hash chain of every whole page of ``tokens`` in namespace ``extra_key``."""
    return chain_page_hashes(namespace_hash(fingerprint, extra_key), token_bytes(tokens), page_size)


TENANT_PREFIX = "tenant:"


def request_namespace(extra_key: str | None, tenant: str | None) -> str | None:
    """The cache's ``extra_key`` of a request of ``tenant`` with ``extra_key``: ``extra_key``
    itself without a tenant, else ``tenant:<tenant>`` (then a NUL and ``extra_key``, where
    given). One-to-one: an ``extra_key`` may not start with :data:`TENANT_PREFIX` nor a
    tenant hold a NUL, so two tenants, or a tenant and none, never share a namespace."""
    if extra_key is not None and extra_key.startswith(TENANT_PREFIX):
        raise ValueError(f"extra_key may not start with {TENANT_PREFIX!r}: pass tenant= instead")
    if tenant is None:
        return extra_key
    if "\0" in tenant:
        raise ValueError("a tenant name may not contain a NUL character")
    suffix = "" if extra_key is None else "\0" + extra_key
    return TENANT_PREFIX + tenant + suffix


def tenant_of(namespace: str | None) -> str | None:
    """The tenant a namespace of :func:`request_namespace` names, None for one of no
    tenant: what a backup and a lookup tell the controller (its quotas and metrics)."""
    if namespace is None or not namespace.startswith(TENANT_PREFIX):
        return None
    return namespace[len(TENANT_PREFIX) :].split("\0", 1)[0]
