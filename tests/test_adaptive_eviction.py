"""The adaptive leaf policy: it follows the learned rule where that wins and LRU where the
learned rule loses, on small traces of three workload families; its charges; invariants."""

from __future__ import annotations

from functools import cache

import pytest

from hicache.adaptive_eviction import AdaptiveLeafPolicy, AdaptivePolicyParams
from hicache.apps.replay import ReplaySettings, TraceReplayer, TraceRequest, replay, unique_blocks
from hicache.apps.workloads import (
    AgentFamily,
    ChatFamily,
    RagFamily,
    agent_workload,
    chat_workload,
    rag_workload,
)
from hicache.config import EvictionPolicyKind

LRU, LEARNED, ADAPTIVE = (
    EvictionPolicyKind.LRU,
    EvictionPolicyKind.LEARNED,
    EvictionPolicyKind.ADAPTIVE,
)
SLACK = 0.003  # the adaptive policy may lose this much device hit ratio to LRU


def as_trace(rows: list[dict]) -> list[TraceRequest]:
    rows = sorted(rows, key=lambda r: r["timestamp"])
    return [
        TraceRequest(
            float(r["timestamp"]), r["input_length"], r["output_length"], tuple(r["hash_ids"])
        )
        for r in rows
    ]


@cache
def family(name: str) -> list[TraceRequest]:
    """Small traces of three families (a few seconds to replay each)."""
    if name == "agent":
        return as_trace(agent_workload(AgentFamily(sessions=120, duration_s=400), 0))
    if name == "chat":
        rows = chat_workload(ChatFamily(conversations=900, system_prompts=300, duration_s=400), 0)
        return as_trace(rows)
    return as_trace(rag_workload(RagFamily(requests=1500, documents=1500, duration_s=400), 0))


@cache
def hit_ratio(name: str, percent: int, kind: EvictionPolicyKind) -> float:
    trace = family(name)
    capacity = round(unique_blocks(trace) * percent / 100)
    return replay(trace, ReplaySettings(capacity, policy=kind)).device_hit_ratio


def test_where_the_learned_rule_loses_to_lru_the_adaptive_policy_does_not():
    # Agent sessions at 10 %: the learned rule keeps used tool prefixes and evicts the
    # sessions' fresh steps, which their next step needs.
    lru, learned = hit_ratio("agent", 10, LRU), hit_ratio("agent", 10, LEARNED)
    assert learned < lru - 0.02
    assert hit_ratio("agent", 10, ADAPTIVE) >= lru - SLACK


@pytest.mark.parametrize(("name", "percent"), [("agent", 3), ("rag", 5)])
def test_where_the_learned_rule_wins_the_adaptive_policy_takes_a_share_of_the_gain(name, percent):
    lru, learned = hit_ratio(name, percent, LRU), hit_ratio(name, percent, LEARNED)
    assert learned > lru + 0.04
    # Starting from LRU and switching only on evidence costs part of the gain.
    assert hit_ratio(name, percent, ADAPTIVE) > lru + 0.4 * (learned - lru)


def test_on_conversations_the_adaptive_policy_stays_within_the_slack_of_lru():
    assert hit_ratio("chat", 5, ADAPTIVE) >= hit_ratio("chat", 5, LRU) - SLACK


def test_the_charges_pick_the_rule_and_the_replay_keeps_the_invariants():
    trace = family("agent")
    capacity = round(unique_blocks(trace) * 0.10)
    replayer = TraceReplayer(
        trace, ReplaySettings(capacity, policy=ADAPTIVE, check_invariants_every=97)
    )
    try:
        replayer.run()
        replayer.check()
        policy = replayer.cache.tree.leaf_policy
        assert isinstance(policy, AdaptiveLeafPolicy)
        # It ends following LRU, the rule charged less, after trying the learned one.
        assert policy.following_name == "lru"
        assert policy.charges[0] < policy.charges[1]
        assert policy.picks[0] > 0 and policy.picks[1] > 0
        assert policy.members() == policy.learned.members()
    finally:
        replayer.close()


def test_bad_parameters_are_refused():
    for bad in (
        {"ghost_turnovers": 0},
        {"charge_window_events": 0},
        {"to_lru_margin": 1.0},
        {"lru_dispute_every_picks": 0},
    ):
        with pytest.raises(ValueError):
            AdaptivePolicyParams(**bad)
