"""Small shared vocabulary: component types, tiers (and what a lookup answers of them) and
the errors a user can meet."""

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
    """The tiers a page can be on, fastest first: the one tier vocabulary.

    The value is also a rank (a larger value is slower). A new tier goes after the last
    one; :data:`Presence` and :data:`ABSENT_RANK` follow from it.
    """

    DEVICE = 0
    HOST = 1
    DISK = 2
    REMOTE = 3  # a hint: the remote tier held it at the lookup; a pin reads it to host


# A lookup's answer for one page: the fastest tier beyond the device holding it (with that
# tier's value), or ABSENT (0: the one value no such tier has, since a lookup never
# answers DEVICE).
Presence = enum.IntEnum(
    "Presence",
    {"ABSENT": int(Tier.DEVICE), **{t.name: int(t) for t in Tier if t is not Tier.DEVICE}},
)
Presence.__doc__ = "Where a page is, as answered by a lookup (the fastest tier holding it)."

#: Where a match needs a page that is on no tier: a rank slower than every tier.
ABSENT_RANK = int(max(Tier)) + 1


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
