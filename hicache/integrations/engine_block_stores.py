"""The stores of :class:`~hicache.integrations.engine_blocks.EngineBlocks`: an engine's
blocks copied straight into host pages the sidecar hands out (``store_begin``), committed
(``store_commit``) part by part, and the pages of a store known a step before it runs
asked for then (:meth:`BlockStores.prebook`), so that no round trip to the sidecar
precedes its first copy."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hicache import PageRef
from hicache.integrations.engine_block_layers import wait_all

if TYPE_CHECKING:
    from hicache.controller.client import PendingBegin, SidecarController, StoreReservation


@dataclass(frozen=True)
class StorePrebook:
    """The ``store_begin`` requests of a store's parts sent before the store runs
    (:meth:`EngineBlocks.prebook`): ``sent[i]`` is part ``i``'s (None: not sent), for
    ``pages`` pages; answers are taken by :meth:`EngineBlocks.store` until ``use_by``
    (monotonic seconds, half the reservation's time to live), else asked for again."""

    sent: tuple[PendingBegin | None, ...]
    pages: int
    use_by: float


class BlockStores:
    """The stores of :class:`EngineBlocks` (which sets the attributes below, its group
    copies and the parts a store is cut in)."""

    client: SidecarController
    _host: object
    begins_on_path: int  # store_begin requests a store sent itself (not prebooked)
    prebook_missed: int  # prebooked parts asked for again: stale, or failed

    def _copies_now(self) -> list | None: ...
    def _parts(self, n: int) -> list[tuple[int, int]]: ...
    def _start(self, copies: list, groups, blocks, pages, to_host: bool) -> list: ...

    def prebook(
        self, refs: Sequence[PageRef], ttl_s: float, tenant: str | None = None
    ) -> StorePrebook | None:
        """Send the ``store_begin`` requests of a store of ``refs`` now, a part each (the
        parts :meth:`store` copies), without waiting for their answers: handed to
        :meth:`store` as ``prebook``, it copies into the pages they hand out. One never
        stored must be given back (:meth:`give_back`), else its pages stay filling until
        the reservation's deadline. None when nothing was sent."""
        if not refs or self._copies_now() is None:
            return None
        sent = tuple(
            self.client.send_begin_store(refs[lo:hi], ttl_s, tenant)
            for lo, hi in self._parts(len(refs))
        )
        if all(p is None for p in sent):
            return None
        return StorePrebook(sent, len(refs), time.monotonic() + ttl_s / 2)

    def prebook_answered(self, prebook: StorePrebook) -> bool:
        """Whether every answer of ``prebook`` is in."""
        return all(p is None or self.client.begin_answered(p) for p in prebook.sent)

    def give_back(self, prebook: StorePrebook) -> None:
        """Take the answers of a prebook that will not be stored and give their pages
        back (nothing of them was written or visible)."""
        self._give_back(list(prebook.sent))

    def _give_back(self, sent: Sequence[PendingBegin | None]) -> None:
        for pending in sent:
            unused = None if pending is None else self.client.receive_begin_store(pending)
            if unused is not None:
                self.client.commit_store(unused, False)

    def _prebooked(self, prebook: StorePrebook | None, n_parts: int) -> list | None:
        """The prebook's requests, a part each, when it is for these parts and still in
        time; else None (and the ones it sent given back)."""
        if prebook is None:
            return None
        if len(prebook.sent) != n_parts or time.monotonic() > prebook.use_by:
            self.prebook_missed += sum(p is not None for p in prebook.sent)
            self.give_back(prebook)
            return None
        return list(prebook.sent)

    def _reserve(
        self, pending: PendingBegin | None, prebooked: bool, refs: Sequence[PageRef],
        ttl_s: float, tenant: str | None,
    ) -> StoreReservation | None:  # fmt: skip
        """A part's reservation: the answer to ``pending``; a prebooked part whose answer
        failed or belongs to an earlier session (the sidecar restarted) is asked for again,
        in the session mapped now."""
        store = None if pending is None else self.client.receive_begin_store(pending)
        if store is not None or not prebooked:
            return store
        if pending is not None:
            self.prebook_missed += 1
        if self._copies_now() is None:  # mapped again after a reconnect
            return None
        self.begins_on_path += 1
        return self.client.begin_store(refs, ttl_s, tenant)

    def store(
        self,
        refs: Sequence[PageRef],
        groups: Sequence[int],
        blocks: Sequence[int],
        ttl_s: float,
        on_copied: Callable[[], object] | None = None,
        tenant: str | None = None,
        prebook: StorePrebook | None = None,
    ) -> tuple[int, int]:
        """Store block ``blocks[i]`` of group ``groups[i]`` as ``refs[i]``; returns (pages
        written, pages not stored: no room, or no sidecar). ``on_copied`` runs once the
        blocks are no longer read; new pages are ``tenant``'s (the sidecar's quotas).
        Raises on a copy error: the parts copied before it are published, no page of the
        part that failed (or of one after it) becomes visible, and their host pages go
        back to the sidecar.

        In parts of ``chunk_bytes`` (on a GPU the first smaller): the next part's pages
        are asked for before this part's copy starts, and a part's copy runs while the one
        before it is committed, so the sidecar's bookkeeping runs beside the copies instead
        of before and after them. A store of one part asks once and commits once.

        ``prebook`` (:meth:`prebook` of these ``refs``): every part's pages were asked for
        already, so the store only takes the answers; a part whose answer failed, is from
        an earlier session or came too long ago is asked for as without one.

        **No commit is waited for**, the last one neither: the store ends when its last
        copy has ended and its commit is sent. The sidecar applies one connection's
        requests in order, so this engine's own later lookups, pins and loads find the
        pages; another client's find them once the sidecar has read the commit (its I/O
        thread reads requests in their order of arrival, and the commit left first): a
        lookup that overtook it is a miss, never a wrong page. The pages counted as
        written are those the sidecar handed out for it; a commit it refuses (late, or
        of a session gone) gives them back unseen, as ever, and only that count says
        more than was published."""
        copies = self._copies_now()
        parts = self._parts(len(refs))
        ahead = self._prebooked(prebook, len(parts))
        if copies is None:
            if ahead is not None:
                self._give_back(ahead)
            return 0, len(refs)
        g_arr, b_arr = np.asarray(groups), np.asarray(blocks, dtype=np.int64)
        if len(parts) == 1:
            return self._store_whole(refs, g_arr, b_arr, ttl_s, on_copied, tenant, ahead)
        if ahead is not None and all(p is None or self.client.begin_answered(p) for p in ahead):
            return self._store_answered(refs, parts, ahead, g_arr, b_arr, ttl_s, on_copied, tenant)
        committed = not_stored = 0
        pending: list = []  # (reservation, events) started, not yet committed
        if ahead is None:
            ahead = [None] * len(parts)
            ahead[0] = self._send_begin(refs[parts[0][0] : parts[0][1]], ttl_s, tenant)
        try:
            for i, (lo, hi) in enumerate(parts):
                asked, ahead[i] = ahead[i], None
                store = self._reserve(asked, prebook is not None, refs[lo:hi], ttl_s, tenant)
                if i + 1 < len(parts) and prebook is None:  # the next part's pages now
                    nlo, nhi = parts[i + 1]
                    ahead[i + 1] = self._send_begin(refs[nlo:nhi], ttl_s, tenant)
                copies = self._copies_now()
                if store is None or copies is None or store.host is not self._host:
                    if store is not None:  # of a session gone: nothing to write into
                        self.client.commit_store(store, False)
                    not_stored += hi - lo
                    continue
                not_stored += int((store.pages == -2).sum())
                try:
                    events = self._start(copies, g_arr[lo:hi], b_arr[lo:hi], store.pages, True)
                except Exception:
                    self.client.commit_store(store, False)
                    committed += self._commit_copied(pending)  # the part before is whole
                    raise
                # the previous part: its copy ends while this one runs
                committed += self._commit_copied(pending)
                pending.append((store, events))
            committed += self._commit_copied(pending)  # the last (see the docstring)
        finally:
            self._give_back(ahead)  # parts asked for and not copied: their pages back
            for done, done_events in pending:  # a copy failed: give the rest back
                wait_all(done_events, quiet=True)
                self.client.commit_store(done, False)
            if on_copied is not None:
                on_copied()
        return committed, not_stored

    def _send_begin(
        self, refs: Sequence[PageRef], ttl_s: float, tenant: str | None
    ) -> PendingBegin | None:
        self.begins_on_path += 1
        return self.client.send_begin_store(refs, ttl_s, tenant)

    def _store_whole(
        self, refs: Sequence[PageRef], groups: np.ndarray, blocks: np.ndarray,
        ttl_s: float, on_copied: Callable[[], object] | None, tenant: str | None,
        ahead: list | None,
    ) -> tuple[int, int]:  # fmt: skip
        """:meth:`store` of one part: its pages asked for (or prebooked: ``ahead``),
        copied, committed; nothing to overlap, so no request goes before its answer is
        needed."""
        try:
            if ahead is None:
                self.begins_on_path += 1
                store = self.client.begin_store(refs, ttl_s, tenant)
            else:
                store = self._reserve(ahead[0], True, refs, ttl_s, tenant)
            copies = self._copies_now()
            if store is not None and (copies is None or store.host is not self._host):
                self.client.commit_store(store, False)  # of a session gone
                store = None
            if store is None:
                return 0, len(refs)
            try:
                wait_all(self._start(copies, groups, blocks, store.pages, True))
            except Exception:
                self.client.commit_store(store, False)
                raise
        finally:
            if on_copied is not None:  # the blocks are no longer read
                on_copied()
        # Not waited for (see :meth:`store`).
        return self.client.commit_store(store, True, wait=False), int((store.pages == -2).sum())

    def _store_answered(
        self, refs: Sequence[PageRef], parts: list[tuple[int, int]], ahead: list,
        groups: np.ndarray, blocks: np.ndarray, ttl_s: float,
        on_copied: Callable[[], object] | None, tenant: str | None,
    ) -> tuple[int, int]:  # fmt: skip
        """:meth:`store` of a prebook whose every answer is in: nothing left to overlap,
        so the parts are copied as one (a launch per group, not per part and group), then
        each is committed, its answer not waited for."""
        stores: list = []
        not_stored = 0
        copied = False
        try:
            pages = np.full(len(refs), -1, dtype=np.int64)
            for i, (lo, hi) in enumerate(parts):
                asked, ahead[i] = ahead[i], None
                store = self._reserve(asked, True, refs[lo:hi], ttl_s, tenant)
                if store is not None and store.host is not self._host:
                    self.client.commit_store(store, False)  # of a session gone
                    store = None
                if store is None:
                    not_stored += hi - lo
                    continue
                stores.append(store)
                pages[lo:hi] = store.pages
                not_stored += int((store.pages == -2).sum())
            copies = self._copies_now()
            if copies is None or any(st.host is not self._host for st in stores):
                return 0, len(refs)  # mapped again meanwhile: nothing to write into
            wait_all(self._start(copies, groups, blocks, pages, True))
            copied = True
        finally:
            self._give_back(ahead)  # parts not taken (an error on the way)
            if not copied:  # handed out, not (wholly) written: given back unseen
                for st in stores:
                    self.client.commit_store(st, False)
            if on_copied is not None:
                on_copied()
        committed = sum(self.client.commit_store(st, True, wait=False) for st in stores)
        return committed, not_stored

    def _commit_copied(self, pending: list) -> int:
        """Wait for the copies of the parts in ``pending`` and publish them (not waiting
        for the answer), taking each out of ``pending`` only once its copy ended: one
        whose copy failed stays there for the caller to give back."""
        committed = 0
        while pending:
            done, done_events = pending[-1]
            wait_all(done_events)
            pending.pop()
            committed += self.client.commit_store(done, True, wait=False)
        return committed
