"""An in-memory CacheController for tree tests: it really copies bytes, and can fail on
demand in every way a real controller can (False, an exception, a timeout, a quota, a
page gone between pin and load), or give up on a copy that still runs and settles later
(an unanswered sidecar: a backup not done for a while, a load that may still write)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from hicache.controller_api import (
    CompletedTransfer,
    ControllerError,
    LoadOutcome,
    LoadQuotaExceeded,
    LookupResult,
    PageKey,
    PageRef,
    PinReceipt,
    Presence,
)
from hicache.types import ComponentType

FAULTS = ("return_false", "raise", "timeout", "quota", "pin_refused", "evicted_meanwhile")

# What a late load's copy leaves in the device slots it was given: no marker of
# tests/support/cache.py (K >= 4096, V <= -4096, states >= 0) has this value.
GARBAGE = -1.5


class LateTransfer:
    """A copy the controller stopped waiting for but that still runs: ``done()`` is False
    and ``wait()`` times out with False until ``settle`` runs the copy (what a sidecar
    that has not answered yet does later)."""

    def __init__(self, copy: Callable[[], bool]) -> None:
        self._copy = copy
        self._done = False
        self._ok = False

    def done(self) -> bool:
        return self._done

    def wait(self, timeout_s: float | None = None) -> bool:
        # Times out at once: only the test decides when the copy runs.
        return self._ok

    def settle(self, ok: bool = True) -> None:
        """Run the copy now (``ok``), or let it fail without touching anything."""
        if not self._done:
            self._ok = bool(self._copy()) if ok else False
            self._done = True


class FakeController:
    """Host "tier" = a dict of page copies; ``on_disk`` keys report as DISK."""

    def __init__(self) -> None:
        self.pages: dict[PageKey, tuple[torch.Tensor, ...]] = {}
        self.on_disk: set[PageKey] = set()
        self.pins: dict[int, PinReceipt] = {}
        self.fault: str | None = None
        self.fail_backups = False
        # Late transfers (none by default): each of the next ``late_backups`` backups runs
        # only at its ``settle``, reading the device pages then (and checking that they
        # are still allocated and unchanged, as the protocol asks of the caller); each of
        # the next ``late_loads`` loads gives up with a LoadOutcome whose copy writes
        # GARBAGE into its slots at settle. ``unsettled`` holds the transfers not settled
        # yet, oldest first.
        self.late_backups = 0
        self.late_loads = 0
        self.unsettled: list[LateTransfer] = []
        self.loads = 0
        self.backups = 0
        self.prefetched: list[PageKey] = []
        self._pin_ids = itertools.count(1)
        self.pools = None

    def register(self, layout, page_size, pools) -> None:
        self.layout, self.page_size, self.pools = layout, page_size, pools

    # -- copies --------------------------------------------------------------------------

    def _slots(self, page: int) -> torch.Tensor:
        return torch.arange(page * self.page_size, (page + 1) * self.page_size)

    def _read(self, ref: PageRef) -> tuple[torch.Tensor, ...]:
        if ref.component is ComponentType.FULL:
            return (self.pools.full.buffer[:, :, self._slots(ref.device_index)].clone(),)
        if ref.component is ComponentType.SWA:
            return (self.pools.swa.buffer[:, :, self._slots(ref.device_index)].clone(),)
        m = self.pools.mamba
        return (m.conv[:, ref.device_index].clone(), m.ssm[:, ref.device_index].clone())

    def _pool(self, component: ComponentType):
        if component is ComponentType.FULL:
            return self.pools.full
        return self.pools.swa if component is ComponentType.SWA else self.pools.mamba

    def _write(self, ref: PageRef, data: tuple[torch.Tensor, ...]) -> None:
        if ref.component is ComponentType.FULL:
            self.pools.full.buffer[:, :, self._slots(ref.device_index)] = data[0]
        elif ref.component is ComponentType.SWA:
            self.pools.swa.buffer[:, :, self._slots(ref.device_index)] = data[0]
        else:
            self.pools.mamba.conv[:, ref.device_index] = data[0]
            self.pools.mamba.ssm[:, ref.device_index] = data[1]

    # -- protocol ------------------------------------------------------------------------

    def lookup(self, page_hashes: Sequence[bytes], components, tenant=None) -> LookupResult:
        out = {}
        for c in components:
            p = np.zeros(len(page_hashes), dtype=np.uint8)
            for i, h in enumerate(page_hashes):
                key = PageKey(c, h)
                if key in self.pages:
                    p[i] = Presence.DISK if key in self.on_disk else Presence.HOST
            out[c] = p
        return LookupResult(out)

    def backup(
        self, refs: Sequence[PageRef], ready_event=None, tenant=None
    ) -> CompletedTransfer | LateTransfer:
        if self.fail_backups:
            return CompletedTransfer(False)
        self.backups += 1
        if self.late_backups:
            self.late_backups -= 1
            return self._late_backup(refs)
        self._copy_to_host(refs)
        return CompletedTransfer(True)

    def _copy_to_host(self, refs: Sequence[PageRef]) -> bool:
        for ref in refs:
            self.pages.setdefault(ref.key, self._read(ref))
        return True

    def _late_backup(self, refs: Sequence[PageRef]) -> LateTransfer:
        taken = [self._read(ref) for ref in refs]

        def copy() -> bool:
            for ref, then in zip(refs, taken):
                pool = self._pool(ref.component)
                assert pool.is_allocated(ref.device_index), (
                    f"{ref.component.name} page {ref.device_index} freed under a backup not done"
                )
                now = self._read(ref)
                assert all(torch.equal(a, b) for a, b in zip(now, then)), (
                    f"{ref.component.name} page {ref.device_index} changed under a backup not done"
                )
            return self._copy_to_host(refs)

        return self._late(copy)

    def _scribble(self, refs: Sequence[PageRef]) -> bool:
        for ref in refs:
            self._write(ref, tuple(torch.full_like(t, GARBAGE) for t in self._read(ref)))
        return False

    def _late(self, copy: Callable[[], bool]) -> LateTransfer:
        handle = LateTransfer(copy)
        self.unsettled.append(handle)
        return handle

    def settle(self, index: int | None = None, ok: bool = True, since: int = 0) -> int:
        """Run the unsettled transfer at ``index`` (modulo their number), or with None
        every one from the ``since``-th on, oldest first; returns how many settled."""
        if index is not None:
            if not self.unsettled:
                return 0
            self.unsettled.pop(index % len(self.unsettled)).settle(ok)
            return 1
        settled = 0
        while len(self.unsettled) > since:
            self.unsettled.pop(since).settle(ok)
            settled += 1
        return settled

    def pin(self, keys: Sequence[PageKey], ttl_s: float) -> PinReceipt | None:
        if self.fault == "pin_refused" or any(k not in self.pages for k in keys):
            return None
        receipt = PinReceipt(next(self._pin_ids), list(keys), time.monotonic() + ttl_s)
        self.pins[receipt.pin_id] = receipt
        return receipt

    def load(
        self, refs: Sequence[PageRef], pin: PinReceipt, timeout_s: float
    ) -> bool | LoadOutcome:
        self.loads += 1
        if self.fault == "return_false":
            return False
        if self.fault == "raise":
            raise ControllerError("injected copy error")
        if self.fault == "timeout":
            time.sleep(0.01)
            raise TimeoutError("injected timeout")
        if self.fault == "quota":
            raise LoadQuotaExceeded("injected quota")
        if self.fault == "evicted_meanwhile":
            self.pages.pop(refs[-1].key, None)
        if self.late_loads:
            self.late_loads -= 1
            return LoadOutcome(self._late(lambda: self._scribble(refs)))
        # Pages are written in order: a page missing near the end leaves the earlier
        # slots written, as a copy that fails half-way would.
        for ref in refs:
            if ref.key not in self.pages:
                return False
            self._write(ref, self.pages[ref.key])
        return True

    def unpin(self, pin: PinReceipt) -> None:
        self.pins.pop(pin.pin_id, None)

    def prefetch(self, keys: Sequence[PageKey]) -> CompletedTransfer:
        self.prefetched += list(keys)
        for k in keys:
            self.on_disk.discard(k)
        return CompletedTransfer(True)

    def stats(self) -> dict:
        return {"pages": len(self.pages)}

    def close(self) -> None:
        pass
