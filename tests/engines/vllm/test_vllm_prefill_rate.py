"""The vLLM connector measures the engine's prefill rate from vLLM's own steps: fed
vLLM's own scheduler outputs with time injected, the rate converges to the model's
(decode-only steps and one slow step left out, overlapping steps timed without their
overlap); on the real vLLM CPU engine, the scheduler's lookups bring a measured rate to
the sidecar's cost rule, and ``hicache_prefill_tokens_per_s`` is used as given."""

from __future__ import annotations

import random

import pytest
from conftest import Instance, sidecar_stats
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from hicache.integrations.vllm import HiCacheVllmConfig
from hicache.integrations.vllm_prefill import StepRate, step_tokens
from tests.support.sidecar import Sidecar

RATE = 4000.0  # tokens per second of the injected clock


class Client:
    """What the connector hands the rate to: the scheduler's sidecar client."""

    def __init__(self) -> None:
        self.measured: list[float] = []

    def report_prefill_rate(self, tokens_per_s: float | None, measured: bool = False) -> None:
        assert measured
        self.measured.append(tokens_per_s)


def _step(new: dict[str, int], cached: dict[str, tuple[int, int]]) -> SchedulerOutput:
    """vLLM's scheduler output: ``new`` requests' tokens; ``cached`` requests' (tokens,
    outputs produced so far)."""
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [
        NewRequestData(rid, list(range(n)), [], None, None, ([],), 0, None)
        for rid, n in new.items()
    ]
    data = CachedRequestData.make_empty()
    data.req_ids = list(cached)
    data.num_output_tokens = [produced for _, produced in cached.values()]
    out.scheduled_cached_reqs = data
    out.num_scheduled_tokens = {**new, **{rid: n for rid, (n, _) in cached.items()}}
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    return out


def test_the_rate_from_vllms_scheduler_outputs_converges_with_time_injected() -> None:
    client, now = Client(), [0.0]
    steps = StepRate(client, min_tokens=128)
    steps.meter.clock = lambda: now[0]

    def run(output: SchedulerOutput, slow: float = 1.0) -> None:
        steps.planned(output)
        now[0] += output.total_num_scheduled_tokens / RATE * slow
        steps.finished()

    first = _step({"a": 512}, {})
    assert step_tokens(first) == (512, 512)
    run(first)
    assert client.measured == [RATE]
    # a's chunked prefill goes on beside b's decode: both timed, the step counts.
    run(_step({}, {"a": (300, 0), "b": (1, 7)}))
    assert steps.meter.observed == 2 and client.measured[-1] == pytest.approx(RATE)
    run(_step({}, {"a": (1, 1), "b": (1, 8)}))  # decodes only: not a prefill
    run(_step({}, {"c": (200, 5)}))  # a preempted request computing its output again
    assert steps.meter.observed == 2
    run(_step({"d": 400}, {}), slow=30.0)  # one step slowed by something else
    run(_step({"e": 400}, {}))
    assert client.measured[-1] == pytest.approx(RATE)
    # Step g is planned while f runs (async scheduling): g's time starts at f's output.
    steps.planned(_step({"f": 800}, {}))
    now[0] += 0.1
    steps.planned(_step({"g": 800}, {}))
    now[0] += 800 / RATE - 0.1
    steps.finished()
    now[0] += 800 / RATE
    steps.finished()
    assert steps.meter.observed == 6 and client.measured[-1] == pytest.approx(RATE)


def test_the_options_of_the_measurement_parse() -> None:
    config = HiCacheVllmConfig.from_extra_config(
        {"hicache_prefill_tokens_per_s": "1500", "hicache_prefill_min_tokens": "64"}
    )
    assert (config.prefill_tokens_per_s, config.prefill_min_tokens) == (1500.0, 64)
    assert HiCacheVllmConfig().prefill_tokens_per_s is None  # measured by default


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(100)]


@pytest.mark.parametrize("reported", [None, 1500.0])
def test_the_sidecar_gets_the_engines_rate(tiny_model, sidecar_dir, reported) -> None:
    sidecar = Sidecar(sidecar_dir).start()
    extra = {"hicache_engine_id": "rate", "hicache_prefill_min_tokens": 64}
    if reported is not None:
        extra["hicache_prefill_tokens_per_s"] = reported
    rounds = [[_prompt(1)], [_prompt(2)], [_prompt(3)]]
    inst = Instance(sidecar_dir, "R", tiny_model, rounds, sidecar.socket, (2,), extra=extra)
    try:
        inst.wait_paused(2)  # round 0 prefilled 100 tokens; round 1's lookups sent the rate
        rate = sidecar_stats(sidecar).get("cost_rule.prefill_tokens_per_s.rate-scheduler")
        if reported is None:
            assert rate is not None and rate > 0
        else:
            assert rate == reported
        inst.resume(2)
        assert len(inst.result()) == 3
    finally:
        inst.stop()
        sidecar.stop()
