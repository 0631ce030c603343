"""The remote tier: pages shared by every node's sidecar through a :class:`RemoteStore`.

A :class:`~hicache.controller.tiers.lower_tier.LowerTier` behind host and disk, never a
source of truth: the page index knows only the local tiers, and this tier reaches it only
through the page store's operations for tiers. What it adds:

* **Probes.** A lookup asks the store about the pages that the local tiers miss, in
  chain order, a chunk per round trip, and stops at the first FULL page that the store
  misses too (nothing after a hole is usable). The whole probe has one deadline
  (``remote_lookup_timeout_s``). A page found is reported as ``Presence.REMOTE`` and
  remembered in a bounded, expiring set of *hints*; a hint is believed only until a read
  verifies the value.
* **Fills.** A pin of a page the local tiers do not hold, but the hints do (the tier
  *offers* it), reserves a host page (filling, like a disk read) and reads the value on
  a worker thread. The value is checked by ``page_codec.verify_into``, exactly as LMDB
  values are; a page lands in the host tier (and is queued to disk when
  ``remote_fill_to_disk``) before any load can copy it. A corrupt, truncated or foreign
  value is never served: it is counted and deleted from the store.
* **Writes.** Pages reach the store from a bounded queue drained by one writer thread,
  in batches: the existence of each is checked first (another node may have written
  it), then the missing ones are written. A full queue drops the page and counts it; the
  host tier never waits for the remote tier (write-through pages are copied out of host
  only when sent, and only if still there).
* **Health.** A circuit breaker opens after ``remote_breaker_failures`` calls that
  failed on every key (the cluster is gone), and lets one trial call through every
  ``remote_breaker_cooldown_s``; a store that failed only some keys (one dead node) keeps
  it closed, and hints those keys' node failing instead (see remote_cluster.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from hicache.controller.config import RemoteWritePolicy
from hicache.controller.store.cost_rule import ReadCost
from hicache.controller.store.counters import Counters, component_label
from hicache.controller.store.page_codec import (
    HEADER_BYTES,
    ReadStatus,
    read_header,
    verify_into,
    write_header,
)
from hicache.controller.store.page_entry import HostState, PageEntry
from hicache.controller.tiers.lower_tier import FillResult, FillsHostOnly, FsckResult, TierHost
from hicache.controller.tiers.remote_health import BreakerState, CircuitBreaker, PresenceHints
from hicache.controller.tiers.remote_store import (
    Fetched,
    KeyStatus,
    RemoteStore,
    remote_key,
    split_value,
    value_parts,
)
from hicache.controller_api import P_ABSENT, P_REMOTE, PageKey
from hicache.types import ComponentType, Tier

if TYPE_CHECKING:
    import numpy as np

    from hicache.controller.config import ControllerConfig

log = logging.getLogger(__name__)

_INVALID = {ReadStatus.CORRUPT: "corrupt", ReadStatus.FOREIGN: "foreign"}


class RemoteTier(FillsHostOnly):
    """Probes, fills and writes of one controller's remote tier (see module docstring)."""

    tier = Tier.REMOTE

    def __init__(
        self,
        config: ControllerConfig,
        remote_store: RemoteStore,
        pages: TierHost,
        layout_digest: bytes,
        counters: Counters,
    ) -> None:
        self.config = config
        self.remote_store = remote_store
        self._pages = pages
        self._digest = layout_digest
        self.counters = counters
        self.hints = PresenceHints(config.remote_hint_entries, config.remote_hint_ttl_s)
        self.breaker = CircuitBreaker(
            config.remote_breaker_failures, config.remote_breaker_cooldown_s
        )
        self._fills = ThreadPoolExecutor(config.remote_io_threads, "hicache-remote-fill")
        self._read_cost = ReadCost(config.remote_io_threads, config.remote_read_batch_pages)
        self._queue: deque[tuple[PageEntry, Any]] = deque()
        self._queued: set[bytes] = set()
        self._cv = threading.Condition()
        self._sending = 0
        self._closing = False
        # Several writers: a batch is two round trips (the existence check, the writes),
        # and the next batch's pages are copied out while one is on the wire.
        self._writers = [
            threading.Thread(
                target=self._write_loop, name=f"hicache-remote-writer-{i}", daemon=True
            )
            for i in range(config.remote_writer_threads)
        ]
        for writer in self._writers:
            writer.start()

    def key(self, page_hash: bytes, component: ComponentType) -> bytes:
        return remote_key(self.config.remote_key_prefix, page_hash, component)

    # -- calls ---------------------------------------------------------------------------

    def _call(self, op: str, n: int, fn: Callable[[], list]) -> list | None:
        """Run one store call through the breaker and count its per-key results; None
        when the breaker refused it (nothing was asked)."""
        if not self.breaker.allow():
            self.counters.add(n, "remote", "ops", op, "breaker_open")
            return None
        t0 = time.perf_counter()
        results = fn()
        took = time.perf_counter() - t0
        self.counters.add(took, "remote", "seconds", op)
        if op == "exists" and KeyStatus.ERROR not in results:
            self._read_cost.observe_round_trip(took)  # no payload: the tier's latency
        statuses = [r.status if isinstance(r, Fetched) else r for r in results]
        for status in set(statuses):
            self.counters.add(statuses.count(status), "remote", "ops", op, status.value)
        answered = any(s is not KeyStatus.ERROR and s is not KeyStatus.SKIPPED for s in statuses)
        failed = KeyStatus.ERROR in statuses
        self.breaker.record(True if answered else (False if failed else None))
        return results

    # -- probes --------------------------------------------------------------------------

    def probe(self, page_hashes: Sequence[bytes], rows: dict[ComponentType, list[int]]) -> None:
        """Mark pages the local tiers miss and the store holds as ``P_REMOTE`` in
        ``rows`` (per component, one presence per page), up to the first FULL hole."""
        full = rows.get(ComponentType.FULL)
        if full is None or P_ABSENT not in full:
            return
        deadline = time.monotonic() + self.config.remote_lookup_timeout_s
        comps = list(rows)
        j = full.index(P_ABSENT)
        while j < len(page_hashes):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.counters.inc("remote", "probe_deadline")
                return
            end = min(len(page_hashes), j + self.config.remote_probe_chunk_pages)
            asked = [(i, c) for i in range(j, end) for c in comps if rows[c][i] == P_ABSENT]
            keys = [self.key(page_hashes[i], c) for i, c in asked]
            res = self._call(
                "exists", len(keys), lambda k=keys, t=remaining: self.remote_store.exists(k, t)
            )
            if res is None:
                return
            hole = end
            for (i, c), status in zip(asked, res, strict=True):
                if c is ComponentType.FULL and status is not KeyStatus.OK:
                    hole = min(hole, i)
            for n, ((i, c), status) in enumerate(zip(asked, res, strict=True)):
                if status is KeyStatus.OK and i < hole:
                    rows[c][i] = P_REMOTE
                    self.hints.add(keys[n], page_hashes[i - 1] if i else None)
                    self.counters.inc("lookup", "remote", component_label(c))
            if hole < end:
                return
            j = end

    # -- fills ---------------------------------------------------------------------------

    def offers(self, key: PageKey) -> bool:
        """Whether ``key`` was seen in the store lately (a pin may read it from there)."""
        return self.hints.get(self.key(key.page_hash, key.component))[0]

    def refusing(self) -> bool:
        """Whether the breaker is open: lookups do not ask the store."""
        return self.breaker.state is BreakerState.OPEN

    def holds_foreign(self, first_hash: Callable[[bytes], bytes]) -> bool:
        """Not known: values are checked only when read."""
        return False

    def fill_locked(
        self, keys: Sequence[PageKey], then: Callable[[list[PageEntry]], None] | None = None
    ) -> bool:
        """Start reading ``keys`` (held by no local tier) into host pages; False, with
        nothing started, when one is not hinted present or the breaker is open; False
        too when host pages ran out (those started complete). ``then`` is never called."""
        hinted = [self.hints.get(self.key(k.page_hash, k.component)) for k in keys]
        if not all(h for h, _ in hinted) or self.breaker.state is BreakerState.OPEN:
            return False
        started: list[tuple[PageEntry, bool]] = []
        ok = True
        for k, (_, parent) in zip(keys, hinted, strict=True):
            if self._pages.holds_locked(k):
                continue  # the same page twice in one pin
            e = self._pages.begin_fill_locked(k, parent)
            if e is None:
                ok = False
                break
            started.append((e, parent is None))
        step = self.config.remote_read_batch_pages
        for at in range(0, len(started), step):
            batch = started[at : at + step]
            fill: Future = Future()
            self._pages.fill_started_locked([e for e, _ in batch], fill)
            self._fills.submit(self._fill_job, batch, fill)
        self.counters.add(len(started), "remote", "fills_started")
        return ok

    def _fill_job(self, batch: list[tuple[PageEntry, bool]], fill: Future) -> None:
        """Read, verify and publish one batch of fills (a worker thread). A page filled
        with a provisional parent (``True`` beside it) takes its parent from the value."""
        t0 = time.perf_counter()
        keys = [self.key(e.page_hash, e.component) for e, _ in batch]
        statuses: list[ReadStatus] = [ReadStatus.ERROR] * len(batch)
        parents: list[bytes | None] = [None] * len(batch)
        try:
            timeout = self.config.remote_read_timeout_s
            fetched = self._call("get", len(keys), lambda: self.remote_store.get(keys, timeout))
            read = 0
            for n, ((e, _), got) in enumerate(zip(batch, fetched or (), strict=False)):
                if got.status is KeyStatus.MISSING:
                    statuses[n] = ReadStatus.MISSING
                elif got.status is KeyStatus.OK:
                    dst = self._pages.host_row(e)
                    head, parts = value_parts(got.head, got.body)
                    statuses[n] = verify_into(head, parts, int(e.component), self._digest, dst)
                    if statuses[n] is ReadStatus.OK:
                        parents[n] = read_header(head)[5]
                        read += len(got.head) + len(got.body)
            self._read_cost.observe(read, time.perf_counter() - t0)  # checks included
        except Exception:  # a bug must fail the fills, never leave them filling
            log.exception("remote fill of %d pages failed", len(batch))
        invalid = [keys[n] for n, s in enumerate(statuses) if s in _INVALID]
        results = [
            FillResult(e, statuses[n], parents[n] if provisional else None)
            for n, (e, provisional) in enumerate(batch)
        ]
        nbytes = self._pages.finish_fills(results, Tier.REMOTE)
        for n, s in enumerate(statuses):
            self.counters.inc("remote", "fills", s.value)
            if s is ReadStatus.OK:
                e = batch[n][0]
                self.hints.add(keys[n], e.parent_hash)
            elif s is ReadStatus.MISSING:
                self.hints.discard(keys[n])
            elif s in _INVALID:
                self.counters.inc("remote", "invalid", _INVALID[s])
                self.hints.discard(keys[n])
        self._announce([e for (e, _), s in zip(batch, statuses) if s in _INVALID], True)
        if invalid:  # never served, and never again to anyone: remove them
            log.warning("remote tier: %d invalid values removed", len(invalid))
            timeout = self.config.remote_write_timeout_s
            self._call("delete", len(invalid), lambda: self.remote_store.delete(invalid, timeout))
        done = sum(1 for s in statuses if s is ReadStatus.OK)
        self.counters.transfer("remote_to_host", done, nbytes, time.perf_counter() - t0)
        fill.set_result(done == len(batch))

    # -- writes --------------------------------------------------------------------------

    def read_cost(self) -> ReadCost:
        """Latency measured on existence checks, seconds per byte on every fill batch."""
        return self._read_cost

    def on_host_ready_locked(self, page: PageEntry, source: Tier) -> None:
        """A backup put ``page`` on host (write-through); a fill from below is not sent."""
        policy = self.config.remote_write_policy
        if source is Tier.DEVICE and policy is RemoteWritePolicy.WRITE_THROUGH:
            self._enqueue(page, None)

    def on_served_locked(self, pages: Sequence[PageEntry]) -> None:
        """``pages`` served a load-back (selective)."""
        if self.config.remote_write_policy is RemoteWritePolicy.SELECTIVE:
            for page in pages:
                self._enqueue(page, None)

    def on_host_evict_locked(self, page: PageEntry) -> None:
        """``page`` leaves the host tier (on host eviction): its bytes are copied now."""
        if self.config.remote_write_policy is RemoteWritePolicy.ON_HOST_EVICTION:
            # Checked before the copy: a full queue must cost the eviction nothing.
            if len(self._queue) >= self.config.remote_write_queue_pages:
                self.counters.inc("remote", "write_dropped", "queue_full")
            elif page.host_state is HostState.READY:
                self._enqueue(page, self._frame(self._pages.host_row(page)))

    def on_close_locked(self) -> None:
        """Nothing: :meth:`close` sends what is queued."""

    def delete_locked(self, skeys: Sequence[bytes]) -> None:
        """Nothing: the index never records this tier's pages (invalid values are deleted
        by the fill that finds them)."""

    def _enqueue(self, e: PageEntry, frame: memoryview | None) -> None:
        skey = e.skey
        with self._cv:
            if skey in self._queued or self.hints.get(self.key(e.page_hash, e.component))[0]:
                return
            if len(self._queue) >= self.config.remote_write_queue_pages or self._closing:
                self.counters.inc("remote", "write_dropped", "queue_full")
                return
            self._queue.append((e, frame))
            self._queued.add(skey)
            self._cv.notify()

    @staticmethod
    def _frame(row: np.ndarray, frames: list[bytearray] | None = None) -> memoryview:
        """A copy of a host page (``row``) with room for the header in front: in the next
        of a writer's reused ``frames``, or in a new buffer."""
        size = HEADER_BYTES + row.nbytes
        if frames is None:
            buffer = bytearray(size)
        else:
            buffer = frames.pop() if frames else bytearray(size)
            if len(buffer) < size:
                buffer = bytearray(size)
        frame = memoryview(buffer)[:size]
        frame[HEADER_BYTES:] = memoryview(row)
        return frame

    def _write_loop(self) -> None:
        # This writer's frames, one per page of a batch, reused batch after batch: a fresh
        # page-sized buffer per page costs its page faults, which the copy then pays
        # (about a third of the write path on a 2-core machine).
        frames: list[bytearray] = []
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return
                n = min(len(self._queue), self.config.remote_write_batch_pages)
                batch = [self._queue.popleft() for _ in range(n)]
                self._sending += 1
            try:
                frames = self._send(batch, frames)
            except Exception:
                log.exception("remote write of %d pages failed", len(batch))
                self.counters.add(len(batch), "remote", "write_dropped", "error")
            finally:
                with self._cv:
                    self._sending -= 1
                    for e, _ in batch:
                        self._queued.discard(e.skey)
                    self._cv.notify_all()

    def _send(self, batch: list[tuple[PageEntry, Any]], spare: list[bytearray]) -> list[bytearray]:
        """Write one batch; returns the frames to reuse for the next one."""
        t0 = time.perf_counter()
        copied = iter(
            self._pages.copy_host_pages(
                [e for e, frame in batch if frame is None],
                lambda e, row: self._frame(row, spare),
            )
        )
        frames = []
        for e, frame in batch:
            if frame is None:
                frame = next(copied)
                if frame is None:  # gone from host since it was queued
                    self.counters.inc("remote", "write_dropped", "evicted")
                    continue
            frames.append((e, frame))
        items = []
        for e, frame in frames:
            write_header(frame, e.component, self._digest, e.parent_hash)
            items.append((self.key(e.page_hash, e.component), *split_value(frame)))
        # After the call, these buffers hold nothing anyone needs: the next batch's.
        reuse = [frame.obj for _, frame in frames] + spare
        if not items:
            return reuse
        timeout = self.config.remote_write_timeout_s
        keys = [it[0] for it in items]
        entry_of = {it[0]: e for it, (e, _) in zip(items, frames, strict=True)}
        known = self._call(
            "exists", len(keys), lambda: self.remote_store.exists(keys, timeout, bulk=True)
        )
        if known is None:
            self.counters.add(len(items), "remote", "write_dropped", "breaker_open")
            return reuse
        todo = [it for it, s in zip(items, known, strict=True) if s is not KeyStatus.OK]
        self.counters.add(len(items) - len(todo), "remote", "write_skipped_present")
        present = []
        for it, s in zip(items, known, strict=True):
            if s is KeyStatus.OK:
                self.hints.add(it[0], None)
                present.append(entry_of[it[0]])
        if not todo:
            self._announce(present)
            return reuse
        res = self._call("put", len(todo), lambda: self.remote_store.put(todo, timeout))
        if res is None:
            self.counters.add(len(todo), "remote", "write_dropped", "breaker_open")
            return reuse
        if KeyStatus.ERROR in res:
            # A node that outlasted the deadline may still be sending from these frames:
            # they are left to it, and the next batch gets new ones.
            reuse = []
        nbytes = done = 0
        for (key, head, body), s in zip(todo, res, strict=True):
            if s is KeyStatus.OK:
                done += 1
                nbytes += len(head) + len(body)
                self.hints.add(key, None)
                present.append(entry_of[key])
            else:
                reason = "full" if s is KeyStatus.FULL else "error"
                self.counters.inc("remote", "write_dropped", reason)
        self.counters.transfer("host_to_remote", done, nbytes, time.perf_counter() - t0)
        self._announce(present)
        return reuse

    def _announce(self, entries: list[PageEntry], removed: bool = False) -> None:
        """Tell the store's listener (the KV event publisher) which pages this node found
        on or wrote to the remote tier, or removed from it."""
        self._pages.tier_changed(Tier.REMOTE, entries, removed)

    # -- state ---------------------------------------------------------------------------

    @property
    def queued_pages(self) -> int:
        return len(self._queue)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued page was sent (or dropped); True when it happened."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._sending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def stats(self) -> dict[str, Any]:
        """The tier's state (its counters are in the controller's, under ``remote``)."""
        return {
            "enabled": True,
            "breaker_state": self.breaker.state.name.lower(),
            "breaker_opened": self.breaker.opened,
            "write_queue_pages": len(self._queue),
            "write_queue_limit_pages": self.config.remote_write_queue_pages,
            "presence_hints": len(self.hints),
            "failure_hints": getattr(self.remote_store, "failure_hints", 0),
            **self._read_cost.stats(),
        }

    def health(self, timeout_s: float) -> dict[str, Any]:
        """The store's own view (nodes, memory, slots) plus :meth:`stats`."""
        return {**self.stats(), **self.remote_store.info(timeout_s)}

    def fsck(self, repair: bool, progress: Callable[[int, int], None] | None) -> FsckResult:
        """Nothing to check here: a value is verified whenever it is read, and an invalid
        one deleted then."""
        return FsckResult()

    def check_invariants(self, ready: set[bytes], queued: set[bytes]) -> None:
        """Nothing to compare: the index records none of this tier's pages."""

    def close(self, timeout_s: float) -> bool:
        """Send what is queued (within ``timeout_s``), stop the threads, close the store."""
        drained = self.flush(timeout_s)
        with self._cv:
            self._closing = True
            dropped = len(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        if dropped:
            self.counters.add(dropped, "remote", "write_dropped", "closing")
        for writer in self._writers:
            writer.join(timeout_s)
        self._fills.shutdown(wait=True)
        self.remote_store.close()
        return drained


def open_remote(
    config: ControllerConfig,
    pages: TierHost,
    layout_digest: bytes,
    counters: Counters,
    remote_store: RemoteStore | None = None,
) -> RemoteTier | None:
    """The remote tier of ``config`` (on ``remote_store`` when given, else on the cluster
    of ``remote_url``); None when neither is set. Never connects: a cluster that is
    absent now is a miss until it answers."""
    if remote_store is None:
        if config.remote_url is None:
            return None
        from hicache.controller.tiers.remote_cluster import ClusterSettings, ClusterStore

        remote_store = ClusterStore(ClusterSettings.from_config(config))
    return RemoteTier(config, remote_store, pages, layout_digest, counters)
