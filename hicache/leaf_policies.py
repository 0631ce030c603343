"""The device-tier leaf eviction policy named in a :class:`~hicache.config.CacheConfig`."""

from __future__ import annotations

from hicache.adaptive_eviction import AdaptiveLeafPolicy
from hicache.config import CacheConfig, EvictionPolicyKind
from hicache.eviction import LeafEvictionPolicy, LRULeafPolicy
from hicache.learned_eviction import LearnedLeafPolicy


def make_leaf_policy(config: CacheConfig) -> LeafEvictionPolicy:
    """A fresh policy of the kind ``config.eviction_policy`` names (the learned and
    adaptive ones seeded and sized from ``config``)."""
    kind = config.eviction_policy
    if kind is EvictionPolicyKind.LRU:
        return LRULeafPolicy()
    if kind is EvictionPolicyKind.LEARNED:
        return LearnedLeafPolicy(sample_size=config.eviction_sample_size, seed=config.seed)
    return AdaptiveLeafPolicy(
        config.full_slots, sample_size=config.eviction_sample_size, seed=config.seed
    )
