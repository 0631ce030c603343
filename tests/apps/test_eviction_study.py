"""The eviction study's simulator agrees with the offline bounds it is compared to."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from hicache.apps.replay_bounds import infinite_hits, optimal_hits

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import eviction_study as study


def _random_chains(seed: int, n: int = 300) -> list[list[int]]:
    """Chains of a random prefix forest: each request extends a random earlier chain's
    prefix or starts a new root, so equal ids always have equal parents."""
    rng = random.Random(seed)
    chains: list[list[int]] = []
    next_id = 0
    for _ in range(n):
        if chains and rng.random() < 0.7:
            base = rng.choice(chains)
            keep = base[: rng.randint(1, len(base))]
        else:
            keep = []
        extra = rng.randint(0 if keep else 1, 6)
        chains.append(keep + list(range(next_id, next_id + extra)))
        next_id += extra
    return chains


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unbounded_capacity_hits_the_infinite_cache_figure(seed):
    chains = _random_chains(seed)
    arrays = [np.asarray(c, dtype=np.int64) for c in chains]
    for ranker in (study.LRU(), study.Rule()):
        got = study.simulate(chains, 10**9, ranker, study.CLASSES["uses"])
        assert got == infinite_hits(arrays)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_ranker_stays_under_the_optimum(seed):
    chains = _random_chains(seed)
    arrays = [np.asarray(c, dtype=np.int64) for c in chains]
    capacity = max(len(c) for c in chains) + 5
    best = optimal_hits(arrays, capacity)
    classify = study.CLASSES["uses+gap"]
    fitted = study.fitted_table(chains, classify, horizon=20)
    rankers = [study.LRU(), study.Rule(), study.Table(fitted), study.Online(20, refresh=10)]
    got = [study.simulate(chains, capacity, r, classify) for r in rankers]
    assert all(0 < g <= best for g in got), (got, best)
    assert got[0] < infinite_hits(arrays)  # the capacity binds


def test_fitted_table_counts_known_outcomes():
    """Closed intervals of gaps 1, 1 and 10 and one still open: from age 0 with a horizon
    of 2, the two short intervals are uses within the horizon, the long one and the open
    one are not (the prior adds 0.2 over 1)."""
    starts = np.array([0, 1, 2])
    gaps = np.array([1, 1, 10])
    row = study.table_from_intervals(starts, gaps, np.array([12]), now=100, horizon=2, min_alive=1)
    assert row[0] == pytest.approx((2 + 0.2) / (4 + 1.0))


def test_output_class_comes_from_the_request_that_first_cached_the_block():
    """Blocks first cached by a short-output request are used again, those of a
    long-output one never: the fitted ``uses+output`` table ranks unused blocks of the two
    classes apart, and a ranker by it keeps the reused class (LRU keeps neither)."""
    chains, outputs = [], []
    for i in range(60):
        chains.append([1000 + i, 2000 + i])  # long output, never used again
        outputs.append(500)
        chains.append([i % 3, 10 + i % 3])  # short output: three chains used over and over
        outputs.append(4)
    classify = study.CLASSES["uses+output"]
    table = study.fitted_table(chains, classify, horizon=10, outputs=outputs)
    short, long = table[(0, study.age_bucket(4))], table[(0, study.age_bucket(500))]
    assert short[0] > 0.5 > long[0]
    hits = study.simulate(chains, 6, study.Table(table), classify, outputs=outputs)
    lru = study.simulate(chains, 6, study.LRU(), classify, outputs=outputs)
    assert hits > lru
    # Without the outputs every block is in one class: the table cannot tell them apart.
    flat = study.fitted_table(chains, classify, horizon=10)
    assert set(flat) == {(u, 0) for u in {k[0] for k in flat}}
