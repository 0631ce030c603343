"""hicache: a three-tier (GPU / pinned host / LMDB disk) prefix cache for hybrid LLM engines.

The public names load their modules on first use: ``import hicache`` alone does not import
torch, so light tools (``hicachectl``, health probes) start fast.
"""

from __future__ import annotations

from hicache.lazy_exports import lazy_getattr

__version__ = "0.1.0"

_EXPORTS = {
    "CacheConfig": "hicache.config",
    "EvictionPolicyKind": "hicache.config",
    "PrefetchPolicy": "hicache.config",
    "WritePolicy": "hicache.config",
    "LayerKind": "hicache.layout",
    "ModelLayout": "hicache.layout",
    "StateTensor": "hicache.layout",
    "dtype_name": "hicache.layout",
    "parse_dtype": "hicache.layout",
    "EngineKey": "hicache.engine_keys",
    "pack_engine_key": "hicache.engine_keys",
    "HASH_BYTES": "hicache.keys",
    "namespace_hash": "hicache.keys",
    "request_namespace": "hicache.keys",
    "tenant_of": "hicache.keys",
    "DevicePools": "hicache.pools",
    "UnifiedRadixCache": "hicache.cache",
    "CacheController": "hicache.controller_api",
    "LayerGroups": "hicache.controller_api",
    "LayerLoad": "hicache.controller_api",
    "LayeredLoadBack": "hicache.load_back",
    "P_ABSENT": "hicache.controller_api",
    "P_DISK": "hicache.controller_api",
    "P_HOST": "hicache.controller_api",
    "P_REMOTE": "hicache.controller_api",
    "PageKey": "hicache.controller_api",
    "PageRef": "hicache.controller_api",
    "PinReceipt": "hicache.controller_api",
    "Presence": "hicache.controller_api",
    "TransferHandle": "hicache.controller_api",
    "unsettled_load": "hicache.controller_api",
    "CacheStats": "hicache.records",
    "EvictResult": "hicache.records",
    "LockReceipt": "hicache.records",
    "MatchResult": "hicache.records",
    "Request": "hicache.records",
    "PrefillMeter": "hicache.prefill_rate",
    "StepTimer": "hicache.prefill_rate",
    "resumable_pages": "hicache.resume",
    "window_pages": "hicache.resume",
    "ComponentType": "hicache.types",
    "ConfigError": "hicache.types",
    "PoolExhaustedError": "hicache.types",
    "Tier": "hicache.types",
}

__all__ = sorted([*_EXPORTS, "__version__"])


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return __all__
