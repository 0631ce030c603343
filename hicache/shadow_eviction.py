"""Miniature simulations of the device leaf rules, on a hash-sampled share of the cache.

To know which of two eviction rules would hit more on the workload the cache sees now,
run each on a miniature of it: the units (runs of ``unit_tokens`` at a fixed position,
identified by a fingerprint of their first tokens and that position) whose fingerprint
falls below a threshold form a sample of rate ``R`` of every unit the cache sees, and a
cache of ``R`` times the device's capacity, fed only the sampled units, has about the hit
ratio of the whole cache under the same rule (spatial sampling: a unit is in or out of the
sample whatever request uses it, so its reuse pattern is kept whole). Each rule gets its
own miniature, the same accesses, and its hits are its measured hit ratio, not a guess
from the one cache that exists.

A miniature knows requests only by where they start: an access at position 0 begins a
new request, and after a request's first sampled miss its later units count as misses
(they would be past the end of its cached prefix) though they are cached, as the request
caches them.

Each rule here is its tree version reduced to units: :class:`ShadowLRU` evicts the least
recently used unit; :class:`ShadowLearned` the lowest estimated reuse rate
``(uses + prior_uses) / (age + prior_ticks)`` of a random sample (the formula and
parameters of :mod:`hicache.learned_eviction`, its history of evicted units included).
Costs: O(1) per sampled access for LRU, O(sample) per sampled miss for the learned rule;
units out of the sample cost one fingerprint each.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from hicache.learned_eviction import LearnedPolicyParams


class ShadowLRU:
    """A cache of ``capacity_units`` units, least recently used out first."""

    def __init__(self, capacity_units: int) -> None:
        if capacity_units < 1:
            raise ValueError(f"capacity_units must be >= 1, got {capacity_units}")
        self.capacity_units = capacity_units
        self.evictions = 0
        self._units: OrderedDict[int, None] = OrderedDict()

    def access(self, unit: int, now: int) -> bool:
        """Use ``unit`` at tick ``now``; True when it was cached. It is cached after."""
        units = self._units
        if unit in units:
            units.move_to_end(unit)
            return True
        units[unit] = None
        if len(units) > self.capacity_units:
            units.popitem(last=False)
            self.evictions += 1
        return False

    def __len__(self) -> int:
        return len(self._units)


class ShadowLearned:
    """A cache of ``capacity_units`` units under the learned rule (module docstring)."""

    def __init__(
        self,
        capacity_units: int,
        history_units: int,
        sample_size: int,
        evict_batch: int,
        seed: int,
        params: LearnedPolicyParams,
    ) -> None:
        if min(capacity_units, history_units, sample_size, evict_batch) < 1:
            raise ValueError("capacity, history, sample size and batch must be >= 1")
        self.capacity_units = capacity_units
        self.evictions = 0
        self._history_units = history_units
        self._sample_size = sample_size
        self._evict_batch = evict_batch
        self._params = params
        self._rng = random.Random(seed)
        self._state: dict[int, list[int]] = {}  # unit -> [uses, stamp, slot in _members]
        self._members: list[int] = []
        self._history: OrderedDict[int, int] = OrderedDict()  # evicted unit -> its uses
        self._turnover_ticks = 0.0

    def access(self, unit: int, now: int) -> bool:
        """Use ``unit`` at tick ``now``; True when it was cached. It is cached after."""
        st = self._state.get(unit)
        if st is not None:
            st[0] += 1
            st[1] = now
            return True
        uses = self._history.pop(unit, -1) + 1  # a return counts as a use, as in the tree
        self._state[unit] = [uses, now, len(self._members)]
        self._members.append(unit)
        if len(self._members) > self.capacity_units:
            self._evict(now)
        return False

    def _prior_ticks(self) -> float:
        if not self.evictions:
            return self._params.initial_prior_ticks
        return max(1.0, self._params.prior_turnovers * self._turnover_ticks)

    def _evict(self, now: int) -> None:
        """Evict the ``evict_batch`` lowest-ranked units of one random sample (ranking
        once for several victims is what keeps the miniature cheap)."""
        members, state = self._members, self._state
        k = self._sample_size
        pool = members if len(members) <= k else self._rng.choices(members, k=k)
        prior, prior_uses = self._prior_ticks(), self._params.prior_uses
        ranked = []
        for unit in set(pool):
            uses, stamp, _ = state[unit]
            if stamp != now:  # the request being served uses it: the tree has it locked
                ranked.append(((uses + prior_uses) / (now - stamp + prior), stamp, unit))
        if not ranked:
            ranked = [(0.0, 0, pool[0])]
        ranked.sort()
        history = self._history
        window = self._params.turnover_window_evictions
        for _, stamp, victim in ranked[: self._evict_batch]:
            uses, stamp, slot = state.pop(victim)
            last = members.pop()
            if last != victim:
                members[slot] = last
                state[last][2] = slot
            history[victim] = uses
            if len(history) > self._history_units:
                history.popitem(last=False)
            self.evictions += 1
            weight = 1.0 / min(self.evictions, window)
            self._turnover_ticks += weight * (now - stamp - self._turnover_ticks)

    def __len__(self) -> int:
        return len(self._members)
