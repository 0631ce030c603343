"""An in-memory CacheController for tree tests: it really copies bytes, and can fail on
demand in every way a real controller can (False, an exception, a timeout, a quota, a
page gone between pin and load)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import numpy as np
import torch

from hicache.controller_api import (
    CompletedTransfer,
    ControllerError,
    LoadQuotaExceeded,
    LookupResult,
    PageKey,
    PageRef,
    PinReceipt,
    Presence,
)
from hicache.types import ComponentType

FAULTS = ("return_false", "raise", "timeout", "quota", "pin_refused", "evicted_meanwhile")


class FakeController:
    """Host "tier" = a dict of page copies; ``on_disk`` keys report as DISK."""

    def __init__(self) -> None:
        self.pages: dict[PageKey, tuple[torch.Tensor, ...]] = {}
        self.on_disk: set[PageKey] = set()
        self.pins: dict[int, PinReceipt] = {}
        self.fault: str | None = None
        self.fail_backups = False
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

    def _write(self, ref: PageRef, data: tuple[torch.Tensor, ...]) -> None:
        if ref.component is ComponentType.FULL:
            self.pools.full.buffer[:, :, self._slots(ref.device_index)] = data[0]
        elif ref.component is ComponentType.SWA:
            self.pools.swa.buffer[:, :, self._slots(ref.device_index)] = data[0]
        else:
            self.pools.mamba.conv[:, ref.device_index] = data[0]
            self.pools.mamba.ssm[:, ref.device_index] = data[1]

    # -- protocol ------------------------------------------------------------------------

    def lookup(self, page_hashes: Sequence[bytes], components) -> LookupResult:
        out = {}
        for c in components:
            p = np.zeros(len(page_hashes), dtype=np.uint8)
            for i, h in enumerate(page_hashes):
                key = PageKey(c, h)
                if key in self.pages:
                    p[i] = Presence.DISK if key in self.on_disk else Presence.HOST
            out[c] = p
        return LookupResult(out)

    def backup(self, refs: Sequence[PageRef], ready_event=None) -> CompletedTransfer:
        if self.fail_backups:
            return CompletedTransfer(False)
        self.backups += 1
        for ref in refs:
            self.pages.setdefault(ref.key, self._read(ref))
        return CompletedTransfer(True)

    def pin(self, keys: Sequence[PageKey], ttl_s: float) -> PinReceipt | None:
        if self.fault == "pin_refused" or any(k not in self.pages for k in keys):
            return None
        receipt = PinReceipt(next(self._pin_ids), list(keys), time.monotonic() + ttl_s)
        self.pins[receipt.pin_id] = receipt
        return receipt

    def load(self, refs: Sequence[PageRef], pin: PinReceipt, timeout_s: float) -> bool:
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
