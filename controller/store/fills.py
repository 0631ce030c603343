"""Host pages being filled: device backups in flight, and waiting for fills of any kind.

A host page is *filling* while a copy into it runs: a backup from a device, or a disk
read. Each filling entry carries a future (``PageEntry.fill``) that resolves True when
the page is ready, False when the fill failed (and the page was given back).

Disk reads resolve their futures on the reader threads. Backups on CPU are published in
the caller's thread as soon as the copy returns; backups on CUDA are queued here with
the event recorded after their copy, and published (marked ready, queued to the disk
writer) by whichever caller next polls: any controller call, or a wait on a handle.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from typing import Any

from hicache.controller.store.page_index import HostState, PageEntry
from hicache.controller_api import PageRef

# A GPU copy's end is seen within _POLL_MAX_S: a 64 MiB copy takes about 1.2 ms over
# PCIe 5, and polls that grew to 1 ms could add most of one to it. A poll (a lock and an
# event query) costs a few µs, so a long copy spends a few percent of one core on them.
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 100e-6


class QueuedBackup:
    """One part of a backup: its page plan, the CUDA events after which its bytes are on
    host, and the one future its pages share as their ``fill``.

    ``source`` (the engine's buffers the copy reads) is held until the part is published:
    an engine that leaves while its copy runs must not take the memory away under it (its
    pools may be mapped from another process, and are let go when nothing holds them)."""

    def __init__(
        self,
        plan: list[tuple[PageEntry, PageRef]],
        events: list[Any],
        t0: float,
        fill: Future,
        source: Any = None,
    ):
        self.plan = plan
        self.events = events
        self.t0 = t0
        self.fill = fill
        self.source = source
        self.published = False


class FillTracker:
    """Queued CUDA backups of one page store, and waits on fills. The store owns it and
    hands it the store's lock, and how to publish a backup whose copies ended."""

    def __init__(
        self, lock: threading.RLock, publish_locked: Callable[[QueuedBackup], None]
    ) -> None:
        self._lock = lock
        self._publish_locked = publish_locked
        self._queued: list[QueuedBackup] = []

    def __len__(self) -> int:
        return len(self._queued)

    def queue_locked(self, backup: QueuedBackup) -> None:
        self._queued.append(backup)

    def reap(self, block: bool) -> None:
        """Publish queued backups whose copies finished (all of them when ``block``)."""
        if not self._queued:
            return
        with self._lock:
            queued = list(self._queued)
        for b in queued:
            if block:
                for ev in b.events:
                    ev.synchronize()
            elif not all(ev.query() for ev in b.events):
                continue
            with self._lock:
                if not b.published:
                    self._publish_locked(b)
                    self._queued.remove(b)

    def wait(self, fills: list[Future], deadline: float | None) -> bool | None:
        """Wait for fills: True all ready, False one failed, None at ``deadline``.

        Queued CUDA backups publish only when polled: the poll interval starts at
        ``_POLL_MIN_S`` and doubles up to ``_POLL_MAX_S``, so a copy that ends soon is
        seen soon and a long wait costs few wake-ups."""
        poll = _POLL_MIN_S
        while True:
            if self._queued:
                self.reap(block=False)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            step = remaining
            if self._queued:
                step = poll if remaining is None else min(remaining, poll)
                poll = min(2 * poll, _POLL_MAX_S)
            done, not_done = futures.wait(fills, timeout=step)
            if not not_done:
                return all(f.result() for f in done)
            if remaining is not None and remaining <= 0:
                return None

    def handle(self, fills: list[Future], ok: bool, default_timeout_s: float) -> FillHandle:
        return FillHandle(self, fills, ok, default_timeout_s)

    def check_invariants_locked(self) -> None:
        for b in self._queued:
            for e, _ in b.plan:
                assert e.host_state is HostState.FILLING, f"{e}: queued backup not filling"


class FillHandle:
    """A transfer handle over host fills; ``ok`` False when some page was never started.

    ``wait()`` without a timeout waits ``default_timeout_s`` (a stuck disk must not hang
    its caller).
    """

    def __init__(
        self, tracker: FillTracker, fills: list[Future], ok: bool, default_timeout_s: float
    ) -> None:
        self._tracker = tracker
        self._fills = fills
        self._ok = ok
        self._default_timeout_s = default_timeout_s

    def done(self) -> bool:
        self._tracker.reap(block=False)
        return all(f.done() for f in self._fills)

    def wait(self, timeout_s: float | None = None) -> bool:
        if timeout_s is None:
            timeout_s = self._default_timeout_s
        deadline = time.monotonic() + timeout_s
        return bool(self._tracker.wait(self._fills, deadline)) and self._ok
