"""Small shared vocabulary: component types, tiers and the errors a user can meet."""

from __future__ import annotations

import enum


class ComponentType(enum.IntEnum):
    """The kinds of state a tree node can carry for its prefix.

    The integer value is the component's tag in storage keys and on the wire; never
    renumber a member.
    """

    FULL = 0
    SWA = 1
    MAMBA = 2


class Tier(enum.IntEnum):
    DEVICE = 0
    HOST = 1
    DISK = 2


class HicacheError(Exception):
    """Base class of every error hicache raises on purpose."""


class ConfigError(HicacheError, ValueError):
    """A layout or config value is invalid; the message says which and what to do."""


class PoolExhaustedError(HicacheError):
    """A device pool has fewer free slots than asked for."""


class SlotStateError(HicacheError):
    """A slot was freed twice, or freed without having been allocated."""


class LayoutMismatchError(HicacheError):
    """Two parties disagree on the model layout; their caches must not be mixed."""
