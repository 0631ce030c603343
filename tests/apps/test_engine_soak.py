"""End-to-end exactness soak (``pytest -m slow``): random workloads through the scheduler,
the cache and a real LocalController, logits compared with the cache-off run.

Each example draws a component mix, a page size, tight device pools (so requests wait,
get preempted and evict each other), a host tier from none to roomy, a write and a
prefetch policy, and a few rounds of requests that share and extend each other's
prompts (some replayed after the device tier was emptied, so hits come from the host
and disk). Every generated token's logits must equal ``generate()``'s, nothing may leak,
and both invariant checkers must hold. ``HICACHE_ENGINE_SOAK_EXAMPLES`` sets how many
examples run (default 60).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.apps.engine.scheduler import GenerationRequest, SchedulerConfig
from hicache.config import PrefetchPolicy, WritePolicy
from hicache.controller.config import ControllerConfig
from hicache.controller.store.local import LocalController
from tests.apps.test_engine_exact import KINDS, Engine, Reference

EXAMPLES = int(os.environ.get("HICACHE_ENGINE_SOAK_EXAMPLES", "60"))
_REFERENCES: dict[tuple[str, int], Reference] = {}


@st.composite
def workloads(draw):
    mix = draw(st.sampled_from(list(KINDS)))
    ps = draw(st.sampled_from([1, 4, 16]))
    pool_pages = draw(st.integers(96 // ps + 2, 384 // ps))
    chunk = ps * draw(st.integers(1, max(1, 32 // ps)))
    host = draw(st.sampled_from([0, 64 << 10, 1 << 20, 16 << 20]))
    backup_chunk = draw(st.sampled_from([1, 4096, 64 << 20]))  # bytes per backup part
    rng_seed = draw(st.integers(0, 2**31 - 1))
    rounds = draw(st.integers(2, 3))
    per_round = draw(st.integers(2, 6))
    new_tokens = draw(st.integers(1, 5))
    return {
        "mix": mix,
        "ps": ps,
        "full_slots": pool_pages * ps,
        "mamba_slots": draw(st.integers(4, 12)),
        "chunk": chunk,
        "max_running": draw(st.integers(1, 6)),
        "host": host,
        "backup_chunk": backup_chunk,
        "write_policy": draw(st.sampled_from(list(WritePolicy))),
        "prefetch": draw(st.sampled_from(list(PrefetchPolicy))),
        "seed": rng_seed,
        "rounds": rounds,
        "per_round": per_round,
        "new_tokens": new_tokens,
        "empty_device_between_rounds": draw(st.booleans()),
    }


def _requests(w, vocab: int) -> list[list[GenerationRequest]]:
    """Rounds of requests: prompts from a few shared heads, later rounds extending earlier
    prompts (a conversation going on) or repeating them."""
    rng = np.random.default_rng(w["seed"])
    budget = w["full_slots"] // 2 - w["new_tokens"]
    heads = [rng.integers(0, vocab, int(rng.integers(4, 40))).tolist() for _ in range(3)]
    rounds, earlier = [], []
    for r in range(w["rounds"]):
        batch = []
        for i in range(w["per_round"]):
            if earlier and rng.random() < 0.6:
                base = list(earlier[int(rng.integers(len(earlier)))])
            else:
                base = list(heads[int(rng.integers(len(heads)))])
            prompt = base + rng.integers(0, vocab, int(rng.integers(0, 24))).tolist()
            prompt = prompt[: max(1, budget)]
            batch.append(GenerationRequest.of(f"r{r}-{i}", prompt, w["new_tokens"]))
        earlier += [q.prompt_ids for q in batch]
        rounds.append(batch)
    return rounds


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=False,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(w=workloads())
def test_random_workloads_stay_exact_and_leak_nothing(w, tmp_path_factory):
    mix, ps = w["mix"], w["ps"]
    reference = _REFERENCES.setdefault((mix, ps), Reference(mix, ps))
    ctrl = None
    if w["host"]:
        ctrl = LocalController(
            ControllerConfig(
                host_pool_bytes=w["host"],
                disk_path=tmp_path_factory.mktemp("lmdb"),
                disk_budget_bytes=8 << 20,
                backup_chunk_bytes=w["backup_chunk"],
            )
        )
    engine = Engine(
        mix,
        ps,
        ctrl,
        sched=SchedulerConfig(
            prefill_chunk_tokens=w["chunk"],
            max_prefill_tokens_per_step=max(w["chunk"], 64),
            max_running_requests=w["max_running"],
            check_invariants=True,
        ),
        full_slots=w["full_slots"],
        mamba_slots=w["mamba_slots"],
        write_policy=w["write_policy"],
        prefetch_policy=w["prefetch"],
    )
    try:
        for batch in _requests(w, engine.model.config.vocab_size):
            results = engine.serve(batch)
            reference.check(batch, results)
            engine.cache.check_invariants()
            if ctrl is not None:
                ctrl.check_invariants()
            if w["empty_device_between_rounds"]:
                engine.settle()
                engine.cache.evict(full_tokens=engine.pools.full.capacity)
                engine.cache.check_invariants()
        engine.settle()
        engine.assert_no_leak()
        if ctrl is not None:
            ctrl.check_invariants()
    finally:
        engine.close()
