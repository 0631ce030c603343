"""SGLang host pools as hicache sees them: page byte sizes, the namespace, the page hashes.

hicache stores an SGLang page as the bytes SGLang's own file backend stores for it: the
host pool's flat data page (``get_data_page(index, flat=True)``), whatever the pool's
layout. The sidecar's layout is one of 2-byte units: FULL pages hold the KV pool's page
(with an MHA pool's own layers and heads, so that a ``layer_first`` host buffer is exactly
a sidecar FULL buffer: the zero-copy path), SWA pages the SWA pool's, MAMBA state slots
the Mamba pool's (opaque bytes, split in two). What makes those bytes usable (model,
dtype, page size, the TP, PP, CP and DP ranks, each pool's class, layout, dtype and
geometry) goes into the layout's ``model_id`` as a digest, so it seeds every page hash:
no two incompatible runs share a page, and a bf16 and an fp8 run of one model never
collide.

Nothing here imports SGLang: pools are read through the attributes SGLang's host pools
have (``page_size``, ``layout``, ``dtype``, ``get_dummy_flat_data_page``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from hicache import ComponentType, ConfigError, LayerKind, ModelLayout, namespace_hash

# Pages move through the sidecar in 2-byte units: every dtype an SGLang pool holds (fp8
# and uint8-stored fp8 KV included) has pages of an even number of bytes.
UNIT_DTYPE = torch.float16
UNIT_BYTES = 2

# SGLang's pool names (sglang.srt.mem_cache.hicache_storage.PoolName values) hicache holds,
# each as one of its components.
POOL_COMPONENTS = {"kv": ComponentType.FULL, "swa": ComponentType.SWA, "mamba": ComponentType.MAMBA}


def page_bytes(pool: Any) -> int:
    """Bytes of one page of an SGLang host pool (what ``get_data_page`` returns)."""
    dummy = pool.get_dummy_flat_data_page()
    return dummy.numel() * dummy.element_size()


def describe_pool(pool: Any) -> dict[str, Any]:
    """What makes a pool's pages readable by another run: its class, layout, dtype and
    geometry (JSON-safe)."""
    desc: dict[str, Any] = {
        "class": type(pool).__name__,
        "layout": str(getattr(pool, "layout", "")),
        "dtype": str(getattr(pool, "dtype", "")),
        "page_size": int(getattr(pool, "page_size", 1) or 1),
        "page_bytes": page_bytes(pool),
    }
    for attr in ("layer_num", "head_num", "head_dim", "num_mamba_layers", "storage_format_tag"):
        value = getattr(pool, attr, None)
        if isinstance(value, int | str):
            desc[attr] = value
    for attr in ("conv_state_shapes", "temporal_state_shape"):
        value = getattr(pool, attr, None)
        if value is not None:
            desc[attr] = json.loads(json.dumps(value, default=lambda s: [int(x) for x in s]))
    return desc


@dataclass(frozen=True)
class SGLangNamespace:
    """The identity of an SGLang run's pages: storage config ranks plus every pool."""

    model_name: str
    ranks: dict[str, int]
    pools: dict[str, dict[str, Any]]
    salt: str = ""

    def digest(self) -> str:
        """A stable hex digest of the whole namespace."""
        doc = json.dumps(
            {"model": self.model_name, "ranks": self.ranks, "pools": self.pools, "salt": self.salt},
            sort_keys=True,
        )
        return hashlib.blake2b(doc.encode(), digest_size=16).hexdigest()


def ranks_of(storage_config: Any) -> dict[str, int]:
    """The parallel ranks of a HiCacheStorageConfig that decide which shard a page holds."""
    names = (
        "tp_rank",
        "tp_size",
        "pp_rank",
        "pp_size",
        "attn_cp_rank",
        "attn_cp_size",
        "dp_rank",
        "dcp_rank",
        "dcp_size",
    )
    out = {n: int(getattr(storage_config, n, 0) or 0) for n in names}
    out["is_mla_model"] = int(bool(getattr(storage_config, "is_mla_model", False)))
    return out


def _units(nbytes: int, what: str) -> int:
    if nbytes <= 0 or nbytes % UNIT_BYTES:
        raise ConfigError(f"{what} pages are {nbytes} bytes; hicache needs a positive even size")
    return nbytes // UNIT_BYTES


def kv_geometry(kv: dict[str, Any], page_size: int) -> tuple[int, int, int]:
    """(layers, heads, head size in 2-byte units) of the sidecar's FULL pages for the KV
    pool ``kv`` (a :func:`describe_pool` map). An MHA pool's own layers and heads, so that
    its ``layer_first`` buffer is exactly a sidecar FULL buffer (the zero-copy path);
    otherwise one layer of one head holding the page's bytes."""
    units = _units(kv["page_bytes"], "the KV pool's")
    layers, heads, dim = kv.get("layer_num"), kv.get("head_num"), kv.get("head_dim")
    if all(isinstance(v, int) and v > 0 for v in (layers, heads, dim)):
        elems = 2 * layers * page_size * heads * dim
        if (UNIT_BYTES * units) % elems == 0:
            itemsize = UNIT_BYTES * units // elems  # bytes per element
            if dim * itemsize % UNIT_BYTES == 0:
                return layers, heads, dim * itemsize // UNIT_BYTES
    if units % (2 * page_size):
        raise ConfigError(
            f"the KV pool's page of {kv['page_bytes']} bytes is not K and V of {page_size} tokens"
        )
    return 1, 1, units // (2 * page_size)


def sidecar_layout(ns: SGLangNamespace, page_size: int) -> ModelLayout:
    """The sidecar layout whose FULL, SWA and MAMBA pages hold exactly the KV, SWA and
    Mamba pools' page bytes (ConfigError when a pool's page does not fit one)."""
    kv = ns.pools["kv"]
    layers, heads, head_dim = kv_geometry(kv, page_size)
    kinds = [LayerKind.FULL] * layers
    if "swa" in ns.pools:
        swa_units = _units(ns.pools["swa"]["page_bytes"], "the SWA pool's")
        per_layer = 2 * page_size * heads * head_dim
        if swa_units % per_layer:
            raise ConfigError(
                "the SWA pool's page is not a whole number of KV-sized layers; hicache holds "
                "SWA pages as layers of the KV pool's token size"
            )
        kinds += [LayerKind.SWA] * (swa_units // per_layer)
    conv_dim, ssm = 0, ()
    if "mamba" in ns.pools:
        units = _units(ns.pools["mamba"]["page_bytes"], "the Mamba pool's")
        if units < 2:
            raise ConfigError("the Mamba pool's state is smaller than 4 bytes")
        kinds.append(LayerKind.MAMBA)
        # A state slot is conv followed by SSM in the sidecar: split the bytes in two.
        conv_dim, ssm = units // 2, (units - units // 2,)
    return ModelLayout(
        tuple(kinds),
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=UNIT_DTYPE,
        conv_dim=conv_dim,
        conv_kernel=2 if conv_dim else 0,
        ssm_state_shape=ssm,
        state_dtype=UNIT_DTYPE,
        model_id=f"sglang/{ns.model_name}@{ns.digest()}",
        tp_rank=ns.ranks["tp_rank"],
        tp_size=max(ns.ranks["tp_size"], 1),
    )


class PageHasher:
    """SGLang storage keys (hex strings) as hicache page hashes, chained like the keys."""

    def __init__(self, layout: ModelLayout, page_size: int) -> None:
        self.root = namespace_hash(layout.fingerprint(page_size), None)

    def page_hash(self, key: str) -> bytes:
        """The 16-byte hicache hash of SGLang's key ``key`` in this namespace."""
        return hashlib.blake2b(
            self.root + key.encode("utf-8"), digest_size=16, person=b"hicache-sglang"
        ).digest()

    def chain(
        self, keys: list[str], prefix_keys: list[str] | None
    ) -> tuple[list[bytes], list[bytes]]:
        """(hashes, parent hashes) of ``keys``; the first parent is the last prefix key's
        page (the namespace root at a sequence start or when SGLang gives no prefix)."""
        hashes = [self.page_hash(k) for k in keys]
        first = self.page_hash(prefix_keys[-1]) if prefix_keys else self.root
        return hashes, [first, *hashes[:-1]]
