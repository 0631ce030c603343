"""The cache is exact: the scheduler's logits with the cache on equal ``generate()``'s.

Every scenario plays a small multi-turn chat workload (shared system prompts, each turn
extending the previous one) through :class:`Scheduler` and compares the logits of every
generated token with the cache-off baseline :func:`generate` by ``torch.equal``: hits
served from the device (Mamba state copied on write), from the host tier after device
eviction, from disk after the controller is closed and reopened on the same LMDB folder,
through the sidecar (another process), and under pool pressure with preemption. Across
FULL-only, FULL+SWA, FULL+MAMBA and all three, with page sizes 1 and 16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache import CacheConfig, ConfigError, DevicePools, UnifiedRadixCache
from hicache.apps.engine import HybridModel, generate, tiny_hybrid
from hicache.apps.engine.cluster import SidecarProcess
from hicache.apps.engine.scheduler import (
    GenerationRequest,
    RequestResult,
    Scheduler,
    SchedulerConfig,
)
from hicache.apps.engine.workload import ChatTurn, ChatWorkload, ChatWorkloadConfig
from hicache.config import PrefetchPolicy
from hicache.controller.client.sidecar_client import SidecarClientConfig, SidecarController
from hicache.controller.config import ControllerConfig
from hicache.controller.store.local import LocalController

KINDS = {
    "full": ("full", "full"),
    "full+swa": ("full", "swa"),
    "full+mamba": ("full", "mamba"),
    "full+swa+mamba": ("full", "swa", "mamba", "full"),
}
MATRIX = [(mix, ps) for mix in KINDS for ps in (1, 16)]
WINDOW = 24
NEW_TOKENS = 3
CHAT = ChatWorkloadConfig(
    conversations=3,
    turns=2,
    system_prompts=2,
    system_prompt_tokens=40,
    user_tokens_min=6,
    user_tokens_max=18,
    new_tokens=NEW_TOKENS,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cache_config(mix: str, page_size: int, **overrides) -> CacheConfig:
    fields = {
        "page_size": page_size,
        "sliding_window": WINDOW if "swa" in mix else None,
        "full_slots": 2048,
        "mamba_slots": 32,
        **overrides,
    }
    return CacheConfig(**fields)


def chunk_tokens(page_size: int) -> int:
    return 16 if page_size == 16 else 12


class Engine:
    """A model, its pools, a cache (optionally over a controller) and a scheduler."""

    def __init__(self, mix: str, page_size: int, controller=None, sched=None, **config):
        spec = tiny_hybrid(KINDS[mix], page_size=page_size, sliding_window=WINDOW)
        self.model = HybridModel(spec.layout, spec.model_config)
        self.config = cache_config(mix, page_size, **config)
        self.pools = DevicePools.allocate(spec.layout, self.config)
        self.cache = UnifiedRadixCache(spec.layout, self.config, self.pools, controller)
        self.scheduler = Scheduler(
            self.model,
            self.cache,
            sched
            or SchedulerConfig(prefill_chunk_tokens=chunk_tokens(page_size), check_invariants=True),
        )

    def serve(self, requests: list[GenerationRequest]) -> list[RequestResult]:
        return self.scheduler.run(requests)

    def settle(self) -> None:
        self.cache.flush_backups()
        self.cache.check_invariants()

    def assert_no_leak(self) -> None:
        """With every request done and the tree dropped, every pool slot is free."""
        self.cache.reset()
        full = {p.name: p.capacity for p in self.pools.all()}
        assert self.pools.free_counts() == full

    def close(self) -> None:
        if self.cache.controller is not None:
            self.cache.controller.close()
        self.pools.close()


class Reference:
    """``generate()`` logits per request, on pools of its own (computed once per request)."""

    def __init__(self, mix: str, page_size: int) -> None:
        spec = tiny_hybrid(KINDS[mix], page_size=page_size, sliding_window=WINDOW)
        self.model = HybridModel(spec.layout, spec.model_config)
        self.pools = DevicePools.allocate(spec.layout, cache_config(mix, page_size))
        self.page_size = page_size
        self.logits: dict[tuple[int, ...], torch.Tensor] = {}

    def of(self, request: GenerationRequest) -> torch.Tensor:
        key = (*request.prompt_ids, -request.max_new_tokens)
        if key not in self.logits:
            # another chunking than the engine's
            chunk = {1: 7, 16: 64}.get(self.page_size, 7 * self.page_size)
            self.logits[key] = generate(
                self.model,
                self.pools,
                request.prompt_ids,
                request.max_new_tokens,
                prefill_chunk_tokens=chunk,
            ).logits
        return self.logits[key]

    def check(self, requests: list[GenerationRequest], results: list[RequestResult]) -> None:
        """Every generated token's logits equal the cache-off run's, and every token was
        either a hit or computed, exactly once."""
        assert [r.rid for r in results] == [q.rid for q in requests]
        for request, result in zip(requests, results):
            assert result.error is None, result.error
            assert result.logits is not None and result.logits.shape[0] == request.max_new_tokens
            assert torch.equal(result.logits, self.of(request)), f"{request.rid}: logits differ"
            assert result.output_ids == result.logits.argmax(dim=-1).tolist()
            if result.preemptions == 0:
                computed = len(request.prompt_ids) + request.max_new_tokens - 1
                assert result.hit_tokens + result.computed_tokens == computed


def play(engine: Engine, reference: Reference) -> list[GenerationRequest]:
    """Play the chat workload on ``engine``, checking every round; returns all requests."""

    def serve(_round: int, turns: list[ChatTurn]) -> list[RequestResult]:
        requests = [t.request for t in turns]
        results = engine.serve(requests)
        reference.check(requests, results)
        return results

    rounds = ChatWorkload(CHAT).play(serve)
    return [t.request for turns in rounds for t in turns]


def totals(results: list[RequestResult]) -> dict[str, int]:
    return {
        "device": sum(r.device_hit_tokens for r in results),
        "host": sum(r.host_hit_tokens for r in results),
        "disk": sum(r.disk_hit_tokens for r in results),
        "failed_loads": sum(r.load_back_failures for r in results),
    }


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, int], Reference]:
    return {}


def reference_for(references, mix: str, page_size: int) -> Reference:
    return references.setdefault((mix, page_size), Reference(mix, page_size))


# -- device tier -----------------------------------------------------------------------------


@pytest.mark.parametrize(("mix", "page_size"), MATRIX)
def test_device_hits_give_the_cache_less_logits(mix, page_size, references):
    reference = reference_for(references, mix, page_size)
    engine = Engine(mix, page_size)
    requests = play(engine, reference)
    # Replayed: every request now hits its own cached prompt (the whole prompt but the
    # last token, down to a page boundary with a Mamba state), copied on write.
    replay = engine.serve(requests)
    reference.check(requests, replay)
    hits = totals(replay)
    assert hits["host"] == hits["disk"] == 0
    # What is left to compute: the last token and the decode steps, after at most a page
    # (with Mamba layers: a prefill chunk, the spacing of the cached states).
    tail = chunk_tokens(page_size) if "mamba" in mix else page_size
    for request, result in zip(requests, replay):
        assert result.computed_tokens <= tail + NEW_TOKENS, request.rid
    # decode steps were batched across requests
    stats = engine.scheduler.stats
    assert stats.steps < stats.decode_tokens
    engine.assert_no_leak()


def test_a_cached_mamba_state_is_copied_on_write_not_shared():
    """Requests that continue from one cached state each write their own copy: the cached
    state is unchanged, so a third request from it still matches the cache-off run."""
    mix, page_size = "full+swa+mamba", 16
    reference = Reference(mix, page_size)
    engine = Engine(mix, page_size)
    prefix = list(range(1, 65))
    first = GenerationRequest.of("base", [*prefix, 7], NEW_TOKENS)
    reference.check([first], engine.serve([first]))
    node = engine.cache.match_prefix(prefix).last_node
    state = engine.cache.mamba.state_of(node)
    before = engine.pools.mamba.ssm[:, state].clone()
    branches = [GenerationRequest.of(f"b{i}", prefix + [10 + i] * (5 + i), 4) for i in range(3)]
    results = engine.serve(branches)
    reference.check(branches, results)
    assert all(r.device_hit_tokens == 64 for r in results)
    assert torch.equal(engine.pools.mamba.ssm[:, state], before)
    engine.assert_no_leak()


# -- host and disk tiers ------------------------------------------------------------------


def local_controller(disk) -> LocalController:
    return LocalController(
        ControllerConfig(host_pool_bytes=16 << 20, disk_path=disk, disk_budget_bytes=64 << 20)
    )


@pytest.mark.parametrize(("mix", "page_size"), MATRIX)
def test_host_and_disk_hits_give_the_cache_less_logits(mix, page_size, references, tmp_path):
    reference = reference_for(references, mix, page_size)
    disk = tmp_path / "lmdb"
    ctrl = local_controller(disk)
    engine = Engine(mix, page_size, ctrl)
    requests = play(engine, reference)
    engine.settle()
    assert ctrl.flush(30.0)

    # host: the device tier is emptied; every prefix comes back from host pages
    engine.cache.evict(full_tokens=engine.pools.full.capacity)
    assert engine.cache.stats().total_tokens == 0
    replay = engine.serve(requests)
    reference.check(requests, replay)
    hits = totals(replay)
    assert hits["host"] > 0 and hits["disk"] == 0 and hits["failed_loads"] == 0
    engine.settle()
    engine.assert_no_leak()
    ctrl.check_invariants()
    ctrl.close()

    # disk: a restarted controller on the same folder; a fresh engine, nothing on host
    ctrl = local_controller(disk)
    engine = Engine(mix, page_size, ctrl, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    last_turns = requests[CHAT.conversations :]
    replay = engine.serve(last_turns)
    reference.check(last_turns, replay)
    hits = totals(replay)
    assert hits["disk"] > 0 and hits["failed_loads"] == 0
    engine.settle()
    engine.assert_no_leak()
    ctrl.check_invariants()
    ctrl.close()


def test_a_second_engine_hits_what_the_first_backed_up(tmp_path):
    """Two engines (two caches and pool sets) over one controller: B loads A's prefixes
    from the host tier."""
    mix, page_size = "full+swa+mamba", 16
    reference = Reference(mix, page_size)
    ctrl = local_controller(tmp_path / "lmdb")
    a = Engine(mix, page_size, ctrl.session("a"))
    b = Engine(mix, page_size, ctrl.session("b"))
    requests = play(a, reference)
    a.settle()
    results = b.serve(requests)
    reference.check(requests, results)
    assert totals(results)["host"] > 0
    for engine in (a, b):
        engine.settle()
        engine.assert_no_leak()
    ctrl.close()


# -- through the sidecar ----------------------------------------------------------------------


def test_hits_through_the_sidecar_give_the_cache_less_logits(tmp_path):
    """Engines in this process, the sidecar in another (``hicache serve``): A's own hits
    on the device, B's on the host tier (pages A backed up), over shared-memory pools;
    every logit exact. (Disk hits through a restarted sidecar: tests/apps/test_demo.py.)"""
    mix, page_size = "full+swa+mamba", 16
    reference = Reference(mix, page_size)
    sidecar = SidecarProcess(tmp_path).start()
    engines: list[Engine] = []

    def engine(name: str) -> Engine:
        # generous timeouts: a lookup that times out on a busy machine is a miss
        config = SidecarClientConfig(lookup_timeout_s=5.0, request_timeout_s=30.0)
        ctl = SidecarController(sidecar.endpoint, engine_id=name, config=config)
        engines.append(Engine(mix, page_size, ctl, shared_memory=True))
        return engines[-1]

    try:
        a = engine("a")
        requests = play(a, reference)
        a.settle()
        replay = a.serve(requests)
        reference.check(requests, replay)
        assert totals(replay)["device"] > 0
        b = engine("b")
        results = b.serve(requests)
        reference.check(requests, results)
        assert totals(results)["host"] > 0 and totals(results)["failed_loads"] == 0
        for e in (a, b):
            e.settle()
            e.assert_no_leak()
    finally:
        for e in engines:
            e.close()
        assert sidecar.stop() == 0


# -- pressure, failures, the cache-off run ------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_pool_pressure_evicts_waits_and_preempts_but_stays_exact(page_size):
    """Pools far smaller than the work: requests wait, get preempted and resume from
    what they cached, and still give the cache-off logits; nothing leaks."""
    mix = "full+swa+mamba"
    reference = Reference(mix, page_size)
    engine = Engine(
        mix,
        page_size,
        full_slots=192,
        mamba_slots=6,
        sched=SchedulerConfig(
            prefill_chunk_tokens=16, max_running_requests=6, check_invariants=True
        ),
    )
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 256, 32).tolist()
    requests = [
        GenerationRequest.of(f"p{i}", shared + rng.integers(0, 256, 20 + 3 * i).tolist(), 24)
        for i in range(6)
    ]
    results = engine.serve(requests)
    reference.check(requests, results)
    stats = engine.scheduler.stats
    assert stats.preemptions > 0 and stats.waits > 0
    assert sum(r.preemptions for r in results) == stats.preemptions
    engine.assert_no_leak()


def test_a_request_larger_than_the_pools_fails_alone_and_the_rest_are_served():
    mix, page_size = "full+swa", 16
    reference = Reference(mix, page_size)
    engine = Engine(
        mix,
        page_size,
        full_slots=256,
        swa_slots=64,
        sched=SchedulerConfig(prefill_chunk_tokens=96, max_prefill_tokens_per_step=96),
    )
    rng = np.random.default_rng(6)
    small = GenerationRequest.of("small", rng.integers(0, 256, 20).tolist(), 3)
    # fits the FULL pool, but its chunk's SWA pages do not fit the SWA pool
    big = GenerationRequest.of("big", rng.integers(0, 256, 200).tolist(), 3)
    results = engine.serve([small, big])
    reference.check([small], results[:1])
    assert results[1].error is not None and "cannot hold request 'big'" in results[1].error
    assert results[1].output_ids == [] and engine.scheduler.stats.failed_requests == 1
    engine.assert_no_leak()


def test_requests_that_can_never_be_served_are_refused_at_submit():
    engine = Engine("full", 16, full_slots=128)
    scheduler = engine.scheduler
    with pytest.raises(ValueError, match="prompt is empty"):
        scheduler.submit(GenerationRequest.of("e", [], 2))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        scheduler.submit(GenerationRequest.of("z", [1], 0))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
        scheduler.submit(GenerationRequest.of("v", [256], 2))
    with pytest.raises(ValueError, match="needs 130 token slots"):
        scheduler.submit(GenerationRequest.of("l", [1] * 120, 11))
    scheduler.submit(GenerationRequest.of("d", [1, 2], 2))
    with pytest.raises(ValueError, match="already queued"):
        scheduler.submit(GenerationRequest.of("d", [3], 2))
    with pytest.raises(ConfigError, match="multiple of the page size 16"):
        Scheduler(engine.model, engine.cache, SchedulerConfig(prefill_chunk_tokens=24))


def test_the_cache_off_scheduler_computes_everything_and_matches_generate():
    mix, page_size = "full+swa+mamba", 16
    reference = Reference(mix, page_size)
    engine = Engine(
        mix, page_size, sched=SchedulerConfig(prefill_chunk_tokens=32, reuse_prefixes=False)
    )
    requests = play(engine, reference)
    results = engine.serve(requests)
    reference.check(requests, results)
    assert totals(results)["device"] == 0
    assert engine.cache.stats().total_tokens == 0
    engine.assert_no_leak()
