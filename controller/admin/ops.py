"""The admin verbs on a :class:`LocalController`: clear, evict, prefix pins, fsck and
residency, as the sidecar's handlers (``hicachectl``) run them.

The work is the page store's admin operations
(:class:`~hicache.controller.store.admin_ops.AdminOps`, which say what each promises);
what is added here is the admin's side: a clear commits what was queued before it, a
prefix is named by tokens in a namespace, and the admin's pins are its own engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from hicache.controller.store.admin_ops import ClearResult
from hicache.controller.tiers.lower_tier import FsckResult
from hicache.controller_api import PageKey, PinReceipt
from hicache.keys import namespace_hash, page_hashes
from hicache.types import ComponentType, Tier

if TYPE_CHECKING:
    from hicache.controller.store.page_store import PageStore

__all__ = [
    "ADMIN_ENGINE",
    "ClearResult",
    "FsckResult",
    "clear",
    "evict",
    "fsck",
    "pin_prefix",
    "prefix_keys",
    "residency",
    "unpin",
]

ADMIN_ENGINE = "admin"  # the owner of pins made by hicachectl
# How long a clear waits for queued backups and disk writes to commit before it drops
# what it may: a write still queued after this is kept (in flight), never lost or torn.
CLEAR_FLUSH_TIMEOUT_S = 30.0


class Controller(Protocol):
    """What the admin verbs use of a :class:`LocalController`."""

    @property
    def store(self) -> PageStore: ...

    def flush(self, timeout_s: float | None = None) -> bool: ...

    def pin(
        self, keys: list[PageKey], ttl_s: float | None = None, engine_id: str = ...
    ) -> PinReceipt | None: ...

    def unpin(self, pin: PinReceipt, engine_id: str = ...) -> None: ...


def clear(
    ctl: Controller,
    fingerprint: bytes | None,
    tiers: Iterable[Tier],
    namespace: str | None = None,
    all_namespaces: bool = True,
) -> ClearResult:
    """Drop every unpinned page of ``tiers`` (in ``namespace`` of the layout
    ``fingerprint`` unless ``all_namespaces``). Backups and disk writes queued before the
    call are committed first (for up to ``CLEAR_FLUSH_TIMEOUT_S``), so a page stored
    just before a clear is dropped instead of being kept as in flight, or written to
    disk after it."""
    ctl.flush(CLEAR_FLUSH_TIMEOUT_S)
    root = None
    if not all_namespaces:
        if fingerprint is None:
            return ClearResult()
        root = namespace_hash(fingerprint, namespace)
    return ctl.store.clear(tiers, root)


def evict(
    ctl: Controller, tier: Tier, nbytes: int, component: ComponentType | None = None
) -> dict[str, int]:
    """Evict least-recently-used pages of ``tier`` until ``nbytes`` are freed."""
    return ctl.store.evict(tier, nbytes, component)


def prefix_keys(
    ctl: Controller,
    fingerprint: bytes,
    page_size: int,
    tokens: list[int],
    namespace: str | None,
) -> list[PageKey]:
    """Keys of the leading pages of a prefix that the controller holds, every component."""
    return ctl.store.prefix_keys(page_hashes(tokens, fingerprint, page_size, namespace))


def pin_prefix(ctl: Controller, keys: list[PageKey], ttl_s: float) -> PinReceipt | None:
    """Pin ``keys`` as the admin for ``ttl_s`` (capped by the controller's pin_ttl_max_s)."""
    if not keys:
        return None
    return ctl.pin(keys, ttl_s, engine_id=ADMIN_ENGINE)


def unpin(ctl: Controller, pin_id: int) -> None:
    ctl.unpin(PinReceipt(pin_id, [], 0.0), engine_id=ADMIN_ENGINE)


def fsck(
    ctl: Controller,
    repair: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> FsckResult:
    """Read every LMDB value and check its header and payload checksum; with ``repair``,
    corrupt values are dropped from the index and deleted from LMDB. See
    ``PageStore.fsck``."""
    return ctl.store.fsck(repair, progress)


def residency(ctl: Controller) -> dict[str, dict[str, dict[str, int]]]:
    """Pages per tier and component, ``resident`` and ``pinned`` (``PageStore.residency``)."""
    return ctl.store.residency()
