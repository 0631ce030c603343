"""hicache: a three-tier (GPU / pinned host / LMDB disk) prefix cache for hybrid LLM engines."""

from hicache.config import CacheConfig, EvictionPolicyKind, PrefetchPolicy, WritePolicy
from hicache.layout import LayerKind, ModelLayout
from hicache.pools import DevicePools
from hicache.types import ComponentType, ConfigError, Tier

__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "ComponentType",
    "ConfigError",
    "DevicePools",
    "EvictionPolicyKind",
    "LayerKind",
    "ModelLayout",
    "PrefetchPolicy",
    "Tier",
    "WritePolicy",
    "__version__",
]
