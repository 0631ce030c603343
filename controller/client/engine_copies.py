"""Stores and loads an engine copies itself, through the sidecar's host pages mapped
read-write into it: the host pages the sidecar hands a store (``store_begin``), the commit
that makes them visible (``store_commit``). The loads' side is a pin that names host pages
(:meth:`SidecarController.pin`) and an unpin that reports the copy; a layer-wise load
(:meth:`EngineCopies.start_layer_load`) copies them group of layers by group. A part of
:class:`~hicache.controller.client.sidecar_client.SidecarController`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.controller.wire.fields import INLINE_MAX_PAGES, MAX_PIN_KEYS
from hicache.controller.wire.protocol import Verb
from hicache.controller.wire.verbs import PinArgs, StoreBeginArgs, StoreCommitArgs
from hicache.controller_api import (
    ControllerError,
    LayerGroups,
    LayerLoad,
    LoadResult,
    PageKey,
    PageRef,
    PinReceipt,
    WholeLayerLoad,
)

if TYPE_CHECKING:
    from hicache.controller.client.channel import Channel, SidecarClientConfig
    from hicache.controller.client.disk_share import DiskShare
    from hicache.controller.client.host_share import HostShare, WritableHostPages

log = logging.getLogger("hicache.sidecar.client")
# How long the map of a sidecar's LMDB file is kept for the next session (see
# client/disk_share.py): a restart takes seconds; a sidecar away longer is not restarting.
KEPT_DISK_MAP_S = 120.0


@dataclass(frozen=True)
class StoreReservation:
    """Host pages handed to this engine for one store: ``pages[i]`` is the page to write
    for ``refs[i]`` of :meth:`SidecarController.begin_store` (-1: held already, -2: no
    room), in ``host`` (the mapping of the session ``generation``)."""

    store_id: int
    pages: np.ndarray
    generation: int
    host: WritableHostPages


@dataclass(frozen=True)
class PendingBegin:
    """A ``store_begin`` sent and not yet answered (:meth:`EngineCopies.send_begin_store`)."""

    request_id: int
    generation: int
    host: WritableHostPages


@dataclass(frozen=True)
class PendingPin:
    """A ``pin`` sent and not yet answered (:meth:`SidecarController.send_pin`)."""

    request_id: int
    generation: int
    keys: list
    ttl_s: float


class EngineCopies:
    """The engine-copied stores of :class:`SidecarController` (which sets the attributes
    below and the ``_call`` they go through)."""

    #: pages in one ``store_begin`` or pin that the sidecar's I/O thread answers without
    #: holding up other engines' lookups for long (a larger one is better sent in parts)
    io_part_pages = INLINE_MAX_PAGES

    endpoint: str
    config: SidecarClientConfig
    _channel: Channel
    _open: bool
    _registration: Any
    _pages: WritableHostPages | None
    _pages_generation: int
    _share: HostShare | None
    _instance: tuple[int, int | None]
    _pools: Any
    counters: Any
    _kept_disk: DiskShare | None = None  # an ended session's disk map (_keep_disk_reads)
    _kept_disk_at = 0.0  # when it was kept (time.monotonic)

    def _call(self, verb: Verb, args: Any, timeout_s: float, spin: bool = False) -> Any: ...
    def _call_failed(self, exc: Any) -> None: ...
    def _succeeded(self) -> None: ...

    def load(self, refs: Sequence[PageRef], pin: PinReceipt, timeout_s: float) -> LoadResult: ...

    def start_layer_load(
        self, refs: Sequence[PageRef], pin: PinReceipt, groups: LayerGroups, timeout_s: float
    ) -> LayerLoad:
        """:meth:`load` waited on by layer group: copied here group by group where
        :meth:`load` would copy here (from the shared host pages), else loaded whole, every
        group ready at its end."""
        share = self._share
        if share is not None and share.generation == pin.generation == self._channel.generation:
            started = None if self._open else share.try_start_layers(refs, pin, groups)
            if started is not None:
                return started
        return WholeLayerLoad(groups, self.load(refs, pin, timeout_s))

    def end_disk_reads(self) -> None:
        """Stop reading pages only on disk here until the next session: the read-only map
        of the sidecar's LMDB file closed now, the one kept from an earlier session too
        (client/disk_share.py), e.g. by a caller that stopped the sidecar and drops the
        file's cached pages."""
        share, kept, self._kept_disk = self._share, self._kept_disk, None
        if share is not None:
            share.close()
        if kept is not None:
            kept.close()

    def _keep_disk_reads(self) -> None:
        """The session ended: no disk page is read here until the next one, whose share
        takes the map of the sidecar's LMDB file over if it is still the same file
        (:meth:`DiskShare.keep`)."""
        share = self._share
        disk = None if share is None else share.disk
        kept = None if disk is None else disk.keep()
        if kept is not None:
            old, self._kept_disk = self._kept_disk, kept
            self._kept_disk_at = time.monotonic()
            if old is not None:
                old.close()

    def _expire_kept_disk(self, now: float) -> None:
        """Close the kept map once no session took it over for ``KEPT_DISK_MAP_S``: a
        sidecar gone for good (its directory perhaps deleted) leaves no file mapped here."""
        kept = self._kept_disk
        if kept is not None and now - self._kept_disk_at > KEPT_DISK_MAP_S:
            self._kept_disk = None
            kept.close()

    def _open_share(
        self, layout: Any, page_size: int, generation: int, disk_reads: int | None
    ) -> HostShare | None:
        """The host pages of session ``generation`` mapped here (``HostShare.for_session``),
        through the disk map kept from the last session where it is of the same file."""
        # Loaded here: an engine that copies nothing itself never maps host pages.
        from hicache.controller.client.host_share import HostShare

        kept, self._kept_disk = self._kept_disk, None
        try:
            share = HostShare.for_session(
                self.endpoint, layout, page_size, self._pools, generation, disk_reads, kept
            )
        finally:
            if kept is not None:
                kept.close()  # not taken over (a no-op where it was)
        if share is not None and share.disk is not None and share.disk.kept:
            self.counters["disk_map_kept"] += 1
        return share

    def _drop_share(self, keep: bool = False) -> None:
        """Forget the mapped host pages of an earlier session, its disk reads ended (their
        map kept for the next session with ``keep``)."""
        if keep:
            self._keep_disk_reads()
        else:
            self.end_disk_reads()
        self._share = None

    def map_host_pages(self, device: Any) -> WritableHostPages | None:
        """The sidecar's host pages mapped read-write here (page-locked for a GPU
        ``device``), for an engine that copies its stores into the pages
        :meth:`begin_store` hands it and its loads out of the pages a pin names; mapped
        again after a reconnect. None: not shared (a TCP endpoint, or a sidecar without
        shared pages), or no session."""
        from hicache.controller.client.host_share import WritableHostPages

        gen = self._channel.generation
        if self._open or self._registration is None:
            return None
        if self._pages is None or self._pages_generation != gen:
            layout, page_size, _ = self._registration
            old, self._pages = self._pages, None
            if old is not None:
                old.close()
            self._pages = WritableHostPages.open(self.endpoint, layout, page_size, device)
            self._pages_generation = gen
        return self._pages

    def begin_store(
        self, refs: Sequence[PageRef], ttl_s: float, tenant: str | None = None
    ) -> StoreReservation | None:
        """Host pages for ``refs`` that the engine writes itself, then commits
        (:meth:`commit_store`); None when the sidecar is unavailable or its pages are not
        mapped here (:meth:`map_host_pages`). New pages are ``tenant``'s."""
        pages = self._pages
        if pages is None or self._pages_generation != self._channel.generation or not refs:
            return None
        try:
            args = StoreBeginArgs(list(refs), float(ttl_s), tenant)
            res = self._call(Verb.STORE_BEGIN, args, self.config.request_timeout_s, True)
        except ControllerError as exc:
            log.debug("store_begin failed: %s", exc)
            return None
        return StoreReservation(
            res.store_id,
            np.frombuffer(res.host_pages, dtype="<i4").astype(np.int64),
            self._pages_generation,
            pages,
        )

    def send_begin_store(
        self, refs: Sequence[PageRef], ttl_s: float, tenant: str | None = None
    ) -> PendingBegin | None:
        """:meth:`begin_store` in two halves: the request goes now, its reservation is
        taken with :meth:`receive_begin_store`, so that the sidecar hands out the pages of
        the next part of a store while this process copies the current one. None when
        nothing was sent (as :meth:`begin_store` answers None). A request sent must be
        received (a reservation nobody commits only expires)."""
        pages = self._pages
        if pages is None or self._pages_generation != self._channel.generation or not refs:
            return None
        if self._open:
            return None
        args = StoreBeginArgs(list(refs), float(ttl_s), tenant)
        try:
            rid = self._channel.send(Verb.STORE_BEGIN, args, self.config.request_timeout_s)
        except ControllerError as exc:
            log.debug("store_begin not sent: %s", exc)
            return None
        return PendingBegin(rid, self._pages_generation, pages)

    def receive_begin_store(self, pending: PendingBegin) -> StoreReservation | None:
        """The reservation a :meth:`send_begin_store` asked for; None when it failed."""
        if pending.generation != self._channel.generation:
            self._channel.forget(pending.request_id)
            return None
        try:
            res = self._channel.wait(
                pending.request_id,
                self.config.request_timeout_s,
                spin_s=self.config.reply_spin_s,
            )
        except ControllerError as exc:
            self._call_failed(exc)
            log.debug("store_begin failed: %s", exc)
            return None
        self._succeeded()
        return StoreReservation(
            res.store_id,
            np.frombuffer(res.host_pages, dtype="<i4").astype(np.int64),
            pending.generation,
            pending.host,
        )

    def begin_answered(self, pending: PendingBegin) -> bool:
        """Whether the answer to a :meth:`send_begin_store` is in (and not yet taken
        by :meth:`receive_begin_store`)."""
        gen = self._channel.generation
        return pending.generation == gen and self._channel.arrived(pending.request_id)

    def commit_store(self, store: StoreReservation, written: bool, wait: bool = True) -> int:
        """Publish (``written``) or give back the pages of ``store``; the pages published
        (0 when its session, or its deadline, is gone). Without ``wait`` the commit is
        sent and not waited for, and the pages handed out are returned: the sidecar
        applies one connection's commits in order, so a later waited-for commit's answer
        says the earlier ones are applied (one lost with its session only leaves pages
        that expire unseen)."""
        if store.generation != self._channel.generation or self._open:
            return 0
        args = StoreCommitArgs(store.store_id, written)
        try:
            if not wait:
                self._channel.send(
                    Verb.STORE_COMMIT, args, self.config.request_timeout_s, reply_wanted=False
                )
                return int((store.pages >= 0).sum()) if written else 0
            return self._call(Verb.STORE_COMMIT, args, self.config.request_timeout_s, True).pages
        except ControllerError as exc:
            log.debug("store_commit failed: %s", exc)
            return 0

    def send_pin(
        self, keys: Sequence[PageKey], ttl_s: float, under: int | None = None,
        host_pages: bool = False,
    ) -> PendingPin | None:  # fmt: skip
        """:meth:`pin` in two halves, for an engine that pins the next part of a load
        while it copies this one: the request goes now, :meth:`receive_pin` takes its
        receipt. None when nothing was sent (``pin_at_load``, too many keys, no session):
        the caller pins with :meth:`pin`. A request sent must be received (a pin nobody
        takes only lapses at its deadline). ``under``: pinned only if that pin (of
        another session of this sidecar) still holds once these keys are pinned, else the
        receipt is None. ``host_pages``: the receipt names each page's host page even
        where this client maps none (for another session of the engine to copy under)."""
        if len(keys) > MAX_PIN_KEYS or self.config.pin_at_load or self._open:
            return None
        try:
            args = self._pin_args(keys, ttl_s, host_pages, under)
            rid = self._channel.send(Verb.PIN, args, self.config.request_timeout_s)
        except ControllerError as exc:
            log.debug("pin not sent: %s", exc)
            return None
        return PendingPin(rid, self._channel.generation, list(keys), float(ttl_s))

    def receive_pin(self, pending: PendingPin) -> PinReceipt | None:
        """The receipt of a :meth:`send_pin`; None when a page is absent or it failed."""
        if pending.generation != self._channel.generation:
            self._channel.forget(pending.request_id)
            return None
        try:
            res = self._channel.wait(
                pending.request_id, self.config.request_timeout_s, spin_s=self.config.reply_spin_s
            )
        except ControllerError as exc:
            self._call_failed(exc)
            log.debug("pin failed: %s", exc)
            return None
        self._succeeded()
        return self._receipt(res, pending.keys, pending.ttl_s, pending.generation)

    def _pin_args(
        self, keys: Sequence[PageKey], ttl_s: float, host_pages: bool = False,
        under: int | None = None,
    ) -> PinArgs:  # fmt: skip
        wants_pages = host_pages or self._share is not None or self._pages is not None
        return PinArgs(list(keys), float(ttl_s), True if wants_pages else None, under)

    def sidecar_instance(self, generation: int | None) -> int | None:
        """The instance id of the sidecar this client's session ``generation`` talks to
        (a pin id or host page means something only there); None when unknown."""
        gen, instance = self._instance
        return instance if generation == gen else None

    def mapped_session(self) -> tuple[int, int] | None:
        """(generation, sidecar instance) of the host pages mapped here now
        (:meth:`map_host_pages`); None when none are, or the sidecar did not say."""
        gen = self._pages_generation
        instance = self.sidecar_instance(gen) if self._pages is not None else None
        return None if instance is None else (gen, instance)

    @staticmethod
    def _receipt(res: Any, keys: Sequence[PageKey], ttl_s: float, generation: int):
        if res.pin_id is None:
            return None
        deadline = time.monotonic() + (ttl_s if res.ttl_s is None else res.ttl_s)
        pages = None if res.host_pages is None else np.frombuffer(res.host_pages, np.int32)
        return PinReceipt(
            res.pin_id,
            list(keys),
            deadline,
            generation=generation,
            host_pages=None if pages is None else pages.tolist(),
        )
