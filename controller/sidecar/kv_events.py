"""KV events of the sidecar's tiers, published in vLLM's format for prefix-aware routers.

A page that becomes resident on host, disk or the remote tier is a ``BlockStored``; one
that leaves a tier is a ``BlockRemoved``; a ``hicachectl clear`` that empties every local
tier is an ``AllBlocksCleared``. The stream is byte-compatible with vLLM's
``vllm.distributed.kv_events`` (0.32): a ZeroMQ PUB socket sends three frames per batch —
the topic, the sequence number (8 bytes, big-endian) and a msgpack ``KVEventBatch`` — and
an optional ROUTER socket replays the buffered batches from a sequence number a late or
lossy subscriber asks for (8 bytes, big-endian), ended by a frame of sequence -1.

Payloads, as msgspec encodes vLLM's structs: a batch is the array ``[ts, events,
data_parallel_rank]``; an event is a map whose first key is ``type`` (the struct's tag),
then its fields in declaration order, leaving out the optional ones whose value is the
default. Written here with ``msgpack`` (hicache does not depend on vLLM or msgspec);
tests/engines/vllm/test_vllm_kv_events.py decodes a real sidecar's stream with vLLM's
own decoder.

What an event says (docs/protocol.md, "KV events"): ``medium`` ``CPU`` (host) or
``STORAGE`` (disk, remote), ``locality`` ``LOCAL`` or ``REMOTE`` (the remote tier),
``group_idx`` the component (0 FULL, 1 SWA, 2 MAMBA), ``kv_cache_spec_kind`` its kind
(``full_attention``, ``sliding_window``, ``mamba``), ``block_size`` the page size in
tokens, and block hashes the page hashes, each ``BlockStored`` one run of a chain
(``parent_block_hash`` the page before its first). A page stored with the engine's own
name for it (``PageRef.engine_key``, hicache/engine_keys.py: vLLM's block hash and KV
cache group) is named by that instead, as the engine's own events name it: its block
hash, ``group_idx``, ``kv_cache_spec_kind``, ``block_size`` and sliding window are the
engine's, and ``parent_block_hash`` is nil (the engine's name of the page before is not
kept), as in the events vLLM's offloading connector sends for keys it knows only by name.

The store calls the listener methods with its lock held: they only append a small tuple
to a bounded queue (``kv_events_queue_events``; past it an event is dropped and counted,
so a slow or absent subscriber never slows the sidecar). One thread drains the queue
every ``kv_events_batch_interval_s``, encodes a batch, sends it without blocking (a PUB
socket drops for a subscriber past its high-water mark) and serves replays.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgpack
import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hicache.controller.sidecar.config import SidecarConfig
from hicache.controller.store.page_entry import PageEntry
from hicache.engine_keys import EngineKey, unpack_engine_key
from hicache.types import ComponentType, Tier

__all__ = ["MEDIUM", "SPEC_KIND", "KvEventPublisher", "encode_batch"]

log = logging.getLogger(__name__)

#: ``medium`` and ``locality`` of each tier, in vLLM's words (vllm.v1.kv_offload.base).
MEDIUM = {
    Tier.HOST: ("CPU", "LOCAL"),
    Tier.DISK: ("STORAGE", "LOCAL"),
    Tier.REMOTE: ("STORAGE", "REMOTE"),
}
#: ``kv_cache_spec_kind`` of each component (vLLM's ``KVCacheSpecKind`` values).
SPEC_KIND = {
    ComponentType.FULL: "full_attention",
    ComponentType.SWA: "sliding_window",
    ComponentType.MAMBA: "mamba",
}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STORED, _REMOVED, _CLEARED = 0, 1, 2
_LOCAL_TIERS = frozenset({Tier.HOST, Tier.DISK})
_POLL_MS_MAX = 1000


def encode_batch(ts: float, events: list[dict[str, Any]]) -> bytes:
    """A ``KVEventBatch`` as vLLM's msgspec encoder writes it (``data_parallel_rank`` nil:
    a sidecar serves every rank of its node)."""
    return msgpack.packb([ts, events, None], use_bin_type=True)


def stored_event(
    hashes: list[bytes],
    parent: bytes | None,
    component: ComponentType,
    tier: Tier,
    block_size: int,
    sliding_window: int | None,
) -> dict[str, Any]:
    """A ``BlockStored`` map, fields in vLLM's order (defaults left out, as msgspec does)."""
    medium, locality = MEDIUM[tier]
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": [],  # the sidecar never sees tokens
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": int(component),
        "kv_cache_spec_kind": SPEC_KIND[component],
    }
    if component is ComponentType.SWA and sliding_window is not None:
        ev["kv_cache_spec_sliding_window"] = sliding_window
    ev["locality"] = locality
    return ev


def removed_event(hashes: list[bytes], component: ComponentType, tier: Tier) -> dict[str, Any]:
    medium, locality = MEDIUM[tier]
    return {
        "type": "BlockRemoved",
        "block_hashes": hashes,
        "medium": medium,
        "group_idx": int(component),
        "locality": locality,
    }


def engine_stored_event(hashes: list[bytes | int], key: EngineKey, tier: Tier) -> dict[str, Any]:
    """A ``BlockStored`` of pages an engine named (``key``: the first one's name; the run
    shares its group, kind, block size and window)."""
    medium, locality = MEDIUM[tier]
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": key.block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": key.group_idx,
        "kv_cache_spec_kind": key.kind,
    }
    if key.sliding_window is not None:
        ev["kv_cache_spec_sliding_window"] = key.sliding_window
    ev["locality"] = locality
    return ev


def engine_removed_event(hashes: list[bytes | int], key: EngineKey, tier: Tier) -> dict[str, Any]:
    medium, locality = MEDIUM[tier]
    return {
        "type": "BlockRemoved",
        "block_hashes": hashes,
        "medium": medium,
        "group_idx": key.group_idx,
        "locality": locality,
    }


class KvEventPublisher:
    """The store's :class:`~hicache.controller.store.tier_events.TierEvents` listener and
    the PUB/ROUTER sockets that publish what it hears (see the module docstring)."""

    def __init__(self, config: SidecarConfig, page_size: Callable[[], int]) -> None:
        """Bind the sockets now (a bad endpoint fails the start) and start the thread.
        ``page_size``: the served page size in tokens (0 until a layout is fixed)."""
        assert config.kv_events_endpoint, "KV events are off"
        self.config = config
        self._page_size = page_size
        self._queue: collections.deque[tuple] = collections.deque()
        self._limit = config.kv_events_queue_events
        self._replay_buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.kv_events_buffer_batches
        )
        self._topic = config.kv_events_topic.encode()
        self._seq = 0  # the next batch's sequence number
        self.published = 0
        self.dropped = 0
        self.replayed = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, config.kv_events_hwm)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(config.kv_events_endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if config.kv_events_replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.kv_events_replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hicache-kv-events", daemon=True)
        self._thread.start()

    # -- the listener (store lock held: append and return) --------------------------------

    def _put(self, item: tuple) -> None:
        if len(self._queue) >= self._limit:
            self.dropped += 1
            return
        self._queue.append(item)

    def stored(self, tier: Tier, entries: Sequence[PageEntry]) -> None:
        for e in entries:
            self._put((_STORED, tier, e.component, e.page_hash, e.parent_hash, e.engine_key))

    def removed(self, tier: Tier, entries: Sequence[PageEntry]) -> None:
        for e in entries:
            self._put((_REMOVED, tier, e.component, e.page_hash, None, e.engine_key))

    def cleared(self, tiers: frozenset[Tier]) -> None:
        if tiers >= _LOCAL_TIERS:
            self._put((_CLEARED, None, None, None, None, None))

    # -- the publishing thread ------------------------------------------------------------

    def _run(self) -> None:
        interval_ms = max(1, int(self.config.kv_events_batch_interval_s * 1000))
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        next_flush = time.monotonic()
        while not self._stop.is_set():
            wait_ms = max(0, min(_POLL_MS_MAX, int((next_flush - time.monotonic()) * 1000)))
            if self._replay is not None:
                if poller.poll(wait_ms):
                    self._serve_replays()
            else:
                self._stop.wait(wait_ms / 1000)
            if time.monotonic() >= next_flush:
                self._flush()
                next_flush = time.monotonic() + interval_ms / 1000
        self._flush()

    def _flush(self) -> None:
        max_events = self.config.kv_events_batch_max_events
        while self._queue:
            items = [self._queue.popleft() for _ in range(min(len(self._queue), max_events))]
            events = list(self._group(items))
            payload = encode_batch(time.time(), events)
            seq = self._seq
            self._seq += 1
            try:
                self._pub.send_multipart(
                    (self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                )
            except zmq.Again:  # PUB drops rather than blocks; kept for any other socket
                self.dropped += len(items)
            else:
                self.published += len(items)
            self._replay_buffer.append((seq, payload))

    def _group(self, items: list[tuple]) -> Iterator[dict[str, Any]]:
        """Events from queued items, in order: consecutive stores of one tier and component
        (and engine group) that extend a chain make one ``BlockStored``, consecutive
        removals one ``BlockRemoved``."""
        block_size = self._page_size()
        window = self.config.kv_events_sliding_window
        run: list[bytes] = []  # the page hashes of the run (its chain)
        names: list[bytes | int] = []  # what the event calls them
        head: tuple | None = None
        head_key: EngineKey | None = None
        for item in items:
            kind, tier, comp, page_hash, parent, engine_key = item
            key = _engine_key(engine_key)
            if (
                head is not None
                and kind == head[0]
                and tier is head[1]
                and comp is head[2]
                and _same_group(key, head_key)
                and (kind == _REMOVED or parent == run[-1])
            ):
                run.append(page_hash)
                names.append(page_hash if key is None else key.block_hash)
                continue
            if head is not None:
                yield self._event(head, head_key, names, block_size, window)
            head, head_key, run = item, key, [page_hash]
            names = [page_hash if key is None else key.block_hash]
        if head is not None:
            yield self._event(head, head_key, names, block_size, window)

    @staticmethod
    def _event(
        head: tuple,
        key: EngineKey | None,
        names: list[Any],
        block_size: int,
        window: int | None,
    ) -> dict[str, Any]:
        kind, tier, comp, _, parent, _ = head
        if kind == _STORED:
            if key is not None:
                return engine_stored_event(names, key, tier)
            return stored_event(names, parent, comp, tier, block_size, window)
        if kind == _REMOVED:
            if key is not None:
                return engine_removed_event(names, key, tier)
            return removed_event(names, comp, tier)
        return {"type": "AllBlocksCleared"}

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: a replay request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            try:
                for seq, payload in list(self._replay_buffer):
                    if seq >= first:
                        self._replay.send_multipart(
                            (client, b"", self._topic, seq.to_bytes(8, "big"), payload),
                            flags=zmq.NOBLOCK,
                        )
                        self.replayed += 1
                self._replay.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.Again:  # that subscriber stopped reading: it asks again
                continue

    # -- state ----------------------------------------------------------------------------

    @property
    def batches(self) -> int:
        """Batches published so far (the next batch's sequence number)."""
        return self._seq

    @property
    def queued(self) -> int:
        return len(self._queue)

    def collector(self) -> Collector:
        """The publisher's metric families, for the sidecar's registry."""
        return _Collector(self)

    def close(self, timeout_s: float = 5.0) -> None:
        """Publish what is queued, then close the sockets."""
        self._stop.set()
        self._thread.join(timeout_s)
        self._ctx.destroy(linger=0)


def _engine_key(data: bytes | None) -> EngineKey | None:
    """The engine's name of a page (checked when its store was decoded), or None."""
    return None if data is None else unpack_engine_key(data)


def _same_group(a: EngineKey | None, b: EngineKey | None) -> bool:
    """Whether two pages' events can share one event: both named by hash, or both by the
    engine in the same group, kind, block size and window."""
    if a is None or b is None:
        return a is b
    return (a.group_idx, a.kind, a.block_size, a.sliding_window) == (
        b.group_idx,
        b.kind,
        b.block_size,
        b.sliding_window,
    )


class _Collector(Collector):
    def __init__(self, publisher: KvEventPublisher) -> None:
        self._p = publisher

    def collect(self) -> Iterator[Any]:
        p = self._p
        events = CounterMetricFamily(
            "hicache_kv_events",
            "KV events, by result: published (sent in a batch) or dropped (the queue was "
            "full: a subscriber's view is stale).",
            labels=["result"],
        )
        events.add_metric(["published"], p.published)
        events.add_metric(["dropped"], p.dropped)
        yield events
        yield CounterMetricFamily(
            "hicache_kv_event_batches",
            "KV event batches sent (the next sequence number).",
            value=p.batches,
        )
        yield CounterMetricFamily(
            "hicache_kv_event_batches_replayed",
            "Batches sent again to late subscribers.",
            value=p.replayed,
        )
        yield GaugeMetricFamily(
            "hicache_kv_events_queued", "KV events waiting to be published.", value=p.queued
        )
