"""Engine-side cache configuration: page size, window, device pool sizes and policies."""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import TypeVar

from hicache.layout import ModelLayout
from hicache.types import ConfigError

E = TypeVar("E", bound=enum.Enum)


class WritePolicy(enum.Enum):
    """When device pages are backed up to the controller's host tier."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class PrefetchPolicy(enum.Enum):
    """How long a load-back waits for pages still being read from disk."""

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


class EvictionPolicyKind(enum.Enum):
    """Which device-tier leaf goes first when FULL tokens must be freed."""

    LRU = "lru"
    LEARNED = "learned"
    ADAPTIVE = "adaptive"  # follows the better of the two online (hicache.adaptive_eviction)


def parse_enum(enum_cls: type[E], value: object, name: str) -> E:
    """``value`` as a member of ``enum_cls`` (given a member or its value); a ConfigError
    naming ``name`` and the choices otherwise."""
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        choices = ", ".join(str(m.value) for m in enum_cls)
        raise ConfigError(f"{name}={value!r} is not one of: {choices}") from None


@dataclass
class CacheConfig:
    """What the engine-side cache needs to know; every size has its unit in its name.

    ``full_slots`` and ``swa_slots`` are token slots (rounded down to whole pages);
    ``mamba_slots`` are state slots. ``swa_slots`` defaults to ``full_slots``.
    ``max_host_only_tokens`` bounds the tree's record of prefixes that live only in the
    host/disk tiers (default: 8 × ``full_slots``); past it the least recently used such
    leaves are forgotten (their pages stay in the controller and are found again by
    lookup), except the node a match is handing out and the nodes a load-back is
    bringing in, so the bound can be passed by one match's worth for a moment. A
    load-back of a prefix forgotten since its match is a miss, not an error.

    With ``speculative_draft_tokens`` D > 0 the Mamba pool also holds, for
    ``speculative_slots`` requests (default: ``mamba_slots``), the conv windows and SSM
    states of every draft step; the conv windows use the de-duplicated layout for linear
    drafts (``speculative_topk`` <= 1) on CUDA.
    """

    page_size: int = 16
    sliding_window: int | None = None
    full_slots: int = 16384
    swa_slots: int | None = None
    mamba_slots: int = 64
    device: str = "cpu"
    shared_memory: bool = False
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_through_threshold_hits: int = 2
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    prefetch_timeout_s: float = 0.5
    load_timeout_s: float = 10.0
    max_host_only_tokens: int | None = None
    speculative_draft_tokens: int = 0
    speculative_topk: int = 1
    speculative_slots: int | None = None
    eviction_policy: EvictionPolicyKind = EvictionPolicyKind.LRU
    eviction_sample_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        self.write_policy = parse_enum(WritePolicy, self.write_policy, "write_policy")
        self.prefetch_policy = parse_enum(PrefetchPolicy, self.prefetch_policy, "prefetch_policy")
        self.eviction_policy = parse_enum(
            EvictionPolicyKind, self.eviction_policy, "eviction_policy"
        )
        if self.swa_slots is None:
            self.swa_slots = self.full_slots
        if self.max_host_only_tokens is None:
            self.max_host_only_tokens = 8 * self.full_slots
        self.validate()

    def validate(self, layout: ModelLayout | None = None) -> None:
        """Raise ConfigError naming the first bad value; with a layout, check both agree."""
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        if self.full_slots < self.page_size:
            raise ConfigError(
                f"full_slots={self.full_slots} holds less than one page of {self.page_size} tokens"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.mamba_slots < 0:
            raise ConfigError(f"mamba_slots must be >= 0, got {self.mamba_slots}")
        if self.write_through_threshold_hits < 1:
            raise ConfigError("write_through_threshold_hits must be >= 1")
        for name in ("prefetch_timeout_s", "load_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.speculative_draft_tokens < 0 or self.speculative_topk < 1:
            raise ConfigError("speculative_draft_tokens must be >= 0 and speculative_topk >= 1")
        if self.speculative_slots is not None and self.speculative_slots < 1:
            raise ConfigError(f"speculative_slots must be >= 1, got {self.speculative_slots}")
        if self.eviction_sample_size < 1:
            raise ConfigError("eviction_sample_size must be >= 1")
        if layout is None:
            return
        if layout.has_swa:
            if self.sliding_window is None:
                raise ConfigError("the layout has sliding-window layers: set sliding_window")
            if self.swa_slots < self.page_size:
                raise ConfigError(f"swa_slots={self.swa_slots} holds less than one page")
        if layout.has_mamba and self.mamba_slots < 2:
            raise ConfigError(
                "the layout has Mamba layers: mamba_slots must be >= 2 (a request's state and "
                "one cached state)"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
