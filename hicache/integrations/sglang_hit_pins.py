"""Pins that SGLang's hit query makes for the get that follows it (``hicache_read_ahead``).

SGLang asks whether pages are held (``batch_exists``, its prefetch thread) and, once its
scheduler has planned the prefetch, gets them (``batch_get_v1``, another thread). Where
the backend copies pages itself from the sidecar's host pages, the hit query also sends a
pin of its leading hit's KV pages, not waited for: the pin holds them on host meanwhile,
and its answer names their host pages, so the get copies at once
(:meth:`~hicache.integrations.engine_blocks.EngineBlocks.load_handed`, which pins again
under this pin while it copies: a pin that lapsed in between voids the copy, which is then
made as any load is) instead of waiting for a pin's round trip first.

A pin no get takes (SGLang revoked the prefetch, or fetched other pages) is let go after
half of :data:`HIT_PIN_TTL_S`, or when more than :data:`MAX_HIT_PINS` are held; the
sidecar lets it lapse at its deadline in any case.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from hicache import ComponentType, PageKey, PinReceipt
from hicache.controller.client import PendingPin, SidecarController

HIT_PIN_TTL_S = 10.0  # how long a hit query's pin holds its pages for the get
MAX_HIT_PINS = 64  # hit queries whose pins wait for their get at once


# A hit query's pin: the hashes it pinned, the pin request, when it was sent.
_Entry = tuple[tuple[bytes, ...], PendingPin, float]


class HitPins:
    """The pins of recent hit queries, by their first page's hash (thread-safe)."""

    def __init__(self, controller: SidecarController) -> None:
        self.controller = controller
        self._pins: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def pin(self, hashes: Sequence[bytes]) -> None:
        """Send a pin of the KV pages ``hashes`` (a hit query's leading hit), not waiting
        for its answer; it replaces one made for the same first page."""
        if not hashes:
            return
        keys = [PageKey(ComponentType.FULL, h) for h in hashes]
        asked = self.controller.send_pin(keys, HIT_PIN_TTL_S, host_pages=True)
        if asked is None:  # pins are made at load time, or too many keys: no pin
            return
        now = time.monotonic()
        dropped = []
        with self._lock:
            old = self._pins.pop(hashes[0], None)
            if old is not None:
                dropped.append(old[1])
            self._pins[hashes[0]] = (tuple(hashes), asked, now)
            while self._pins and (
                len(self._pins) > MAX_HIT_PINS
                or next(iter(self._pins.values()))[2] < now - HIT_PIN_TTL_S / 2
            ):
                dropped.append(self._pins.popitem(last=False)[1][1])
        for pending in dropped:
            self._release(pending)

    def take(self, hashes: Sequence[bytes]) -> PinReceipt | None:
        """The receipt of the pin a hit query made for ``hashes`` (its leading pages, in
        this order), taken out; None when there is none, it failed, or it is older than
        half its time to live (then let go). The caller unpins the receipt."""
        with self._lock:
            entry = self._pins.pop(hashes[0], None) if hashes else None
        if entry is None:
            return None
        pinned, pending, sent = entry
        receipt = self.controller.receive_pin(pending)
        if receipt is None:
            return None
        fresh = time.monotonic() - sent < HIT_PIN_TTL_S / 2
        if not fresh or pinned[: len(hashes)] != tuple(hashes):
            self.controller.unpin(receipt)
            return None
        return receipt

    def release_all(self) -> None:
        """Let every pin go (before this backend's pages are cleared: a pin keeps them)."""
        with self._lock:
            pending = [entry[1] for entry in self._pins.values()]
            self._pins.clear()
        for p in pending:
            self._release(p)

    def _release(self, pending: PendingPin) -> None:
        receipt = self.controller.receive_pin(pending)
        if receipt is not None:
            self.controller.unpin(receipt)
