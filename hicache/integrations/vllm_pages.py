"""What vLLM's offloaded pages are to the sidecar: keys, the namespace, the page geometry.

vLLM's ``OffloadingConnector`` names a block of one KV cache group by an ``OffloadKey``:
the block's hash (a chain over the prompt's tokens) plus the group index. The sidecar
names pages by 16-byte hashes in a chain, under one layout per sidecar. Here:

* every group's block is one sidecar page of the FULL component: the bytes of each layer
  of the group, layer after layer (an attention layer's page, a Mamba layer's state
  page), padded with zeros to the largest group's size. The sidecar sees a layout of one
  "full" layer whose K and V halves are the two halves of that page;
* the page hash is ``blake2b(namespace || TP rank || OffloadKey)``, where the namespace is
  a digest of everything that makes the bytes usable: the model, the KV dtype, the block
  size, the TP size, and each group's page layout (its spec and its layers' byte sizes).
  Two deployments that differ in any of these never name the same page, and the
  namespace is also the layout's ``model_id``, so a sidecar serving one refuses the
  other's workers. The TP ranks of one deployment share the layout (and a sidecar); each
  rank's pages are its own shard, named with its rank;
* a request's ``cache_salt`` is already in its block hashes (vLLM seeds the chain with
  it), so it separates pages as it is; the sidecar is told the request's tenant for its
  quotas and metrics as :func:`tenant_label` of the salt, never the salt itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from hicache import HASH_BYTES, ModelLayout

#: Bytes of one staged page are a multiple of this: the layout's dtype (float32) times
#: its two halves (K, V).
PAGE_ALIGN_BYTES = 8
_STAGE_DTYPE = "float32"


#: The prefix of a tenant named by a request's ``cache_salt`` (:func:`tenant_label`).
SALT_TENANT_PREFIX = "salt-"


def tenant_label(cache_salt: str | None) -> str | None:
    """The tenant the sidecar is told for a request of ``cache_salt`` (None or empty: no
    salt in vLLM's block hashes, no tenant): ``salt-`` and 16 hex digits of a keyed
    BLAKE2b of the salt. The same salt is the same tenant in every deployment; the label
    does not show the salt (metrics, stats and ``hicachectl`` print labels), so a
    per-tenant quota names the label::

        python -c 'from hicache.integrations.vllm_pages import tenant_label as t; print(t("SALT"))'
    """
    if not cache_salt:
        return None
    digest = hashlib.blake2b(cache_salt.encode(), digest_size=8, key=b"hicache-vllm-tenant")
    return SALT_TENANT_PREFIX + digest.hexdigest()


@dataclass(frozen=True)
class GroupPages:
    """One offloaded KV cache group: its vLLM group id and its layers' page bytes, in
    the order the worker's ``CanonicalKVCaches.group_data_refs`` lists them; and what
    vLLM's KV events say of its blocks (``kv_cache_spec_kind``, ``block_size`` in
    tokens, sliding window), which the sidecar's events repeat."""

    group_id: int
    kind: str
    layer_page_bytes: tuple[int, ...]
    event_kind: str = "unknown"
    block_size: int = 0
    sliding_window: int | None = None

    @property
    def page_bytes(self) -> int:
        return sum(self.layer_page_bytes)


@dataclass(frozen=True)
class PageNamespace:
    """The namespace of one deployment's pages and the sidecar layout that carries them."""

    digest: bytes
    groups: tuple[GroupPages, ...]
    tp_size: int

    @classmethod
    def build(
        cls,
        model: str,
        kv_dtype: str,
        tokens_per_block: Sequence[int],
        groups: Sequence[GroupPages],
        tp_size: int,
    ) -> PageNamespace:
        parts = [
            "hicache-vllm-v1",
            model,
            kv_dtype,
            ",".join(map(str, tokens_per_block)),
            f"tp{tp_size}",
        ]
        parts += [f"{g.group_id}:{g.kind}:{'+'.join(map(str, g.layer_page_bytes))}" for g in groups]
        digest = hashlib.blake2b("|".join(parts).encode(), digest_size=16).digest()
        return cls(digest, tuple(groups), tp_size)

    @property
    def page_bytes(self) -> int:
        """Bytes of one staged page: the largest group's block, rounded up."""
        largest = max(g.page_bytes for g in self.groups)
        return -(-largest // PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES

    def layout(self) -> ModelLayout:
        """The sidecar layout: one FULL "layer" whose K and V are the page's two halves.
        Tokens per page is 1 (a page is one block of one group)."""
        return ModelLayout(
            ("full",),
            num_kv_heads=1,
            head_dim=self.page_bytes // PAGE_ALIGN_BYTES,
            dtype=_STAGE_DTYPE,
            model_id=f"vllm:{self.digest.hex()}",
        )

    def page_hash(self, offload_key: bytes, rank: int) -> bytes:
        """The sidecar's name for TP rank ``rank``'s page of one ``OffloadKey``."""
        data = self.digest + rank.to_bytes(4, "big") + offload_key
        return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()

    @property
    def root_hash(self) -> bytes:
        """The parent of a group's first page."""
        return hashlib.blake2b(self.digest + b"root", digest_size=HASH_BYTES).digest()
