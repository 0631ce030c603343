"""The prefill rate measured from an engine's own prefills (hicache/prefill_rate.py): short
prefills are ignored, one slow prefill does not move the rate, a lasting change takes
over within half the window, overlapping engine steps are timed without their overlap,
and the rate reaches a controller as a measured one (a reported rate stays in force).
Time is injected: nothing here reads a real clock."""

from __future__ import annotations

import pytest

from hicache import PrefillMeter, StepTimer
from hicache.controller.config import ControllerConfig
from hicache.controller.store.local import LocalController


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_short_prefills_are_ignored_and_an_outlier_does_not_move_the_rate():
    meter = PrefillMeter(min_tokens=64, window=5)
    assert meter.rate is None
    assert meter.observe(63, 0.001) is None and meter.observe(512, 0.0) is None
    assert meter.rate is None and meter.ignored == 2
    assert meter.observe(1000, 0.5) == 2000.0
    assert meter.observe(500, 0.25) == 2000.0
    assert meter.observe(1000, 50.0) == 2000.0  # one prefill 100x slower
    assert meter.observe(1000, 0.0001) == 2000.0  # and one timed too fast
    assert meter.rate == 2000.0


def test_a_lasting_change_of_rate_takes_over_within_half_the_window():
    meter = PrefillMeter(min_tokens=1, window=9)
    for _ in range(9):
        meter.observe(1000, 1.0)
    seen = [meter.observe(1000, 0.25) for _ in range(5)]  # four times faster from now on
    assert seen[:4] == [1000.0] * 4 and seen[4] == 4000.0


def test_overlapping_steps_are_timed_from_the_later_of_plan_and_previous_output():
    clock = Clock()
    timer = StepTimer(PrefillMeter(min_tokens=100, clock=clock))
    timer.planned(1000, 1000)  # step 1 planned at 100
    clock.now = 100.1
    timer.planned(1000, 1000)  # step 2 planned while step 1 runs
    clock.now = 100.5
    assert timer.finished() == 2000.0  # step 1: 0.5 s
    clock.now = 101.0
    assert timer.finished() == 2000.0  # step 2: from step 1's output, 0.5 s (not 0.9)
    timer.planned(64, 0)  # decodes only: not a prefill
    clock.now = 103.0
    assert timer.finished() is None
    assert timer.finished() is None  # nothing planned
    assert timer.meter.rate == 2000.0


@pytest.mark.parametrize("session", [False, True])
def test_a_measured_rate_reaches_the_controller_and_a_reported_one_stays(session):
    ctl = LocalController(ControllerConfig(host_pool_bytes=1 << 20, disk_path=None))
    engine = ctl.session("e1") if session else ctl
    name = "e1" if session else "local"
    meter = PrefillMeter(engine, min_tokens=1)
    meter.observe(300, 0.1)
    assert ctl.cost_rule.rate(name) == 3000.0
    engine.report_prefill_rate(50.0)  # the engine's own figure
    meter.observe(300, 0.01)
    assert ctl.cost_rule.rate(name) == 50.0
    engine.report_prefill_rate(None)
    assert ctl.cost_rule.rate(name) == meter.rate
    ctl.close()
