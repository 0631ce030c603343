"""What the vLLM scheduler's lookups make of the sidecar's answers
(vllm_manager.HiCacheOffloadingManager._presence / _settle): every TP rank's page counts,
the slowest rank's tier is the key's; a page only on the remote tier is a hit like a disk
page, never an error in vLLM's scheduler; and with ``read_ahead`` the pages of the leading
hit that are off host start coming to host (every rank's, none past the first miss)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

from hicache import P_ABSENT, P_DISK, P_HOST, P_REMOTE, ComponentType, PageKey
from hicache.controller_api import LookupResult as SidecarLookup
from hicache.integrations.vllm_config import HiCacheVllmConfig
from hicache.integrations.vllm_manager import HiCacheOffloadingManager, _RequestLookups

FULL = ComponentType.FULL
KEYS = [b"k0", b"k1", b"k2", b"k3", b"k4"]


class FakeSidecar:
    """Answers lookups from ``tiers`` (hash -> tier) and records prefetches."""

    def __init__(self, tiers: dict[bytes, int]) -> None:
        self.tiers = tiers
        self.prefetched: list[PageKey] = []

    def lookup(self, hashes, components, tenant=None):
        rows = np.array([self.tiers.get(h, P_ABSENT) for h in hashes], dtype=np.int8)
        return SidecarLookup({FULL: rows})

    def prefetch(self, keys):
        self.prefetched.extend(keys)


def _manager(tiers: dict[bytes, int], ranks: int, read_ahead: bool):
    m = HiCacheOffloadingManager.__new__(HiCacheOffloadingManager)  # no sidecar to attach
    m.namespace = SimpleNamespace(page_hash=lambda key, rank: key + b"@%d" % rank)
    m.config = dataclasses.replace(HiCacheVllmConfig(), read_ahead=read_ahead)
    m.counters = Counter()
    m._ranks = range(ranks)
    m.client = FakeSidecar(tiers)
    return m


def _tiers_of(m, keys) -> list[int]:
    state = _RequestLookups(pending_keys=list(keys), deadline=float("inf"))
    fut: Future = Future()
    fut.set_result(m._presence(list(keys), None))
    state.pending = fut
    m._settle(state)
    return [state.answers[k] for k in keys]


@pytest.mark.parametrize("read_ahead", [True, False])
def test_the_slowest_rank_sets_the_tier_and_off_host_pages_of_the_lead_are_read_ahead(
    read_ahead,
):
    # rank 0: k0 host, k1 disk, k2 host, k3 host, k4 disk; rank 1: k0 remote, k1 host,
    # k2 host, k3 absent, k4 disk
    tiers = {b"k0@0": P_HOST, b"k1@0": P_DISK, b"k2@0": P_HOST, b"k3@0": P_HOST,
             b"k4@0": P_DISK, b"k0@1": P_REMOTE, b"k1@1": P_HOST, b"k2@1": P_HOST,
             b"k4@1": P_DISK}  # fmt: skip
    m = _manager(tiers, ranks=2, read_ahead=read_ahead)
    assert _tiers_of(m, KEYS) == [P_REMOTE, P_DISK, P_HOST, P_ABSENT, P_DISK]
    assert m.counters["lookup_remote"] == 1 and m.counters["lookup_miss"] == 1
    assert m.counters["lookup_disk"] == 2 and m.counters["lookup_host"] == 1
    want = {PageKey(FULL, b"k1@0"), PageKey(FULL, b"k0@1")}  # the lead ends at k3's miss
    assert set(m.client.prefetched) == (want if read_ahead else set())
    assert m.counters["read_ahead_pages"] == (2 if read_ahead else 0)


def test_a_lead_all_on_host_or_a_first_miss_reads_nothing_ahead():
    m = _manager({b"k0@0": P_HOST, b"k1@0": P_HOST}, ranks=1, read_ahead=True)
    assert _tiers_of(m, KEYS[:2]) == [P_HOST, P_HOST]
    m = _manager({b"k1@0": P_DISK}, ranks=1, read_ahead=True)
    assert _tiers_of(m, KEYS[:2]) == [P_ABSENT, P_DISK]
    assert m.client.prefetched == [] and m.counters["read_ahead_pages"] == 0


def test_a_read_ahead_that_fails_leaves_the_answers_as_they_were():
    m = _manager({b"k0@0": P_DISK, b"k1@0": P_HOST}, ranks=1, read_ahead=True)

    def broken(keys):
        raise RuntimeError("the sidecar went away mid-call")

    m.client.prefetch = broken
    assert _tiers_of(m, KEYS[:2]) == [P_DISK, P_HOST]  # still hits, not misses
    assert m.counters["read_ahead_failed"] == 1
