"""The CacheController protocol: what the engine-side cache asks of the host and disk tiers.

The same protocol is implemented in-process (``hicache.controller.LocalController``) and
over ZeroMQ (``hicache.controller.client.sidecar_client.SidecarController``). Pages are addressed by
their chained page hash (see :mod:`hicache.keys`) and component; device memory is
addressed by page id in a KV pool, or state slot in the Mamba pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from hicache.types import ComponentType, HicacheError, Presence

if TYPE_CHECKING:
    from hicache.layout import ModelLayout
    from hicache.pools import DevicePools


# Presence as plain ints, for numpy: an array compared with an IntEnum member takes numpy's
# slow path (about 11 µs for a small array, against 2 µs with an int; numpy 2.4).
P_ABSENT, P_HOST, P_DISK = int(Presence.ABSENT), int(Presence.HOST), int(Presence.DISK)
P_REMOTE = int(Presence.REMOTE)


@dataclass(frozen=True)
class PageKey:
    """One page of one component in the host and disk tiers."""

    component: ComponentType
    page_hash: bytes

    def storage_key(self) -> bytes:
        """The LMDB key: page hash followed by the component tag byte."""
        return self.page_hash + bytes((int(self.component),))


@dataclass(frozen=True)
class PageRef:
    """A page to move between a device pool and the controller.

    ``device_index`` is a page id of the FULL pool, a page id of the SWA pool (for SWA:
    ``pools.full_to_swa[full_page]``), or a Mamba state slot.
    ``parent_hash`` is the previous hash in the chain (``h_0`` for a first page); the
    controller uses it to evict chains from the tail. ``engine_key``: the engine's own
    name for the page (:mod:`hicache.engine_keys`), kept with it so that the sidecar's
    KV events name it so; None for an engine whose pages are named by their hashes.
    """

    component: ComponentType
    page_hash: bytes
    parent_hash: bytes
    device_index: int
    engine_key: bytes | None = None

    @property
    def key(self) -> PageKey:
        return PageKey(self.component, self.page_hash)


def page_keys_of(components: Sequence, hashes: Sequence[bytes]) -> list[PageKey]:
    """``PageKey(c, h)`` of each pair, built without a frozen dataclass's per-field
    ``__setattr__`` (a third of the time: the sidecar builds one per page it is asked for);
    the keys are equal, hash equal and stay as immutable as any other."""
    out: list[PageKey] = []
    append, new = out.append, object.__new__
    for c, h in zip(components, hashes):
        key = new(PageKey)
        fields = key.__dict__
        fields["component"] = c
        fields["page_hash"] = h
        append(key)
    return out


def page_refs_of(
    components: Sequence,
    hashes: Sequence[bytes],
    parents: Sequence[bytes],
    device_indices: Sequence[int],
    engine_keys: Sequence[bytes | None] | None = None,
) -> list[PageRef]:
    """``PageRef`` of each row of the columns, built as :func:`page_keys_of` builds keys."""
    out: list[PageRef] = []
    append, new = out.append, object.__new__
    keys = engine_keys if engine_keys is not None else [None] * len(components)
    for c, h, p, d, e in zip(components, hashes, parents, device_indices, keys):
        ref = new(PageRef)
        fields = ref.__dict__
        fields["component"] = c
        fields["page_hash"] = h
        fields["parent_hash"] = p
        fields["device_index"] = d
        fields["engine_key"] = e
        append(ref)
    return out


@dataclass
class LookupResult:
    """Per component, the presence of each page of the asked chain (``Presence`` values)."""

    presence: dict[ComponentType, np.ndarray]

    def leading(self, component: ComponentType, max_tier: Presence = Presence.DISK) -> int:
        """How many leading pages of ``component`` are present at ``max_tier`` or faster."""
        p = self.presence[component]
        ok = (p != P_ABSENT) & (p <= int(max_tier))
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if bad.size else int(p.size)


@dataclass
class PinReceipt:
    """Pages pinned against eviction until unpinned or ``deadline`` (monotonic seconds).

    ``engine_id``: the engine that holds the pin (a shared controller's); ``generation``:
    the sidecar session it was made on (a sidecar client's: a pin of a session that is
    gone is released already, and is neither loaded from nor unpinned); ``host_pages``:
    the host page of each key (-1: not on host), when the client maps the sidecar's host
    pages and copies from them itself (controller/client/host_share.py).
    """

    pin_id: int
    keys: list[PageKey]
    deadline: float
    engine_id: str | None = None
    generation: int | None = None
    host_pages: list[int] | None = None


class TransferHandle(Protocol):
    """An asynchronous copy. ``done()`` never blocks; ``wait`` blocks up to ``timeout_s``.

    ``done()`` is True only once the copy can no longer touch the device pages it names
    (it finished, failed, or is known never to run): a ``wait`` that times out says the
    transfer failed, but the caller keeps the pages until ``done()``.
    """

    def done(self) -> bool: ...

    def wait(self, timeout_s: float | None = None) -> bool:
        """True when the transfer finished successfully; False on failure or timeout."""
        ...


class CompletedTransfer:
    """A transfer that finished before it was returned."""

    def __init__(self, ok: bool) -> None:
        self.ok = ok

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.ok


@dataclass(frozen=True)
class LoadResult:
    """What ``load`` returns. ``ok``: every byte arrived. On failure, ``pending`` is the
    copy a controller gave up waiting on that may still write into the load's slots (a
    remote sidecar that did not answer in time): the caller frees the slots only once
    it is done (see ``UnifiedRadixCache``'s quarantine). None: nothing writes into them
    after the return. True as a truth value exactly when ``ok``."""

    ok: bool
    pending: TransferHandle | None = None

    LOADED: ClassVar[LoadResult]
    FAILED: ClassVar[LoadResult]

    def __bool__(self) -> bool:
        return self.ok


LoadResult.LOADED = LoadResult(True)
LoadResult.FAILED = LoadResult(False)


class LoadOutcome(LoadResult):
    """A failed load whose copy may still run (``LoadResult(False, pending)``), under the
    name it had before ``load`` returned a typed result."""

    def __init__(self, pending: TransferHandle) -> None:
        super().__init__(False, pending)


def unsettled_load(result: object) -> TransferHandle | None:
    """The handle to wait on before a failed load's slots may be reused (None: at once)."""
    pending = getattr(result, "pending", None)
    return None if pending is None or pending.done() else pending


@dataclass(frozen=True)
class LayerGroups:
    """A model's layers cut into groups of consecutive layers, the unit of a layer-wise
    load: group ``g`` holds model layers ``[g * size, (g + 1) * size)`` and, per component,
    the pool layers ``spans[g][component]`` (``(lo, hi)``) that those model layers own.
    Groups are loaded, and waited for, in order."""

    size: int
    num_layers: int
    spans: tuple[dict[ComponentType, tuple[int, int]], ...]

    @classmethod
    def of(cls, owners: dict[ComponentType, Sequence[int]], size: int = 1) -> LayerGroups:
        """Groups of ``size`` model layers, where ``owners[c][i]`` is the model layer that
        pool layer ``i`` of component ``c`` belongs to (non-decreasing in ``i``)."""
        if size < 1:
            raise ValueError(f"a layer group holds at least one layer, not {size}")
        for comp, owner in owners.items():
            if any(b < a for a, b in pairwise(owner)):
                raise ValueError(f"{comp.name} pool layers must follow the model's order")
        num_layers = 1 + max((max(o) for o in owners.values() if len(o)), default=-1)
        spans = []
        for lo in range(0, num_layers, size):
            span = {}
            for comp, owner in owners.items():
                inside = [i for i, j in enumerate(owner) if lo <= j < lo + size]
                if inside:
                    span[comp] = (inside[0], inside[-1] + 1)
            spans.append(span)
        return cls(size, num_layers, tuple(spans))

    @classmethod
    def of_layout(cls, layout: ModelLayout, size: int = 1) -> LayerGroups:
        """Groups of the layout's own layers (``layout.layer_kinds``' positions)."""
        owners: dict[ComponentType, list[int]] = {}
        for j, kind in enumerate(layout.layer_kinds):
            owners.setdefault(kind.component, []).append(j)
        return cls.of(owners, size)

    def __len__(self) -> int:
        return len(self.spans)

    def group_of(self, layer: int) -> int:
        """The group that model layer ``layer`` belongs to."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} is outside the model's {self.num_layers} layers")
        return layer // self.size


class LayerLoad(Protocol):
    """A load started for all layers at once and waited on group by group, in order
    (:meth:`CacheController.start_layer_load`).

    ``wait_group(g)`` returns once group ``g``'s bytes may be read by the caller's next
    work (on a GPU: the caller's current stream waits for the group's copy, the host does
    not; on a CPU: the copy has ended), or False when the load failed at or before that
    group (injected, a copy that could not be issued, a timeout). ``finish()`` must be
    called once the caller is done with it, whatever happened: it waits for every copy
    issued, releases what the load held and says whether every byte arrived; a second
    call returns the same."""

    groups: LayerGroups

    def wait_group(self, group: int) -> bool: ...

    def finish(self) -> LoadResult: ...


class WholeLayerLoad:
    """A :class:`LayerLoad` over a controller that loads only whole: the load runs at
    start, and every group is ready when it has succeeded."""

    def __init__(self, groups: LayerGroups, result: LoadResult) -> None:
        self.groups = groups
        self._result = result

    def wait_group(self, group: int) -> bool:
        return bool(self._result)

    def finish(self) -> LoadResult:
        return self._result


def start_layer_load(
    controller: CacheController,
    refs: Sequence[PageRef],
    pin: PinReceipt,
    groups: LayerGroups,
    timeout_s: float,
) -> LayerLoad:
    """``controller.start_layer_load`` where it has one, else its whole ``load`` as a
    :class:`WholeLayerLoad` (a controller without layer-wise copies, a test double)."""
    start = getattr(controller, "start_layer_load", None)
    if start is not None:
        return start(refs, pin, groups, timeout_s)
    return WholeLayerLoad(groups, controller.load(refs, pin, timeout_s))


class ControllerError(HicacheError):
    """The controller could not do what was asked; the caller treats it as a miss."""


class LoadQuotaExceeded(ControllerError):
    """A load-back would exceed its quota of device memory or in-flight bytes."""


@runtime_checkable
class CacheController(Protocol):
    """Host and disk tiers, shared by the engine workers of a node."""

    def register(self, layout: ModelLayout, page_size: int, pools: DevicePools) -> None:
        """Make the engine's device pools addressable; refuses a mismatched layout."""
        ...

    def lookup(
        self,
        page_hashes: Sequence[bytes],
        components: Sequence[ComponentType],
        tenant: str | None = None,
    ) -> LookupResult:
        """Where each page of the chain ``page_hashes`` is, per component. Never blocks on
        disk reads; never raises for a missing page. ``tenant``: whose lookup it is (for
        the controller's per-tenant counts only)."""
        ...

    def backup(
        self, refs: Sequence[PageRef], ready_event: Any = None, tenant: str | None = None
    ) -> TransferHandle:
        """Copy device pages to the host tier (and on to disk by policy).

        ``ready_event`` (a CUDA event) is waited on before the device pages are read. The
        caller keeps the device pages allocated and unchanged until the handle is done.
        Pages the controller already holds are not copied again. The handle's ``wait()``
        is True only when every page is held by the controller afterwards. New pages are
        ``tenant``'s: they count to its quotas (a page that does not fit is not held).
        """
        ...

    def pin(self, keys: Sequence[PageKey], ttl_s: float) -> PinReceipt | None:
        """Pin pages for a load; None when any of them is absent (nothing pinned then)."""
        ...

    def load(self, refs: Sequence[PageRef], pin: PinReceipt, timeout_s: float) -> LoadResult:
        """Copy pinned pages (reading disk into host first where needed) into the device
        slots of ``refs``. ``ok`` when every byte arrived; a failure (or an exception)
        leaves the device slots' contents undefined and the caller frees them, once the
        result's ``pending`` handle is done when it has one (a remote sidecar that did
        not answer in time: its copy may still write)."""
        ...

    def unpin(self, pin: PinReceipt) -> None:
        """Release a pin; unpinning twice or after expiry is harmless."""
        ...

    def prefetch(self, keys: Sequence[PageKey]) -> TransferHandle:
        """Start reading disk pages into the host tier."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
