"""PrefixCachedLM measures the model's prefill rate on each prompt's computed suffix and
the sidecar's cost rule gets it with the engine's next lookup; a rate the engine reports
itself wins over the measured one. Time is injected: the model's forward advances a fake
clock by its tokens over a set rate (nothing here reads a real clock)."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("transformers")

from hicache.controller.client.sidecar_client import SidecarController
from tests.integrations.test_transformers_exact import (
    FAST,
    ThreadSidecar,
    build,
    model_of,
    tokens,
)
from tests.support.sidecar import short_tmpdir

RATE = 2500.0  # tokens per second the fake clock gives the model


class Timed:
    """``lm.forward`` taking ``tokens / rate`` seconds of a fake clock, ``slow`` times
    that for the next prefill chunk only."""

    def __init__(self, lm, rate: float) -> None:
        self.now, self.rate, self.slow = 0.0, rate, 1.0
        self._forward = lm.forward
        lm.forward = self
        lm.prefill_meter.clock = lambda: self.now

    def __call__(self, ids, hf_cache):
        self.now += ids.numel() / self.rate * self.slow
        self.slow = 1.0
        return self._forward(ids, hf_cache)


def test_the_rate_measured_on_prefills_reaches_the_sidecar_and_a_reported_one_wins():
    workdir = short_tmpdir()
    sidecar = ThreadSidecar(workdir).start()
    client = SidecarController(sidecar.endpoint, "hf-rate", FAST)
    lm = build(model_of("llama"), client, shared_memory=True)
    try:
        clock = Timed(lm, RATE)
        meter = lm.prefill_meter
        meter.min_tokens = 24
        lm.generate(tokens(1, 12), 2)  # too short to count
        assert meter.rate is None and client.measured_prefill_rate is None
        lm.generate(tokens(2, 40), 2)
        assert meter.rate == pytest.approx(RATE, rel=1e-9)
        assert client.measured_prefill_rate == meter.rate
        clock.slow = 50.0  # one prefill slowed by something else
        lm.generate(tokens(3, 40), 2)
        lm.generate(tokens(4, 40), 2)
        assert meter.rate == pytest.approx(RATE, rel=1e-9)
        lm.generate(tokens(6, 40), 2)  # its lookup carries the rate to the sidecar
        rule = sidecar.controller.cost_rule
        assert rule.rate("hf-rate") == pytest.approx(RATE, rel=1e-9)
        client.prefill_rate = 77.0  # the engine's own figure
        lm.generate(tokens(5, 40), 2)
        assert rule.rate("hf-rate") == 77.0
        lm.cache.check_invariants()
    finally:
        client.close()
        lm.cache.pools.close()
        sidecar.stop()
        shutil.rmtree(workdir, ignore_errors=True)
