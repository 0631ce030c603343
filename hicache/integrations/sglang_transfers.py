"""The backend's page transfers through the sidecar, on either path.

* **Staging** (the copy path): ``store`` copies SGLang's flat data pages into staging
  pages (a :class:`~hicache.controller.client.staging.StagingArea` shaped by the sidecar
  layout) and backs those up; ``fetch`` loads into staging pages and hands each page's
  bytes to the caller. Each call takes its pages, at most ``hicache_staging_pages`` at a
  time, under the area's lock and gives them back when its transfer is over: SGLang's
  prefetch and backup threads share the area (twice that many pages) without waiting on
  each other's transfers. Pages a transfer given up on may still touch stay in the area's
  quarantine until it ends, so a late copy never mixes with a newer call's pages.
* **Direct** (the zero-copy path, KV only): the registered FULL buffer is SGLang's own
  host pool, so ``store_direct`` / ``fetch_direct`` name SGLang's host pages.
* **Copied** (the engine copies, every pool whose pages are views of its memory:
  :mod:`hicache.integrations.sglang_segments`): with a local sidecar whose host pages are
  mapped here, ``store_copied`` copies SGLang's pages straight into the host pages the
  sidecar hands out and commits them, ``fetch_copied`` pins the pages and copies them
  straight into SGLang's pool (:class:`hicache.integrations.engine_blocks.EngineBlocks`):
  one copy per byte, by this process, with no staging page and no sidecar-side copy.

Every call is bounded by the client's timeouts; what the sidecar cannot do is a miss or a
failure, counted in ``counters``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from hicache import ComponentType, PageKey, PageRef, Presence, TransferHandle
from hicache.controller.client import SidecarController, StagingArea
from hicache.integrations.engine_blocks import EngineBlocks, HandedPages
from hicache.integrations.sglang_hit_pins import HitPins
from hicache.integrations.sglang_pages import UNIT_DTYPE, PageHasher

log = logging.getLogger("hicache.integrations.sglang")


def _kv_page(staging: StagingArea, component: ComponentType, page: int) -> torch.Tensor:
    pool = staging.pools.full if component is ComponentType.FULL else staging.pools.swa
    ps = staging.page_size
    return pool.buffer[:, :, page * ps : (page + 1) * ps]


def write_page(
    staging: StagingArea, component: ComponentType, page: int, data_page: torch.Tensor
) -> None:
    """Copy one SGLang flat data page into staging page (or Mamba slot) ``page``."""
    units = data_page.contiguous().view(torch.uint8).view(UNIT_DTYPE)
    if component is ComponentType.MAMBA:
        mamba = staging.pools.mamba
        conv, ssm = mamba.conv[:, page], mamba.ssm[:, page]
        n = conv.numel()
        conv.copy_(units[:n].view(conv.shape))
        ssm.copy_(units[n:].view(ssm.shape))
        return
    view = _kv_page(staging, component, page)
    view.copy_(units.view(view.shape))


def read_page(staging: StagingArea, component: ComponentType, page: int) -> torch.Tensor:
    """The bytes of staging page (or Mamba slot) ``page`` as a flat uint8 tensor."""
    if component is ComponentType.MAMBA:
        mamba = staging.pools.mamba
        units = torch.cat([mamba.conv[:, page].flatten(), mamba.ssm[:, page].flatten()])
    else:
        units = _kv_page(staging, component, page).flatten()
    return units.view(torch.uint8)


class SidecarPages:
    """Stores and fetches SGLang pages through one sidecar session."""

    def __init__(
        self,
        controller: SidecarController,
        hasher: PageHasher,
        staging: StagingArea,
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
        self.batch_pages = int(options["hicache_staging_pages"])  # staging pages per call
        # component -> (its pool's pages as engine blocks, the pool's tokens per page)
        self.copied: dict[ComponentType, tuple[EngineBlocks, int]] = {}
        self.hit_pins = HitPins(controller)  # a hit query's pin, for the get after it

    def copies(self, component: ComponentType) -> tuple[EngineBlocks, int] | None:
        """The engine-copied path of ``component``'s pool, when the sidecar's host pages
        are mapped here now (else the caller takes the direct or the staging path)."""
        entry = self.copied.get(component)
        if entry is None or not self.controller.available or not entry[0].available:
            return None
        return entry

    def store_copied(
        self, component: ComponentType, keys: list[str], offsets: list[int],
        prefix: list[str] | None,
    ) -> list[bool]:  # fmt: skip
        """One copy: SGLang's host pages straight into the sidecar's host pages. All True
        once every page is held (a page with no room makes the whole call report False:
        SGLang backs it up again later)."""
        blocks, ps = self.copied[component]
        hashes, parents = self.hasher.chain(keys, prefix)
        refs = [PageRef(component, h, p, 0) for h, p in zip(hashes, parents)]
        ttl = float(self.options["hicache_backup_timeout_s"])
        _, not_stored = blocks.store(refs, [0] * len(keys), [o // ps for o in offsets], ttl)
        if not_stored:
            self.counters["set_failed"] += len(keys)
            return [False] * len(keys)
        self.counters["set_pages"] += len(keys)
        return [True] * len(keys)

    def fetch_copied(
        self, component: ComponentType, keys: list[str], offsets: list[int]
    ) -> list[bool]:
        """One copy: the sidecar's host pages (read from disk first where they are only
        there) straight into SGLang's host pages. When not every page can be had, the ones
        still held are loaded (what a page not loaded holds afterwards is undefined, as
        SGLang expects of a page it is told missed)."""
        blocks, ps = self.copied[component]
        timeout = float(self.options["hicache_load_timeout_s"])
        targets = [o // ps for o in offsets]
        if component is ComponentType.FULL and self._load_under_hit_pin(keys, targets):
            self.counters["get_pages"] += len(keys)
            return [True] * len(keys)
        wanted = list(range(len(keys)))
        for attempt in range(2):
            if attempt:  # some page is gone: load the ones still held
                present = self.present(keys, [component])[component]
                wanted = [j for j, p in enumerate(present) if p]
                if not wanted:
                    break
            hashes = [self.hasher.page_hash(keys[j]) for j in wanted]
            if blocks.load(hashes, [0] * len(wanted), [targets[j] for j in wanted], 2 * timeout,
                           timeout):  # fmt: skip
                ok = [False] * len(keys)
                for j in wanted:
                    ok[j] = True
                self.counters["get_pages"] += len(wanted)
                self.counters["get_misses"] += len(keys) - len(wanted)
                return ok
            self.counters["load_failed"] += 1
        self.counters["get_misses"] += len(keys)
        return [False] * len(keys)

    def _load_under_hit_pin(self, keys: list[str], targets: list[int]) -> bool:
        """The KV pages ``keys`` copied into SGLang's pages ``targets`` at once, under the
        pin their hit query made (sglang_hit_pins.py); False when there is none usable (a
        page was not on host then): the caller loads them as usual."""
        hashes = [self.hasher.page_hash(k) for k in keys]
        receipt = self.hit_pins.take(hashes)
        if receipt is None:
            return False
        n = len(hashes)
        pages = receipt.host_pages
        instance = self.controller.sidecar_instance(receipt.generation)
        ok = False
        if instance is not None and pages is not None and len(pages) >= n and min(pages[:n]) >= 0:
            handed = HandedPages(receipt.pin_id, instance, receipt.deadline, tuple(pages[:n]))
            blocks, _ = self.copied[ComponentType.FULL]
            timeout = float(self.options["hicache_load_timeout_s"])
            ok = blocks.load_handed(hashes, [0] * n, targets, handed, 2 * timeout, timeout)
            self.counters["get_under_hit_pin" if ok else "load_failed"] += 1
        self.controller.unpin(receipt)
        return ok

    def present(
        self, keys: Sequence[str], components: Sequence[ComponentType], hit_query: bool = False
    ) -> dict:
        """Per component, a bool per key: held on host or disk (all False when unavailable).
        ``hit_query`` (SGLang's, which a get of these pages follows once its scheduler has
        planned the prefetch) with ``hicache_read_ahead``: the pages of the leading KV hit
        that are only on disk or the remote tier, of every component asked about, start
        coming to host now, not waited for, so that the get finds them there (counted in
        ``read_ahead_pages``); where this backend copies pages itself, the hit's KV pages
        are pinned too, for the get to copy at once (sglang_hit_pins.py)."""
        if not keys:
            return {c: [False] * len(keys) for c in components}
        hashes = [self.hasher.page_hash(k) for k in keys]
        comps = list(dict.fromkeys(components))
        res = self.controller.lookup(hashes, comps)
        if hit_query and self.options["hicache_read_ahead"] and ComponentType.FULL in comps:
            try:  # a hit stays a hit whatever becomes of its read-ahead
                lead = res.leading(ComponentType.FULL, Presence.REMOTE)  # the leading KV hit
                self._read_ahead(hashes, res.presence, comps, lead)
                if self.copies(ComponentType.FULL) is not None:
                    self.hit_pins.pin(hashes[:lead])
            except Exception as exc:
                self.counters["read_ahead_failed"] += 1
                log.warning("hicache: reading a hit ahead failed: %s", exc)
        return {c: [int(p) != Presence.ABSENT for p in res.presence[c]] for c in components}

    def _read_ahead(self, hashes: list[bytes], presence: dict, comps: list, lead: int) -> None:
        """Start reading the pages of the first ``lead`` that are only on disk or the
        remote tier to host, of every component in ``comps``."""
        keys = [
            PageKey(c, hashes[i])
            for c in comps
            for i in np.flatnonzero(np.asarray(presence[c][:lead]) >= int(Presence.DISK))
        ]
        if keys:  # the handle is dropped: the get waits for the pages, not this
            self.controller.prefetch(keys)
            self.counters["read_ahead_pages"] += len(keys)

    def store(
        self,
        component: ComponentType,
        keys: list[str],
        pages: list[torch.Tensor],
        prefix: list[str] | None,
    ) -> list[bool]:
        """Back ``pages`` up under ``keys``: all True once the sidecar holds them."""
        hashes, parents = self.hasher.chain(keys, prefix)
        ok = [False] * len(keys)
        for run, staged in self._staged_runs(component, len(keys), "set_unavailable"):
            handle: TransferHandle | None = None
            try:
                refs = []
                for i, page in zip(run, staged.tolist()):
                    write_page(self.staging, component, page, pages[i])
                    refs.append(PageRef(component, hashes[i], parents[i], page))
                handle = self.controller.backup(refs)
                done = handle.wait()
            finally:
                self.staging.free(component, staged, handle)
            if not done:
                self.counters["set_failed"] += len(run)
                return ok
            ok[run.start : run.stop] = [True] * len(run)
            self.counters["set_pages"] += len(run)
        return ok

    def fetch(
        self,
        component: ComponentType,
        keys: list[str],
        deliver: Callable[[int, torch.Tensor], None],
    ) -> list[bool]:
        """Load every held page of ``keys`` and hand it to ``deliver(i, bytes)``."""
        ok = [False] * len(keys)
        covered = 0
        for run, staged in self._staged_runs(component, len(keys), "get_unavailable"):
            abandoned: list[TransferHandle] = []
            try:
                loaded = self._load_chunk(
                    component, [keys[i] for i in run], staged.tolist(), abandoned.append
                )
                for j in loaded:
                    deliver(run[j], read_page(self.staging, component, int(staged[j])))
                    ok[run[j]] = True
            finally:
                self.staging.free(component, staged, abandoned[0] if abandoned else None)
            covered = run.stop
            if abandoned and covered < len(keys):  # the sidecar is late: the rest is a miss
                self.counters["get_unavailable"] += len(keys) - covered
                return ok
        if covered < len(keys):  # cut short, counted as unavailable
            return ok
        self.counters["get_pages"] += sum(ok)
        self.counters["get_misses"] += len(keys) - sum(ok)
        return ok

    def _staged_runs(
        self, component: ComponentType, count: int, unavailable: str
    ) -> Iterator[tuple[range, np.ndarray]]:
        """Positions ``0 .. count`` in runs of at most ``batch_pages``, each with as many
        staging pages of ``component`` (the caller frees them). Stops, the positions left
        counted under ``unavailable``, when the sidecar is unavailable or no page is free."""
        start = 0
        while start < count:
            staged = None
            if self.controller.available:
                staged = self.staging.alloc(component, min(count - start, self.batch_pages))
            if staged is None or staged.size == 0:
                self.counters[unavailable] += count - start
                return
            yield range(start, start + staged.size), staged
            start += staged.size

    def _load_chunk(
        self,
        component: ComponentType,
        keys: list[str],
        targets: Sequence[int],
        abandoned: Callable[[Any], None],
    ) -> list[int]:
        """Positions of ``keys`` loaded, the page of position j into registered page or
        slot ``targets[j]``; a load given up on goes to ``abandoned``. A load that
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
            refs = [
                PageRef(component, k.page_hash, k.page_hash, targets[j])
                for k, j in zip(page_keys, held)
            ]
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
        refs = [
            PageRef(ComponentType.FULL, h, p, o // self.page_size)
            for h, p, o in zip(hashes, parents, offsets)
        ]
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
        targets = [o // self.page_size for o in offsets]
        for j in self._load_chunk(ComponentType.FULL, keys, targets, self._settle):
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
                log.error(
                    "hicache: a zero-copy transfer given up on has not ended after "
                    "%.1fs; its host pages may still be touched",
                    self.options["hicache_settle_timeout_s"],
                )
                return
            time.sleep(0.01)
