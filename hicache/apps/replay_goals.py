"""The goals a device eviction policy must meet against LRU to be the default, as checks.

A policy may take LRU's place as the default only if, on a workload, it loses no more than
``DEVICE_SLACK_POINTS`` of device hit ratio to LRU at any capacity, gets at least LRU's
total hits with a 5 % device and a 20 % host tier (write-back), loses no more than
``COLD_SLACK_POINTS`` on any quarter of the trace replayed from an empty cache, and runs
at least ``MIN_RATE_OF_LRU`` of LRU's requests per second through the cache (docs/
performance.md, "Which policy to pick"). ``benchmarks/replay_families.py`` prints these
misses for every family; ``tests/core/test_adaptive_eviction.py`` asserts them on three.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from hicache.apps.replay import ReplaySettings, TraceRequest, replay, unique_blocks
from hicache.config import EvictionPolicyKind, WritePolicy

DEVICE_SLACK_POINTS = 0.3
COLD_SLACK_POINTS = 0.5
MIN_RATE_OF_LRU = 0.5
GOAL_DEVICE_PERCENTS = (1.0, 2.0, 5.0, 10.0, 20.0)
GOAL_HOST_CASE_PERCENTS = (5.0, 20.0)  # device, host: the two-tier case of the goals


class ReplayCell(Protocol):
    """What a goal reads of one replay (a ``BenchRow`` or a :class:`GoalCell`)."""

    device_spec: str
    policy: str
    device_hit: float
    total_hit: float
    requests_per_s: float


@dataclass(frozen=True)
class GoalCell:
    """One replay reduced to what the goals read; ratios are fractions of input blocks."""

    device_spec: str
    policy: str
    device_hit: float
    total_hit: float
    requests_per_s: float


def quarters(trace: Sequence[TraceRequest]) -> list[Sequence[TraceRequest]]:
    """The trace cut into four runs of requests (the last takes the remainder)."""
    q = len(trace) // 4
    return [trace[k * q : (k + 1) * q if k < 3 else len(trace)] for k in range(4)]


def cell_misses(
    part: str, cell: ReplayCell, lru: ReplayCell, with_host: bool, check_rate: bool = True
) -> list[str]:
    """The goals ``cell`` misses against ``lru``, the LRU replay of the same capacities
    (``part`` "q1".."q4" for a cold quarter); empty when it meets them all."""
    where = f"{part} {cell.device_spec} {cell.policy}"
    misses = []
    delta = 100 * (cell.device_hit - lru.device_hit)
    slack = COLD_SLACK_POINTS if part.startswith("q") else DEVICE_SLACK_POINTS
    if with_host and cell.total_hit < lru.total_hit:
        ours, theirs = 100 * cell.total_hit, 100 * lru.total_hit
        misses.append(f"{where}: total {ours:.2f}% < LRU {theirs:.2f}%")
    elif not with_host and delta < -slack:
        misses.append(f"{where}: {delta:+.2f} points against LRU")
    rate = cell.requests_per_s / lru.requests_per_s if lru.requests_per_s else 0.0
    if check_rate and rate < MIN_RATE_OF_LRU:
        misses.append(f"{where}: {rate:.2f}x LRU's requests/s")
    return misses


def _cell(
    trace: Sequence[TraceRequest], policy: EvictionPolicyKind, device_pct: float, host_pct: float
) -> GoalCell | None:
    unique = unique_blocks(trace)
    device = round(unique * device_pct / 100)
    if device < max(len(r.hash_ids) for r in trace):
        return None  # the capacity cannot hold the longest request: not a cell
    settings = ReplaySettings(
        device_blocks=device,
        host_blocks=round(unique * host_pct / 100),
        policy=policy,
        write_policy=WritePolicy.WRITE_BACK,
    )
    result = replay(trace, settings)
    return GoalCell(
        f"{device_pct:g}%",
        policy.value,
        result.device_hit_ratio,
        result.total_hit_ratio,
        result.requests_per_s,
    )


def goal_misses(
    trace: Sequence[TraceRequest],
    policy: EvictionPolicyKind,
    device_percents: Sequence[float] = GOAL_DEVICE_PERCENTS,
    check_rate: bool = True,
) -> list[str]:
    """Replay ``trace`` with ``policy`` and with LRU, cell by cell (every device capacity,
    the two-tier case, every cold quarter), and return the goals ``policy`` misses."""
    misses: list[str] = []

    def compare(part: str, part_trace: Sequence[TraceRequest], dev: float, host: float) -> None:
        lru = _cell(part_trace, EvictionPolicyKind.LRU, dev, host)
        if lru is None:
            return
        cell = _cell(part_trace, policy, dev, host)
        assert cell is not None
        misses.extend(cell_misses(part, cell, lru, host > 0, check_rate))

    for dev in device_percents:
        compare("whole", trace, dev, 0.0)
    compare("whole", trace, *GOAL_HOST_CASE_PERCENTS)
    for k, part in enumerate(quarters(trace)):
        for dev in device_percents:
            compare(f"q{k + 1}", part, dev, 0.0)
    return misses
