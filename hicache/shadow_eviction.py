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
``(uses + prior_uses) / (age + prior_ticks)`` (the formula and parameters of
:mod:`hicache.learned_eviction`, its history of evicted units included). Costs: O(1) per
sampled access for LRU, O(use classes) per sampled miss for the learned rule; units out of
the sample cost one fingerprint each.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hicache.learned_eviction import LearnedPolicyParams

_LOCKED = 1e300  # the rate ``trim`` gives a use list whose head is the request being served
_EMPTY = float("inf")  # and an empty one


class ShadowLRU:
    """A cache of ``capacity_units`` units, least recently used out first."""

    def __init__(self, capacity_units: int) -> None:
        if capacity_units < 1:
            raise ValueError(f"capacity_units must be >= 1, got {capacity_units}")
        self.capacity_units = capacity_units
        self.evictions = 0
        self.units: OrderedDict[int, None] = OrderedDict()  # least recent first

    def access_run(self, units: Sequence[int], now: int) -> int:
        """Use ``units`` (one node's sampled units, in order) at tick ``now``; returns how
        many of them, from the first, were cached. All are cached after, and the cache
        may hold more than its capacity until the next :meth:`trim`."""
        cached = self.units
        move = cached.move_to_end
        lead = -1
        for i, unit in enumerate(units):
            if unit in cached:
                move(unit)
            else:
                cached[unit] = None
                if lead < 0:
                    lead = i
        return len(units) if lead < 0 else lead

    def trim(self, now: int) -> None:
        """Evict down to the capacity (at the end of each node's accesses: the units of
        one request never evict each other, as in the tree)."""
        units = self.units
        excess = len(units) - self.capacity_units
        if excess > 0:
            self.evictions += excess
            for _ in range(excess):
                units.popitem(last=False)

    def __len__(self) -> int:
        return len(self.units)


class ShadowLearned:
    """A cache of ``capacity_units`` units under the learned rule (module docstring).

    Among units with the same uses, the lowest rate is the oldest: the units are kept in
    one recency list per use count (counts from ``use_classes - 1`` up share the last
    list, each unit with its last use), and a victim is the lowest-rate head of those
    lists, an exact minimum over every unit where the tree's rule ranks a random sample,
    at O(use_classes) per eviction."""

    def __init__(
        self,
        capacity_units: int,
        history_units: int,
        use_classes: int,
        params: LearnedPolicyParams,
    ) -> None:
        if min(capacity_units, history_units, use_classes) < 1:
            raise ValueError("capacity_units, history_units and use_classes must be >= 1")
        self.capacity_units = capacity_units
        self.evictions = 0
        self._history_units = history_units
        self._top_class = use_classes - 1
        self._params = params
        self._uses: dict[int, int] = {}  # cached unit -> its uses
        # by use count: unit -> the tick of its last use, least recent first
        self._by_uses: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(use_classes)]
        self._history: OrderedDict[int, int] = OrderedDict()  # evicted unit -> its uses
        self._turnover_ticks = 0.0

    def access_run(self, units: Sequence[int], now: int) -> int:
        """Use ``units`` (one node's sampled units, in order) at tick ``now``; returns how
        many of them, from the first, were cached. All are cached after (the capacity is
        restored at the next :meth:`trim`)."""
        top, by_uses, cached, history = self._top_class, self._by_uses, self._uses, self._history
        lead = -1
        for i, unit in enumerate(units):
            uses = cached.get(unit)
            if uses is not None:
                cached[unit] = uses + 1
                if uses < top:
                    del by_uses[uses][unit]
                    by_uses[uses + 1][unit] = now
                else:  # already in the last list: to its end
                    last = by_uses[top]
                    del last[unit]
                    last[unit] = now
                continue
            if lead < 0:
                lead = i
            uses = history.pop(unit, -1) + 1  # a return counts as a use, as in the tree
            cached[unit] = uses
            by_uses[uses if uses < top else top][unit] = now
        return len(units) if lead < 0 else lead

    def _prior_ticks(self) -> float:
        if not self.evictions:
            return self._params.initial_prior_ticks
        return max(1.0, self._params.prior_turnovers * self._turnover_ticks)

    def trim(self, now: int) -> None:
        """Evict down to the capacity, each victim the lowest-rate head of the use lists
        (at the end of each node's accesses). The prior is the one of the trim's start,
        and a list whose head was used at ``now`` (the request being served: locked in the
        tree) gives nothing unless every list is such. The heads' rates rise along each
        list, so victims come from one list while its head stays below every other head
        (the lowest list first among equal rates). (One loop of locals: at a small device
        this runs once per miss of every request.)"""
        cached = self._uses
        excess = len(cached) - self.capacity_units
        if excess <= 0:
            return
        prior, prior_uses = self._prior_ticks(), self._params.prior_uses
        lists, top = self._by_uses, self._top_class
        history, window = self._history, self._params.turnover_window_evictions
        evictions, turnover = self.evictions, self._turnover_ticks
        rates = []
        for k, units in enumerate(lists):
            rate = _EMPTY
            if units:
                unit, stamp = next(iter(units.items()))
                rate = (
                    _LOCKED
                    if stamp == now
                    else ((k if k < top else cached[unit]) + prior_uses) / (now - stamp + prior)
                )
            rates.append(rate)
        while excess:
            best = min(rates)
            i = rates.index(best)
            if best == _LOCKED:  # every unit is the current request's: the oldest goes
                i = next(k for k, units in enumerate(lists) if units)
            rates[i] = _EMPTY
            limit = min(rates)  # the others: list i gives while its head is below
            j = rates.index(limit)
            units = lists[i]
            pop = units.popitem
            while True:
                victim, stamp = pop(last=False)
                history[victim] = cached.pop(victim)
                evictions += 1
                turnover += (now - stamp - turnover) / (evictions if evictions < window else window)
                excess -= 1
                if not units:
                    break
                unit, stamp = next(iter(units.items()))
                rate = (
                    _LOCKED
                    if stamp == now
                    else ((i if i < top else cached[unit]) + prior_uses) / (now - stamp + prior)
                )
                if not excess or rate > limit or (rate == limit and j < i):
                    rates[i] = rate
                    break
        for _ in range(len(history) - self._history_units):
            history.popitem(last=False)
        self.evictions, self._turnover_ticks = evictions, turnover

    def __len__(self) -> int:
        return len(self._uses)
