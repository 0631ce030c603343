"""The backend's page transfers through the sidecar, on either path.

* **Staging** (the copy path): ``store`` copies SGLang's flat data pages into the set half
  of the staging pages and backs those up; ``fetch`` loads into the get half and hands
  each page's bytes to the caller.
* **Direct** (the zero-copy path, KV only): the registered FULL buffer is SGLang's own
  host pool, so ``store_direct`` / ``fetch_direct`` name SGLang's host pages.

Every call is bounded by the client's timeouts; what the sidecar cannot do is a miss or a
failure, counted in ``counters``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hicache.controller.client.sidecar_client import SidecarController
from hicache.controller_api import PageKey, PageRef, Presence
from hicache.integrations.sglang_pages import PageHasher
from hicache.integrations.sglang_staging import Staging
from hicache.types import ComponentType

log = logging.getLogger("hicache.integrations.sglang")


class SidecarPages:
    """Stores and fetches SGLang pages through one sidecar session."""

    def __init__(
        self,
        controller: SidecarController,
        hasher: PageHasher,
        staging: Staging,
        page_size: int,
        options: dict[str, Any],
        counters: Counter[str],
    ) -> None:
        self.controller = controller
        self.hasher = hasher
        self.staging = staging
        self.page_size = page_size
        self.options = options
        self.counters = counters

    def present(self, keys: Sequence[str], components: Sequence[ComponentType]) -> dict:
        """Per component, a bool per key: held on host or disk (all False when unavailable)."""
        if not keys:
            return {c: [False] * len(keys) for c in components}
        hashes = [self.hasher.page_hash(k) for k in keys]
        res = self.controller.lookup(hashes, list(dict.fromkeys(components)))
        return {c: [int(p) != Presence.ABSENT for p in res.presence[c]] for c in components}

    def store(
        self,
        component: ComponentType,
        keys: list[str],
        pages: list[torch.Tensor],
        prefix: list[str] | None,
    ) -> list[bool]:
        """Back ``pages`` up under ``keys``: all True once the sidecar holds them."""
        half = self.staging.set_half
        hashes, parents = self.hasher.chain(keys, prefix)
        ok = [False] * len(keys)
        for start in range(0, len(keys), half.count):
            end = min(start + half.count, len(keys))
            with half.lock:
                if not half.usable() or not self.controller.available:
                    self.counters["set_unavailable"] += end - start
                    return ok
                refs = []
                for j, i in enumerate(range(start, end)):
                    self.staging.write(component, half.first + j, pages[i])
                    refs.append(PageRef(component, hashes[i], parents[i], half.first + j))
                handle = self.controller.backup(refs)
                done = handle.wait()
                if not handle.done():
                    half.unsettled.append(handle)
            if not done:
                self.counters["set_failed"] += end - start
                return ok
            ok[start:end] = [True] * (end - start)
            self.counters["set_pages"] += end - start
        return ok

    def fetch(
        self,
        component: ComponentType,
        keys: list[str],
        deliver: Callable[[int, torch.Tensor], None],
    ) -> list[bool]:
        """Load every held page of ``keys`` and hand it to ``deliver(i, bytes)``."""
        half = self.staging.get_half
        ok = [False] * len(keys)
        for start in range(0, len(keys), half.count):
            chunk = list(range(start, min(start + half.count, len(keys))))
            with half.lock:
                if not half.usable() or not self.controller.available:
                    self.counters["get_unavailable"] += len(chunk)
                    return ok
                loaded = self._load_chunk(
                    component, [keys[i] for i in chunk], lambda j: half.first + j,
                    half.unsettled.append,
                )
                for j in loaded:
                    deliver(chunk[j], self.staging.read(component, half.first + j))
                    ok[chunk[j]] = True
        self.counters["get_pages"] += sum(ok)
        self.counters["get_misses"] += len(keys) - sum(ok)
        return ok

    def _load_chunk(
        self,
        component: ComponentType,
        keys: list[str],
        device_index: Callable[[int], int],
        abandoned: Callable[[Any], None],
    ) -> list[int]:
        """Positions of ``keys`` loaded, the page of position j into registered page or
        slot ``device_index(j)``; a load given up on goes to ``abandoned``. A load that
        fails (a page found corrupt and dropped, one evicted meanwhile) is retried once
        with what the sidecar still holds, so one bad page costs only itself."""
        for attempt in range(2):
            present = self.present(keys, [component])[component]
            held = [j for j, p in enumerate(present) if p]
            if not held:
                return []
            page_keys = [PageKey(component, self.hasher.page_hash(keys[j])) for j in held]
            pin = self.controller.pin(page_keys, float(self.options["hicache_load_timeout_s"]) * 2)
            if pin is None:
                continue
            refs = [PageRef(component, k.page_hash, k.page_hash, device_index(j))
                    for k, j in zip(page_keys, held)]
            try:
                outcome = self.controller.load(
                    refs, pin, float(self.options["hicache_load_timeout_s"])
                )
            finally:
                self.controller.unpin(pin)
            pending = getattr(outcome, "pending", None)
            if pending is not None and not pending.done():
                abandoned(pending)
                return []
            if outcome:
                return held
            self.counters["load_failed"] += 1
            if attempt == 0:
                log.info("hicache: a load of %d pages failed; retrying what is held", len(held))
        return []

    def store_direct(
        self, keys: list[str], offsets: list[int], prefix: list[str] | None
    ) -> list[bool]:
        """Zero-copy backup: the sidecar reads SGLang's KV host pages itself."""
        if not self.controller.available:
            self.counters["set_unavailable"] += len(keys)
            return [False] * len(keys)
        hashes, parents = self.hasher.chain(keys, prefix)
        refs = [PageRef(ComponentType.FULL, h, p, o // self.page_size)
                for h, p, o in zip(hashes, parents, offsets)]
        handle = self.controller.backup(refs)
        done = handle.wait()
        if not handle.done():
            self._settle(handle)
        if not done:
            self.counters["set_failed"] += len(keys)
            return [False] * len(keys)
        self.counters["set_pages"] += len(keys)
        return [True] * len(keys)

    def fetch_direct(self, keys: list[str], offsets: list[int]) -> list[bool]:
        """Zero-copy load: the sidecar writes SGLang's KV host pages itself."""
        ok = [False] * len(keys)
        if not self.controller.available:
            self.counters["get_unavailable"] += len(keys)
            return ok
        for j in self._load_chunk(ComponentType.FULL, keys,
                                  lambda j: offsets[j] // self.page_size, self._settle):
            ok[j] = True
        self.counters["get_pages"] += sum(ok)
        self.counters["get_misses"] += len(keys) - sum(ok)
        return ok

    def _settle(self, transfer: Any) -> None:
        """Wait (up to ``hicache_settle_timeout_s``) for a transfer given up on to end: it
        names SGLang's own host pages, which SGLang reuses once this call returns. It ends
        once the client's reconnect is fenced (the sidecar answers a new registration only
        when the old session's requests are over)."""
        end = time.monotonic() + float(self.options["hicache_settle_timeout_s"])
        while not transfer.done():
            if time.monotonic() > end:
                self.counters["unsettled_transfers"] += 1
                log.error("hicache: a zero-copy transfer given up on has not ended after "
                          "%.1fs; its host pages may still be touched",
                          self.options["hicache_settle_timeout_s"])
                return
            time.sleep(0.01)
