"""hicache: a three-tier (GPU / pinned host / LMDB disk) prefix cache for hybrid LLM engines."""

from hicache.cache import UnifiedRadixCache
from hicache.config import CacheConfig, EvictionPolicyKind, PrefetchPolicy, WritePolicy
from hicache.controller_api import CacheController
from hicache.layout import LayerKind, ModelLayout
from hicache.pools import DevicePools
from hicache.request import CacheStats, EvictResult, LockReceipt, MatchResult, Request
from hicache.types import ComponentType, ConfigError, Tier

__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "CacheController",
    "CacheStats",
    "ComponentType",
    "ConfigError",
    "DevicePools",
    "EvictResult",
    "EvictionPolicyKind",
    "LayerKind",
    "LockReceipt",
    "MatchResult",
    "ModelLayout",
    "PrefetchPolicy",
    "Request",
    "Tier",
    "UnifiedRadixCache",
    "WritePolicy",
    "__version__",
]
