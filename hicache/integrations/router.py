"""A prefix-aware router's view of hicache: which node resumes the longest prefix of a prompt.

Each node's sidecar publishes KV events in vLLM's format (docs/protocol.md, "KV events").
:class:`PrefixRouter` subscribes to several of them, keeps per node where each page of
each component is (host, disk; the remote tier is shared by every node), and scores a
prompt's page hashes per node with the same rule as the sidecar's ``score`` verb
(:mod:`hicache.resume`): a KV hit without the Mamba state at its end, or without the
sliding window before it, is not a hit. A router calls :meth:`PrefixRouter.poll` from its
loop (or a thread of its own) and :meth:`PrefixRouter.best` per request::

    router = PrefixRouter(
        {"node-a": NodeEndpoints("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"), ...},
        components=layout.components, page_size=16, sliding_window=4096,
    )
    router.poll(timeout_ms=0)
    node, pages = router.best(page_hashes(prompt_tokens, fingerprint, 16, tenant))

Gaps in a node's sequence numbers are filled from its replay endpoint; a node that
restarts (its sequence starts again at 0) is rebuilt from what it announces at start.
Only pyzmq and msgpack are needed: no vLLM, no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from hicache import ComponentType, Tier, resumable_pages, window_pages

__all__ = ["NodeEndpoints", "NodeScore", "PrefixRouter"]

log = logging.getLogger(__name__)

# A page's tiers as bits of one int, so that a tier set is "held up to" a tier by a mask.
_BIT = {Tier.HOST: 1, Tier.DISK: 2, Tier.REMOTE: 4}
_TIER_OF = {("CPU", "LOCAL"): Tier.HOST, ("STORAGE", "LOCAL"): Tier.DISK}
_UP_TO = {Tier.HOST: 1, Tier.DISK: 3, Tier.REMOTE: 7}
_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_REPLAY_TIMEOUT_MS = 2000


@dataclass(frozen=True)
class NodeEndpoints:
    """A sidecar's ``kv_events_endpoint`` and (optional) ``kv_events_replay_endpoint``."""

    events: str
    replay: str | None = None


@dataclass
class NodeScore:
    """What one node can resume of a prompt, in pages, per tier (faster tiers counted)."""

    resumable: dict[str, int]
    kv_pages: dict[str, int]


@dataclass
class _Node:
    endpoints: NodeEndpoints
    sub: Any
    pages: dict[int, dict[bytes, int]] = field(default_factory=dict)  # group → hash → bits
    next_seq: int = 0


class PrefixRouter:
    """Per-node page residency from KV events, and prompts scored against it."""

    def __init__(
        self,
        nodes: Mapping[str, NodeEndpoints],
        components: Sequence[ComponentType],
        page_size: int,
        sliding_window: int | None = None,
        topic: str = "",
    ) -> None:
        """``components``, ``page_size`` and ``sliding_window``: the model's (the events
        carry the kind of each group, but a node that has published nothing for a
        component must still be held to its rule)."""
        if ComponentType.SWA in components and sliding_window is None:
            raise ValueError("a model with SWA layers needs its sliding_window to be scored")
        self.components = tuple(components)
        self.page_size = page_size
        self.swa_window_pages = window_pages(sliding_window, page_size)
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._nodes: dict[str, _Node] = {}
        self._by_socket: dict[Any, str] = {}
        self._remote: dict[int, set[bytes]] = {}  # shared by every node
        for name, ep in nodes.items():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sub.connect(ep.events)
            self._poller.register(sub, zmq.POLLIN)
            self._nodes[name] = _Node(ep, sub)
            self._by_socket[sub] = name

    # -- events ---------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply every batch that has arrived (waiting up to ``timeout_ms`` for the first);
        returns how many were applied."""
        applied = 0
        ready = dict(self._poller.poll(timeout_ms))
        while ready:
            for sock in ready:
                name = self._by_socket[sock]
                while True:
                    try:
                        _, seq, payload = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    applied += self._receive(name, int.from_bytes(seq, "big"), payload)
            ready = dict(self._poller.poll(0))
        return applied

    def _receive(self, name: str, seq: int, payload: bytes) -> int:
        node = self._nodes[name]
        if seq < node.next_seq and seq == 0:  # the sidecar restarted: it announces again
            node.pages.clear()
            node.next_seq = 0
        if seq < node.next_seq:
            return 0  # already applied (a replay overlapping the live stream)
        applied = 0
        if seq > node.next_seq and node.endpoints.replay:
            applied += self._replay(name, node.next_seq, seq)
        self.apply(name, payload)
        node.next_seq = seq + 1
        return applied + 1

    def _replay(self, name: str, first: int, upto: int) -> int:
        """Fetch batches ``first .. upto-1`` of ``name`` from its replay endpoint."""
        node = self._nodes[name]
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        applied = 0
        try:
            dealer.connect(node.endpoints.replay)
            dealer.send_multipart([b"", first.to_bytes(8, "big")])
            while dealer.poll(_REPLAY_TIMEOUT_MS):
                _, _, seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == _END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if node.next_seq <= seq < upto:
                    self.apply(name, payload)
                    node.next_seq = seq + 1
                    applied += 1
        finally:
            dealer.close()
        if node.next_seq < upto:
            log.warning("%s: batches %d..%d lost (not in its replay buffer)", name, first, upto)
        return applied

    def apply(self, name: str, payload: bytes) -> None:
        """Apply one ``KVEventBatch`` payload of node ``name``."""
        _, events, _ = msgpack.unpackb(payload)
        node = self._nodes[name]
        for ev in events:
            kind = ev["type"]
            if kind == "AllBlocksCleared":
                node.pages.clear()
                continue
            group = ev.get("group_idx") or 0
            remote = ev.get("locality") == "REMOTE"
            if remote:
                pages = self._remote.setdefault(group, set())
                if kind == "BlockStored":
                    pages.update(ev["block_hashes"])
                else:
                    pages.difference_update(ev["block_hashes"])
                continue
            bit = _BIT[_TIER_OF[(ev["medium"], ev.get("locality") or "LOCAL")]]
            pages = node.pages.setdefault(group, {})
            if kind == "BlockStored":
                for h in ev["block_hashes"]:
                    pages[h] = pages.get(h, 0) | bit
            else:
                for h in ev["block_hashes"]:
                    left = pages.get(h, 0) & ~bit
                    if left:
                        pages[h] = left
                    else:
                        pages.pop(h, None)

    # -- scoring --------------------------------------------------------------------------

    def score(self, page_hashes: Sequence[bytes]) -> dict[str, NodeScore]:
        """Per node, what it resumes of the prompt whose page hashes are ``page_hashes``."""
        out = {}
        for name, node in self._nodes.items():
            rows = {}
            for c in self.components:
                local = node.pages.get(int(c), {})
                remote = self._remote.get(int(c), ())
                rows[c] = [
                    local.get(h, 0) | (_BIT[Tier.REMOTE] if h in remote else 0) for h in page_hashes
                ]
            resumable, kv = {}, {}
            for tier, mask in _UP_TO.items():

                def held(bits: int, mask: int = mask) -> bool:
                    return bool(bits & mask)

                key = tier.name.lower()
                resumable[key] = resumable_pages(rows, held, self.swa_window_pages)
                kv[key] = resumable_pages({ComponentType.FULL: rows[ComponentType.FULL]}, held)
            out[name] = NodeScore(resumable, kv)
        return out

    def best(self, page_hashes: Sequence[bytes], tier: Tier = Tier.DISK) -> tuple[str, int]:
        """The node that resumes the most of the prompt from tiers up to ``tier``, and how
        many pages (ties go to the node named first)."""
        key = tier.name.lower()
        scores = self.score(page_hashes)
        name = max(scores, key=lambda n: scores[n].resumable[key])
        return name, scores[name].resumable[key]

    def close(self) -> None:
        self._ctx.destroy(linger=0)
