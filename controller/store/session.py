"""One engine's view of a shared :class:`LocalController`: the CacheController protocol.

The sidecar keeps one session per connected engine; an in-process engine may use the
controller directly (its methods take ``engine_id``, default ``"local"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from hicache.controller_api import (
    LoadResult,
    LookupResult,
    PageKey,
    PageRef,
    PinReceipt,
    TransferHandle,
)
from hicache.types import ComponentType

if TYPE_CHECKING:
    from hicache.layout import ModelLayout
    from hicache.pools import DevicePools


class SharedController(Protocol):
    """The engine-scoped methods of a controller shared by several engines
    (:class:`~hicache.controller.store.local.LocalController`'s)."""

    def register(
        self, layout: ModelLayout, page_size: int, pools: DevicePools, engine_id: str = ...
    ) -> None: ...
    def unregister(self, engine_id: str) -> None: ...
    def lookup(
        self,
        page_hashes: Sequence[bytes],
        components: Sequence[ComponentType],
        engine_id: str = ...,
        tenant: str | None = None,
    ) -> LookupResult: ...
    def report_prefill_rate(
        self, tokens_per_s: float | None, engine_id: str = ..., measured: bool = False
    ) -> None: ...
    def backup(
        self,
        refs: Sequence[PageRef],
        ready_event: Any = None,
        engine_id: str = ...,
        tenant: str | None = None,
    ) -> TransferHandle: ...
    def pin(
        self, keys: Sequence[PageKey], ttl_s: float | None = None, engine_id: str = ...
    ) -> PinReceipt | None: ...
    def load(
        self,
        refs: Sequence[PageRef],
        pin: PinReceipt,
        timeout_s: float | None = None,
        engine_id: str = ...,
    ) -> LoadResult: ...
    def unpin(self, pin: PinReceipt, engine_id: str = ...) -> None: ...
    def prefetch(self, keys: Sequence[PageKey], engine_id: str = ...) -> TransferHandle: ...
    def stats(self, engine_id: str = ...) -> dict[str, Any]: ...


class EngineSession:
    """The CacheController protocol for one engine of a shared :class:`LocalController`.

    ``close`` ends this engine's session (its pins are released); the controller stays.
    """

    def __init__(self, controller: SharedController, engine_id: str) -> None:
        self.controller = controller
        self.engine_id = engine_id

    def register(self, layout: ModelLayout, page_size: int, pools: DevicePools) -> None:
        self.controller.register(layout, page_size, pools, engine_id=self.engine_id)

    def lookup(
        self,
        page_hashes: Sequence[bytes],
        components: Sequence[ComponentType],
        tenant: str | None = None,
    ) -> LookupResult:
        return self.controller.lookup(
            page_hashes, components, engine_id=self.engine_id, tenant=tenant
        )

    def report_prefill_rate(self, tokens_per_s: float | None, measured: bool = False) -> None:
        """This engine prefills ``tokens_per_s`` tokens per second (the cost rule);
        ``measured``: by its integration, counted only while it reports none."""
        self.controller.report_prefill_rate(tokens_per_s, self.engine_id, measured)

    def backup(
        self, refs: Sequence[PageRef], ready_event: Any = None, tenant: str | None = None
    ) -> TransferHandle:
        return self.controller.backup(refs, ready_event, engine_id=self.engine_id, tenant=tenant)

    def pin(self, keys: Sequence[PageKey], ttl_s: float) -> PinReceipt | None:
        return self.controller.pin(keys, ttl_s, engine_id=self.engine_id)

    def load(self, refs: Sequence[PageRef], pin: PinReceipt, timeout_s: float) -> LoadResult:
        return self.controller.load(refs, pin, timeout_s, engine_id=self.engine_id)

    def unpin(self, pin: PinReceipt) -> None:
        self.controller.unpin(pin, engine_id=self.engine_id)

    def prefetch(self, keys: Sequence[PageKey]) -> TransferHandle:
        return self.controller.prefetch(keys, engine_id=self.engine_id)

    def stats(self) -> dict[str, Any]:
        return self.controller.stats(engine_id=self.engine_id)

    def close(self) -> None:
        self.controller.unregister(self.engine_id)
