"""Replay of Mooncake FAST'25 traces through the real cache (and controller), without a model.

A trace is JSONL, one request a line: ``timestamp`` (ms since the first request),
``input_length``, ``output_length`` and ``hash_ids``, the ids of the request's input
blocks of ``block_tokens`` (512) tokens; equal ids are equal content, and an id is always
preceded by the same ids (the ids form prefix chains).

Each block id maps to a fixed run of ``block_tokens`` token ids (``id * block_tokens +
0..block_tokens-1``), so a request's input is the concatenation of its blocks, every block
whole (the last block of a request counts as a whole block, as its id stands for one).
Every request runs the engine's path through :class:`~hicache.cache.UnifiedRadixCache`:
``match_prefix`` → ``load_back`` of host hits → ``alloc_tokens`` for the rest →
``cache_finished_req``. No K/V is written: only which slots hold which prefix matters here.

Output tokens (``OutputTokens``): by default they are dropped: a trace names only input
blocks, and the next turn of a conversation reaches the previous answer through new block
ids, so cached output tokens could never be hit by a later request of the trace and would
only take room. ``INSERT`` allocates and caches them as unique blocks, to measure that cost.

Time: requests are admitted in timestamp order. With ``decode_ms_per_token`` = 0 (the
default) each request finishes before the next one starts, which is the model the offline
bounds (:mod:`hicache.apps.replay_bounds`) assume. Otherwise a request stays in flight, holding
its prefix and slots, until ``timestamp / time_scale + output_length ×
decode_ms_per_token``; a request that finds the device full of held slots waits for the
earliest one in flight to finish.
"""

from __future__ import annotations

import enum
import heapq
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hicache.cache import UnifiedRadixCache
from hicache.config import CacheConfig, EvictionPolicyKind, WritePolicy
from hicache.eviction import LeafEvictionPolicy
from hicache.layout import ModelLayout
from hicache.leaf_policies import make_leaf_policy
from hicache.pools import DevicePools
from hicache.records import Request
from hicache.types import ComponentType, ConfigError, PoolExhaustedError


class OutputTokens(enum.Enum):
    """What the replay does with a request's ``output_length`` tokens."""

    DROP = "drop"  # neither allocated nor cached
    INSERT = "insert"  # allocated, and cached (whole pages) as blocks no request asks for


class TraceError(ValueError):
    """A trace file is unreadable or a line is not a Mooncake trace record."""


@dataclass(frozen=True)
class TraceRequest:
    """One line of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _trace_record(obj: object, where: str) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [
        k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj
    ]
    if missing:
        raise TraceError(
            f"{where}: missing field(s) {missing}; a Mooncake trace line has "
            "timestamp, input_length, output_length and hash_ids"
        )
    ts, n_in, n_out, ids = (
        obj[k] for k in ("timestamp", "input_length", "output_length", "hash_ids")
    )
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a number of ms >= 0, got {ts!r}")
    for name, v in (("input_length", n_in), ("output_length", n_out)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise TraceError(f"{where}: {name} must be an integer >= 0, got {v!r}")
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
    return TraceRequest(float(ts), n_in, n_out, tuple(ids))


def _check_chain(ids: tuple[int, ...], parent_of: dict[int, int], where: str) -> None:
    """The format's block ids are prefix hashes: an id stands for its whole prefix, so it
    always follows the same id (or always starts a request) and never repeats within a
    request. The replay and its bounds key a block by its id alone; a trace breaking this
    would be replayed as another trace, and its optimum could fall below LRU."""
    prev = -1
    for h in ids:
        seen = parent_of.setdefault(h, prev)
        if seen != prev:

            def name(p: int) -> str:
                return "the start of a request" if p < 0 else f"block {p}"

            raise TraceError(
                f"{where}: block {h} follows {name(prev)} here but {name(seen)} earlier; "
                "hash_ids must be prefix hashes (one id per prefix)"
            )
        prev = h


def load_trace(
    path: str | Path,
    window_s: tuple[float, float] | None = None,
    max_requests: int | None = None,
) -> list[TraceRequest]:
    """The requests of the trace at ``path`` in timestamp order (stable for equal times).

    ``window_s`` keeps the requests with ``start <= timestamp < end`` (trace seconds);
    ``max_requests`` then keeps the first ones. Raises TraceError naming the bad line.
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    out = []
    parent_of: dict[int, int] = {}
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{no}: not JSON ({exc.msg})") from None
        record = _trace_record(obj, f"{path}:{no}")
        _check_chain(record.hash_ids, parent_of, f"{path}:{no}")
        out.append(record)
    out.sort(key=lambda r: r.timestamp_ms)
    if window_s is not None:
        lo, hi = window_s[0] * 1000.0, window_s[1] * 1000.0
        out = [r for r in out if lo <= r.timestamp_ms < hi]
    if max_requests is not None:
        out = out[:max_requests]
    if not out:
        raise TraceError(f"{path}: no request left (empty file, or the window/limit excludes all)")
    return out


def unique_blocks(trace: Iterable[TraceRequest]) -> int:
    """How many distinct block ids the trace asks for."""
    seen: set[int] = set()
    for r in trace:
        seen.update(r.hash_ids)
    return len(seen)


@dataclass(frozen=True)
class BlockShape:
    """How trace blocks become tokens and pages."""

    block_tokens: int = 512
    page_tokens: int = 512
    outputs: OutputTokens = OutputTokens.DROP

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.page_tokens < 1:
            raise ConfigError("block_tokens and page_tokens must be >= 1")
        if self.block_tokens % self.page_tokens:
            raise ConfigError(
                f"page_tokens={self.page_tokens} must divide block_tokens={self.block_tokens}: "
                "a block is cut into whole pages"
            )

    @property
    def pages_per_block(self) -> int:
        return self.block_tokens // self.page_tokens

    def output_tokens(self, r: TraceRequest) -> int:
        """Output tokens the replay allocates for ``r`` (0 unless outputs are inserted)."""
        return 0 if self.outputs is OutputTokens.DROP else r.output_length

    def output_pages(self, r: TraceRequest) -> int:
        """Whole pages of output the request caches (0 unless outputs are inserted)."""
        if self.outputs is OutputTokens.DROP:
            return 0
        return r.output_length // self.page_tokens


def output_block_base(trace: Sequence[TraceRequest], block_tokens: int) -> list[int]:
    """Per request, the first block id of its output (ids past every input id, unique per
    request), so that inserted outputs are content no other request has."""
    nxt = 1 + max((max(r.hash_ids) for r in trace if r.hash_ids), default=-1)
    out = []
    for r in trace:
        out.append(nxt)
        nxt += -(-r.output_length // block_tokens)
    return out


def request_tokens(block_ids: Sequence[int] | np.ndarray, block_tokens: int) -> np.ndarray:
    """The token ids of the blocks ``block_ids``, block after block."""
    ids = np.asarray(block_ids, dtype=np.int64)
    return (ids[:, None] * block_tokens + np.arange(block_tokens, dtype=np.int64)).ravel()


def page_chains(trace: Sequence[TraceRequest], shape: BlockShape) -> list[np.ndarray]:
    """Each request's pages as ids (block id × pages_per_block + page within the block),
    input then cached output: the model the offline bounds run on."""
    ppb = shape.pages_per_block
    bases = output_block_base(trace, shape.block_tokens)
    out = []
    for r, base in zip(trace, bases):
        ids = np.asarray(r.hash_ids, dtype=np.int64)
        pages = (ids[:, None] * ppb + np.arange(ppb, dtype=np.int64)).ravel()
        n_out = shape.output_pages(r)
        if n_out:
            # Output token t is token (base * block_tokens + t): its page id follows from it.
            first = base * ppb
            pages = np.concatenate([pages, np.arange(first, first + n_out, dtype=np.int64)])
        out.append(pages)
    return out


@dataclass
class ReplaySettings:
    """One replay: capacities in blocks, the device eviction policy, and the time model."""

    device_blocks: int
    host_blocks: int = 0
    shape: BlockShape = field(default_factory=BlockShape)
    policy: EvictionPolicyKind = EvictionPolicyKind.LRU
    eviction_sample_size: int = 64
    seed: int = 0
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    host_hit_retention: float = 1.0  # ControllerConfig.host_hit_retention_turnovers
    time_scale: float = 1.0
    decode_ms_per_token: float = 0.0
    check_invariants_every: int = 0

    def __post_init__(self) -> None:
        if self.device_blocks < 1:
            raise ConfigError(f"device_blocks must be >= 1, got {self.device_blocks}")
        if self.host_blocks < 0:
            raise ConfigError(f"host_blocks must be >= 0, got {self.host_blocks}")
        if not self.host_hit_retention >= 0:
            raise ConfigError(f"host_hit_retention must be >= 0, got {self.host_hit_retention}")
        if not self.time_scale > 0:
            raise ConfigError(f"time_scale must be > 0, got {self.time_scale}")
        if self.decode_ms_per_token < 0:
            raise ConfigError("decode_ms_per_token must be >= 0")


@dataclass
class ReplayResult:
    """Counts of one replay, in tokens of input blocks (hits count whole blocks' tokens),
    and the time spent inside cache calls."""

    requests: int = 0
    requested_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    load_back_failures: int = 0
    waits: int = 0  # admissions that waited for an in-flight request to finish
    cache_ops: int = 0
    cache_seconds: float = 0.0
    evicted_tokens: int = 0

    @property
    def device_hit_ratio(self) -> float:
        return self.device_hit_tokens / self.requested_tokens if self.requested_tokens else 0.0

    @property
    def host_hit_ratio(self) -> float:
        return self.host_hit_tokens / self.requested_tokens if self.requested_tokens else 0.0

    @property
    def total_hit_ratio(self) -> float:
        return self.device_hit_ratio + self.host_hit_ratio

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.cache_seconds if self.cache_seconds else 0.0

    @property
    def ops_per_s(self) -> float:
        return self.cache_ops / self.cache_seconds if self.cache_seconds else 0.0


REPLAY_LAYOUT = ModelLayout(
    ("full",), num_kv_heads=1, head_dim=1, dtype="float32", model_id="hicache-trace-replay"
)


class ReplayError(RuntimeError):
    """The replay cannot go on with these settings (the message says what to change)."""


class TraceReplayer:
    """Drives one trace through a cache (and a LocalController for the host tier)."""

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        settings: ReplaySettings,
        leaf_policy: LeafEvictionPolicy | None = None,
    ) -> None:
        """``leaf_policy``, when given, replaces the one ``settings.policy`` names (a
        policy with its own parameters)."""
        self.trace = trace
        self.settings = settings
        self.shape = settings.shape
        bt, pt = self.shape.block_tokens, self.shape.page_tokens
        config = CacheConfig(
            page_size=pt,
            full_slots=settings.device_blocks * bt,
            mamba_slots=0,
            eviction_policy=settings.policy,
            eviction_sample_size=settings.eviction_sample_size,
            seed=settings.seed,
            write_policy=settings.write_policy,
        )
        self.controller = None
        if settings.host_blocks:
            from hicache.controller.config import ControllerConfig, HostPinning
            from hicache.controller.store.local import LocalController

            page_bytes = REPLAY_LAYOUT.page_bytes(ComponentType.FULL, pt)
            ccfg = ControllerConfig(
                host_pool_bytes=settings.host_blocks * self.shape.pages_per_block * page_bytes,
                host_pinning=HostPinning.PAGEABLE,
                host_hit_retention_turnovers=settings.host_hit_retention,
                disk_path=None,
            )
            self.controller = LocalController(ccfg)
        self.pools = DevicePools.allocate(REPLAY_LAYOUT, config)
        self.cache = UnifiedRadixCache(
            REPLAY_LAYOUT,
            config,
            self.pools,
            self.controller,
            leaf_policy or make_leaf_policy(config),
        )
        self.result = ReplayResult()
        self._inflight: list[tuple[float, int, Request]] = []
        self._output_base = output_block_base(trace, self.shape.block_tokens)

    def close(self) -> None:
        """Finish what is in flight and release the controller and pools."""
        while self._inflight:
            self._finish_next()
        if self.controller is not None:
            self.controller.close()
        self.pools.close()

    def run(self) -> ReplayResult:
        """Replay every request; returns the counts."""
        s = self.settings
        for i, r in enumerate(self.trace):
            arrival = r.timestamp_ms / s.time_scale
            while self._inflight and self._inflight[0][0] <= arrival:
                self._finish_next()
            decode_ms = r.output_length * s.decode_ms_per_token
            self._admit(i, r, arrival + decode_ms if decode_ms > 0 else None)
            if s.check_invariants_every and (i + 1) % s.check_invariants_every == 0:
                self.check()
        while self._inflight:
            self._finish_next()
        self.result.evicted_tokens = self.cache.evicted.full_tokens
        return self.result

    def check(self) -> None:
        """The cache's (and controller's) invariants hold."""
        self.cache.check_invariants()
        if self.controller is not None:
            self.controller.check_invariants()

    def _tokens(self, i: int, r: TraceRequest) -> tuple[np.ndarray, np.ndarray]:
        bt = self.shape.block_tokens
        tokens = request_tokens(r.hash_ids, bt)
        n_out = self.shape.output_pages(r) * self.shape.page_tokens
        if self.shape.outputs is OutputTokens.DROP or not r.output_length:
            return tokens, tokens[:0]
        start = self._output_base[i] * bt
        out = np.arange(start, start + r.output_length, dtype=np.int64)
        assert out.size >= n_out
        return tokens, out

    def _admit(self, i: int, r: TraceRequest, finish_ms: float | None) -> None:
        tokens, output = self._tokens(i, r)
        while True:
            try:
                self._serve(i, tokens, output, finish_ms)
                return
            except PoolExhaustedError:
                if not self._inflight:
                    need = -(-(tokens.size + output.size) // self.shape.block_tokens)
                    raise ReplayError(
                        f"request {i} ({need} blocks) does not fit in a device tier of "
                        f"{self.settings.device_blocks} blocks; raise the device capacity"
                    ) from None
                self.result.waits += 1
                self._finish_next()

    def _serve(
        self, i: int, tokens: np.ndarray, output: np.ndarray, finish_ms: float | None
    ) -> None:
        cache = self.cache
        req = Request(rid=i)
        ops = 2
        t0 = time.perf_counter()
        m = cache.match_prefix(tokens, req=req)
        loaded = False
        if m.load_node is not None:
            ops += 1
            loaded = cache.load_back(m.load_node, req=req)
        try:
            cache.alloc_tokens(req, tokens.size - req.prefix_len + output.size)
        except PoolExhaustedError:
            cache.cache_finished_req(req, insert=False)
            raise
        req.append_tokens(tokens[req.prefix_len :])
        if output.size:
            req.append_tokens(output)
        if finish_ms is not None:
            ops += 1
            cache.cache_unfinished_req(req)
            heapq.heappush(self._inflight, (finish_ms, i, req))
        else:
            cache.cache_finished_req(req)
        self.result.cache_seconds += time.perf_counter() - t0
        res = self.result
        res.cache_ops += ops
        res.requests += 1
        res.requested_tokens += tokens.size
        res.device_hit_tokens += m.prefix_len
        if loaded:
            res.host_hit_tokens += req.prefix_len - m.prefix_len
        elif m.load_node is not None:
            res.load_back_failures += 1

    def _finish_next(self) -> None:
        _, _, req = heapq.heappop(self._inflight)
        t0 = time.perf_counter()
        self.cache.cache_finished_req(req)
        self.result.cache_seconds += time.perf_counter() - t0
        self.result.cache_ops += 1


def replay(trace: Sequence[TraceRequest], settings: ReplaySettings) -> ReplayResult:
    """Replay ``trace`` through a fresh cache built from ``settings``; returns the counts."""
    replayer = TraceReplayer(trace, settings)
    try:
        return replayer.run()
    finally:
        replayer.close()
