"""The reference engine's scheduler: requests through one :class:`UnifiedRadixCache`.

Per request the scheduler does what a serving engine does with a prefix cache:

1. **admit**: ``match_prefix`` of the sequence but its last token (the last token must be
   computed to give the logits of the next one), ``load_back`` when the match names a
   prefix on the host or disk tier;
2. **prefill** the rest in page-aligned chunks (``alloc_tokens`` first), keeping a Mamba
   checkpoint at the last page boundary of each chunk (a snapshot taken inside the chunk
   when the chunk does not end on one), releasing SWA pages that fell out of the window,
   and caching each non-final chunk (``cache_unfinished_req``);
3. **decode** greedily, one token per step, batched across every decoding request
   (``forward_batch``), checkpointing at every page boundary;
4. **finish**: ``cache_finished_req``, which caches what was computed: the prompt and
   every generated token but the last.

Each step runs one ``forward_batch`` holding every prefill chunk of the step (up to
``max_prefill_tokens_per_step``) and one decode token of every decoding request. A step
that prefills at least ``prefill_meter.min_tokens`` tokens is timed: the engine's prefill
rate goes to the controller for its cost rule (hicache/prefill_rate.py).

Pool pressure: ``alloc_tokens`` evicts cached prefixes itself. A request it still cannot
serve waits (admission stops while any request waits); when no request can move at all,
in-flight backups are flushed (they hold locks), then the newest request is preempted —
what it computed is cached, its slots freed, and it goes back to the front of the queue
to be matched again. A request that cannot fit even alone fails with an error in its
result; nothing leaks and the scheduler keeps serving.

With ``reuse_prefixes=False`` the same loop is the cache-off run: nothing is matched or
cached, the cache only hands out slots; the demo times its baseline that way.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hicache.apps.engine.model import HybridModel, SequenceChunk, page_boundaries
from hicache.cache import UnifiedRadixCache
from hicache.prefill_rate import PrefillMeter
from hicache.records import Request
from hicache.types import ConfigError, PoolExhaustedError

_NO_TOKENS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class GenerationRequest:
    """One request to the engine: greedy-decode ``max_new_tokens`` after ``prompt_ids``,
    in the cache namespace ``extra_key``."""

    rid: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    extra_key: str | None = None

    @classmethod
    def of(
        cls,
        rid: str,
        prompt_ids: Sequence[int] | np.ndarray | torch.Tensor,
        max_new_tokens: int,
        extra_key: str | None = None,
    ) -> GenerationRequest:
        """A request from any integer sequence (a list, an array, a tensor)."""
        ids = np.asarray(
            prompt_ids.cpu().numpy() if isinstance(prompt_ids, torch.Tensor) else prompt_ids,
            dtype=np.int64,
        ).reshape(-1)
        return cls(rid, tuple(int(t) for t in ids), max_new_tokens, extra_key)


@dataclass
class RequestResult:
    """What one request produced and what the cache saved it.

    ``output_ids`` are the generated tokens and ``logits`` ``[max_new_tokens, vocab]``
    (float32) the logits each was chosen from (None unless the scheduler keeps logits).
    Hit tokens are summed over the request's admissions (more than one after a
    preemption): ``device_hit_tokens`` were matched on the device, ``host_hit_tokens``,
    ``disk_hit_tokens`` and ``remote_hit_tokens`` loaded back from those tiers.
    ``computed_tokens`` went through the model. ``error`` says why a request could not be
    served (then it has no output). Times are ``time.time()`` seconds, comparable across
    processes.
    """

    rid: str
    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    computed_tokens: int = 0
    preemptions: int = 0
    load_back_failures: int = 0
    error: str | None = None
    submitted_at: float = 0.0
    finished_at: float = 0.0

    @property
    def hit_tokens(self) -> int:
        loaded = self.host_hit_tokens + self.disk_hit_tokens + self.remote_hit_tokens
        return self.device_hit_tokens + loaded


@dataclass
class SchedulerConfig:
    """How the scheduler batches work; sizes are tokens or requests, as named.

    ``prefill_chunk_tokens`` must be a multiple of the page size: prefill chunks end on
    page boundaries, where the cache can keep what they computed.
    ``check_invariants`` runs ``cache.check_invariants()`` after every step (tests).
    """

    prefill_chunk_tokens: int = 64
    max_prefill_tokens_per_step: int = 256
    max_running_requests: int = 16
    keep_logits: bool = True
    reuse_prefixes: bool = True
    check_invariants: bool = False

    def validate(self, page_size: int) -> None:
        """Raise ConfigError naming the first value that does not fit ``page_size``."""
        if self.prefill_chunk_tokens < 1 or self.prefill_chunk_tokens % page_size:
            raise ConfigError(
                f"prefill_chunk_tokens={self.prefill_chunk_tokens} must be a positive multiple "
                f"of the page size {page_size}, so that prefill chunks end on page boundaries"
            )
        if self.max_prefill_tokens_per_step < self.prefill_chunk_tokens:
            raise ConfigError(
                f"max_prefill_tokens_per_step={self.max_prefill_tokens_per_step} must be at "
                f"least prefill_chunk_tokens={self.prefill_chunk_tokens}"
            )
        if self.max_running_requests < 1:
            raise ConfigError(f"max_running_requests must be >= 1, got {self.max_running_requests}")


@dataclass
class SchedulerStats:
    """Running totals of one scheduler: forward steps, tokens by phase, pressure events."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    waits: int = 0
    failed_requests: int = 0


class _Running:
    """A request between admission and finish (or back in the queue after preemption)."""

    def __init__(self, spec: GenerationRequest, submitted_at: float) -> None:
        self.spec = spec
        # prompt + generated: the last token is the next one to compute
        self.sequence: list[int] = list(spec.prompt_ids)
        self.logits: list[torch.Tensor] = []
        self.req: Request | None = None
        self.result = RequestResult(spec.rid, len(spec.prompt_ids), submitted_at=submitted_at)

    @property
    def generated(self) -> list[int]:
        return self.sequence[len(self.spec.prompt_ids) :]


@dataclass
class _Planned:
    """One request's chunk in this step: tokens ``start .. end-1`` of its sequence."""

    run: _Running
    start: int
    end: int
    snapshot_at: int | None  # a page boundary inside the chunk to checkpoint the state at


class Scheduler:
    """Serves :class:`GenerationRequest` s with ``model`` over ``cache`` (see module doc)."""

    def __init__(
        self,
        model: HybridModel,
        cache: UnifiedRadixCache,
        config: SchedulerConfig | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.pools = cache.pools
        self.config = config or SchedulerConfig()
        self.page_size = cache.page_size
        self.config.validate(self.page_size)
        if model.layout != cache.layout:
            raise ConfigError(
                "the model and the cache were built for different layouts; build both from "
                "one TinyHybrid (tiny_hybrid(...).build())"
            )
        self.stats = SchedulerStats()
        # The prefill rate of this engine, measured on its steps that prefill at least
        # ``min_tokens`` tokens, for the controller's cost rule (hicache/prefill_rate.py).
        self.prefill_meter = PrefillMeter(cache.controller)
        self._waiting: deque[_Running] = deque()
        self._running: list[_Running] = []
        self._rids: set[str] = set()
        self._blocked = False  # some running request could not get slots in the last step
        self._flushed = False  # backups were flushed since the last step that made progress

    # -- queue ---------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """True when no request is waiting or running."""
        return not self._waiting and not self._running

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, request: GenerationRequest) -> None:
        """Queue ``request``; raises ValueError when it can never be served here."""
        prompt = request.prompt_ids
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError(f"request {request.rid!r}: the prompt is empty")
        if request.max_new_tokens < 1:
            raise ValueError(
                f"request {request.rid!r}: max_new_tokens must be >= 1, got "
                f"{request.max_new_tokens}"
            )
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"request {request.rid!r}: token ids must lie in [0, {vocab})")
        length = len(prompt) + request.max_new_tokens - 1  # tokens whose KV is computed
        limit = min(self.pools.full.capacity, self.model.config.max_positions)
        if length > limit:
            raise ValueError(
                f"request {request.rid!r} needs {length} token slots, more than this engine's "
                f"{limit}; shorten it or give the cache more full_slots"
            )
        if request.rid in self._rids:
            raise ValueError(f"request id {request.rid!r} is already queued or running")
        self._rids.add(request.rid)
        self._waiting.append(_Running(request, time.time()))

    def run(
        self,
        requests: Iterable[GenerationRequest] = (),
        on_finish: Callable[[RequestResult], None] | None = None,
    ) -> list[RequestResult]:
        """Submit ``requests`` and step until every queued request is done; returns the
        results in submission order (those of requests queued before, too)."""
        order = [r.rid for r in self._waiting] + [r.spec.rid for r in self._running]
        for request in requests:
            self.submit(request)
            order.append(request.rid)
        done: dict[str, RequestResult] = {}
        while not self.idle:
            for result in self.step():
                done[result.rid] = result
                if on_finish is not None:
                    on_finish(result)
        return [done[rid] for rid in order]

    # -- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestResult]:
        """Admit what fits, run one batched forward pass, finish what completed; returns
        the requests that finished (or failed) in this step."""
        finished: list[RequestResult] = []
        if not self._blocked:
            finished += self._admit()
        planned = self._plan()
        while not planned and self._running:
            finished += self._relieve_pressure()
            planned = self._plan()
        if planned:
            self._flushed = False
            finished += self._execute(planned)
        if self.config.check_invariants:
            self.cache.check_invariants()
        return finished

    def _admit(self) -> list[RequestResult]:
        """Attach waiting requests while there is room; returns those that failed."""
        failed = []
        while self._waiting and len(self._running) < self.config.max_running_requests:
            run = self._waiting[0]
            try:
                self._attach(run)
            except PoolExhaustedError:
                if self._running:
                    return failed  # no state slot now; one frees when a request finishes
                self.cache.flush_backups()  # backups in flight lock cached states
                try:
                    self._attach(run)
                except PoolExhaustedError:
                    self._waiting.popleft()
                    failed.append(self._fail(run))
                    continue
            self._waiting.popleft()
            self._running.append(run)
        return failed

    def _attach(self, run: _Running) -> None:
        """Match (and load back) the request's sequence; on PoolExhaustedError nothing is
        held."""
        spec, cache = run.spec, self.cache
        req = Request(spec.rid, spec.extra_key)
        if not self.config.reuse_prefixes:
            cache.match_prefix(_NO_TOKENS, spec.extra_key, req=req)
            run.req = req
            return
        m = cache.match_prefix(run.sequence[:-1], spec.extra_key, req=req)
        run.result.device_hit_tokens += m.prefix_len
        if m.load_node is not None:
            before = req.prefix_len
            if cache.load_back(m.load_node, req=req):
                loaded = req.prefix_len - before
                from_host = min(loaded, m.host_hit_len)
                from_disk = min(loaded - from_host, m.disk_hit_len)
                run.result.host_hit_tokens += from_host
                run.result.disk_hit_tokens += from_disk
                run.result.remote_hit_tokens += loaded - from_host - from_disk
            else:
                run.result.load_back_failures += 1
        run.req = req

    def _plan(self) -> list[_Planned]:
        """Each running request's chunk for this step, with its slots allocated; requests
        whose slots cannot be had now are left out (they wait)."""
        ps = self.page_size
        budget = self.config.max_prefill_tokens_per_step
        planned: list[_Planned] = []
        self._blocked = False
        for run in self._running:
            req = run.req
            start, total = req.computed_len, len(run.sequence)
            if total - start == 1:
                end = total  # decode
            else:
                take = min(self.config.prefill_chunk_tokens, budget)
                if take < ps:
                    continue  # the step's prefill budget is spent
                end = start + take
                end = total if end >= total else end - end % ps
                budget -= end - start
            need = end - req.kv_slots.size
            if need > 0:
                try:
                    self.cache.alloc_tokens(req, need)
                except PoolExhaustedError:
                    self._blocked = True
                    if total - start > 1:
                        budget += end - start
                    continue
            snapshot_at = None
            if self.pools.mamba is not None and end % ps:
                inside = page_boundaries(start, end, ps)
                snapshot_at = inside[-1] if inside else None
            planned.append(_Planned(run, start, end, snapshot_at))
        if self._blocked:
            self.stats.waits += 1
        return planned

    def _relieve_pressure(self) -> list[RequestResult]:
        """No running request could move: wait for in-flight backups (they lock what they
        copy), else preempt the newest request, else fail the one left."""
        if not self._flushed:
            self._flushed = True
            self.cache.flush_backups()
            return []
        if len(self._running) > 1:
            self._preempt(self._running.pop())
            return []
        return [self._fail(self._running.pop())]

    def _fail(self, run: _Running) -> RequestResult:
        run.result.error = (
            f"the device pools cannot hold request {run.spec.rid!r} even with everything "
            "else evicted; give the cache more slots"
        )
        self.stats.failed_requests += 1
        return self._finish(run, insert=False)

    def _preempt(self, run: _Running) -> None:
        self.cache.cache_finished_req(run.req, insert=self.config.reuse_prefixes)
        run.req = None
        run.result.preemptions += 1
        self.stats.preemptions += 1
        self._waiting.appendleft(run)

    # -- the forward pass ----------------------------------------------------------------

    def _execute(self, planned: list[_Planned]) -> list[RequestResult]:
        chunks = []
        for p in planned:
            req = p.run.req
            snapshots: tuple[int, ...] = ()
            if p.snapshot_at is not None:
                snapshots = (p.snapshot_at, p.end)
            chunks.append(
                SequenceChunk(
                    p.run.sequence[p.start : p.end],
                    range(p.start, p.end),
                    req.kv_slots[: p.end],
                    req.mamba_slot,
                    snapshots,
                )
            )
        t0 = self.prefill_meter.clock()
        outputs = self.model.forward_batch(self.pools, chunks)
        if self.pools.full.buffer.is_cuda:  # timed to the end of its kernels
            torch.cuda.synchronize(self.pools.full.buffer.device)
        took = self.prefill_meter.clock() - t0
        self.stats.steps += 1
        prefilled = self.stats.prefill_tokens
        finished = []
        for p, out in zip(planned, outputs):
            run, req = p.run, p.run.req
            n = p.end - p.start
            run.result.computed_tokens += n
            if n == 1 and run.generated and p.start == len(run.sequence) - 1:
                self.stats.decode_tokens += 1  # fed the token generated last
            else:
                self.stats.prefill_tokens += n
            self._record(run, p, out.mamba_snapshots)
            self.cache.release_swa_outside_window(req)
            if p.end < len(run.sequence):
                if self.config.reuse_prefixes:
                    self._cache_progress(req)
                continue
            logits = out.logits[-1]
            if self.config.keep_logits:
                run.logits.append(logits.clone())
            run.sequence.append(int(torch.argmax(logits)))
            if len(run.generated) == run.spec.max_new_tokens:
                self._running.remove(run)
                finished.append(self._finish(run, insert=self.config.reuse_prefixes))
        if self.stats.prefill_tokens - prefilled >= self.prefill_meter.min_tokens:
            self.prefill_meter.observe(sum(p.end - p.start for p in planned), took)
        return finished

    def _record(self, run: _Running, p: _Planned, snapshots: dict) -> None:
        """Record the chunk's tokens as computed, checkpointing the Mamba state at the
        chunk's last page boundary."""
        req, tokens = run.req, run.sequence
        if p.snapshot_at is None:
            req.append_tokens(tokens[p.start : p.end])
            if p.end % self.page_size == 0:
                self._checkpoint(req)
            return
        req.append_tokens(tokens[p.start : p.snapshot_at])
        snapshots[p.snapshot_at].write_to(self.pools, req.mamba_slot)
        self._checkpoint(req)
        snapshots[p.end].write_to(self.pools, req.mamba_slot)
        req.append_tokens(tokens[p.snapshot_at : p.end])

    def _checkpoint(self, req: Request) -> None:
        # Without a state slot for the copy the older checkpoint stays valid; only what
        # can be cached at the end shrinks.
        with contextlib.suppress(PoolExhaustedError):
            self.cache.checkpoint_mamba(req)

    def _cache_progress(self, req: Request) -> None:
        # Caching progress is an optimisation; without a state slot the request simply
        # keeps its own slots until it finishes.
        with contextlib.suppress(PoolExhaustedError):
            self.cache.cache_unfinished_req(req)

    def _finish(self, run: _Running, insert: bool) -> RequestResult:
        if run.req is not None:
            self.cache.cache_finished_req(run.req, insert=insert)
            run.req = None
        result = run.result
        result.output_ids = list(run.generated) if result.error is None else []
        if self.config.keep_logits and result.error is None:
            vocab = self.model.config.vocab_size
            result.logits = torch.stack(run.logits) if run.logits else torch.empty(0, vocab)
        result.finished_at = time.time()
        self._rids.discard(run.spec.rid)
        return result
