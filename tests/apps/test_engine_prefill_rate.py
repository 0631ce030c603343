"""The reference engine measures its own prefill rate for the cost rule: each step that
prefills enough tokens is timed and the rate reaches the controller, where it converges
to the model's rate, ignores one slow step and follows a lasting change. Time is injected:
the model's forward advances a fake clock by its tokens over a set rate."""

from __future__ import annotations

import pytest

from hicache.apps.engine.scheduler import GenerationRequest, SchedulerConfig
from hicache.controller.config import ControllerConfig
from hicache.controller.store.local import LocalController
from tests.apps.test_engine_exact import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RATE = 3000.0  # tokens per second the fake clock gives the model


class Timed:
    """``model.forward_batch`` taking ``tokens / rate`` seconds of a fake clock (times
    ``slow`` for the next call only)."""

    def __init__(self, model, rate: float) -> None:
        self.now, self.rate, self.slow = 0.0, rate, 1.0
        self._forward = model.forward_batch
        model.forward_batch = self

    def __call__(self, pools, chunks):
        tokens = sum(len(c.token_ids) for c in chunks)
        self.now += tokens / self.rate * self.slow
        self.slow = 1.0
        return self._forward(pools, chunks)


def _prompts(n: int, base: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"r{base}-{i}", tuple((base + 7 * i + k) % 97 + 1 for k in range(96)), 2)
        for i in range(n)
    ]


def test_the_measured_rate_converges_ignores_a_slow_step_and_follows_a_change(tmp_path):
    ctl = LocalController(ControllerConfig(host_pool_bytes=8 << 20, disk_path=None))
    sched = SchedulerConfig(prefill_chunk_tokens=48, max_prefill_tokens_per_step=128)
    engine = Engine("full+mamba", 16, controller=ctl, sched=sched)
    clock = Timed(engine.model, RATE)
    meter = engine.scheduler.prefill_meter
    meter.clock, meter.min_tokens = (lambda: clock.now), 48
    engine.serve(_prompts(2, 0))
    steps = engine.scheduler.stats.steps
    assert 2 <= meter.observed < steps  # the prefilling steps, not the decodes
    assert ctl.cost_rule.rate("local") == pytest.approx(RATE, rel=1e-9)
    assert ctl.stats()["cost_rule"]["prefill_tokens_per_s"] == {"local": round(RATE)}
    clock.slow = 100.0  # one step a hundred times slower
    engine.serve(_prompts(1, 200))
    assert ctl.cost_rule.rate("local") == pytest.approx(RATE, rel=1e-9)
    clock.rate = RATE / 2  # the model slows down for good
    before = meter.observed
    for base in range(400, 1000, 100):  # until the new rate is half the window
        if meter.observed - before > 9 // 2:
            break
        engine.serve(_prompts(1, base))
    assert ctl.cost_rule.rate("local") == pytest.approx(RATE / 2, rel=1e-9)
    engine.settle()
    engine.close()
