"""A device leaf eviction policy that follows, online, the better of LRU and the learned rule.

Neither rule wins everywhere: the learned rule (:mod:`hicache.learned_eviction`) evicts
never-reused leaves first, which pays where most blocks are dead and hot prefixes return
late, and loses where a prefix's next use is its first reuse (the next turn of a
conversation extends a tail nobody has used yet). This policy keeps both rules' state up
to date (every hook goes to both), evicts the victims of the one it follows, and decides
which to follow by measuring both: each rule runs in a miniature simulation
(:mod:`hicache.shadow_eviction`) fed a hash-sampled share of the units every request uses,
at the same share of the device's capacity, so each rule's hit ratio on the workload seen
now is counted, not inferred from the one cache that exists.

Only the sampled accesses where the two miniatures disagree (one hit, the other missed)
are evidence, and they come in clusters: a request's prefix hit ends at its first miss, so
all of one request's disagreements go to the miniature with the longer run of hits. Units
are not independent trials; requests are. So a request's net lead ``d`` (units the learned
miniature hit beyond LRU's, or the reverse) is one observation, and the sign test is
``z = sum(d) / sqrt(sum(d**2))``, both sums decayed over about the last
``decision_window_disagreements`` disagreeing units. Counting units as trials inflates
``z`` by about the square root of a cluster's size: over the whole shared trace at 5% of
distinct blocks it is 8.6 where the per-request statistic is 2.0; over its last quarter at
10%, 3.2 where it is 0.6 (109 requests disagreed), and there the unit-level test switched
to the learned rule on noise 8 times and lost 1.45 points to LRU (this one stays with LRU:
+0.00). The policy starts with LRU (the cheaper, safer rule while nothing is known),
switches to the learned rule when ``z >= to_learned_z`` and back when ``z <= -to_lru_z``,
and not before the decayed disagreements reach ``min_disagreements``: a cold cache or a
short burst is no evidence. The thresholds are asymmetric because the costs are: a wrong
switch to the learned rule costs up to 11 points (conversations), a wrong switch to LRU a
share of a gain.

Chains are still cut from the tail: both rules only ever name evictable leaves. Cost,
to stay within half of LRU's: while LRU is followed the learned rule is never asked for a
victim (its per-hook upkeep is O(1)); a victim gives all that is asked of it; new nodes are
not cut where evicted pieces ended (cuts fragment the tree); the miniatures see
``shadow_units`` units whatever the device's size, so the sample rate falls as the device
grows, and a node's sampled units are hashed once, not at each hit. That size is also the
evidence's: at 512 units a device of 20% of a trace's blocks is sampled at 0.06, a few
hundred disagreements span half the trace, and the test follows a phase only after it has
ended (held-out variants of the shared trace lost 0.34 and 0.41 points to LRU that way);
at 1024 none of the held-out traces did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xxhash import xxh3_64_intdigest as xxh3

from hicache.eviction import LeafEvictionPolicy, LRULeafPolicy
from hicache.keys import TOKEN_BYTES
from hicache.learned_eviction import LearnedLeafPolicy, LearnedPolicyParams
from hicache.shadow_eviction import ShadowLearned, ShadowLRU

if TYPE_CHECKING:
    from hicache.tree import TreeNode

LRU, LEARNED = 0, 1
RULE_NAMES = ("lru", "learned")
_FP_SAMPLE_BITS = 32  # the low bits of a unit's fingerprint that decide its sampling
_FP_SAMPLE_MASK = (1 << _FP_SAMPLE_BITS) - 1


@dataclass(frozen=True)
class AdaptivePolicyParams:
    """Tuning of :class:`AdaptiveLeafPolicy`; units in the names."""

    shadow_units: int = 1024  # capacity of each miniature (its sample rate follows; 512: too thin)
    max_sample_rate: float = 1.0  # the miniatures are at most this share (0.5 lost cold quarters)
    unit_tokens: int = 512  # the miniatures' unit (rounded up to whole pages)
    shadow_use_classes: int = 8  # the learned miniature ranks exactly below this many uses
    decision_window_disagreements: int = 256  # horizon of the decayed evidence
    min_disagreements: float = 64.0  # none to the learned rule on fewer decayed disagreements
    min_disagreements_to_lru: float = 16.0  # none back to LRU on fewer
    to_learned_z: float = 3.0  # follow the learned rule when its sign test reaches this
    to_lru_z: float = 1.0  # go back to LRU when LRU's reaches this
    start_with_learned: bool = False
    evidence_growth_per_return: float = 2.0  # min_disagreements' factor per return to LRU

    def __post_init__(self) -> None:
        if min(self.shadow_units, self.unit_tokens, self.shadow_use_classes) < 1:
            raise ValueError("shadow_units, unit_tokens and shadow_use_classes must be >= 1")
        if self.decision_window_disagreements < 1 or not self.min_disagreements >= 0:
            raise ValueError("decision_window_disagreements >= 1, min_disagreements >= 0")
        if not 0 < self.max_sample_rate <= 1:
            raise ValueError("max_sample_rate must be within (0, 1]")
        if not (self.to_learned_z >= 0 and self.to_lru_z >= 0):
            raise ValueError("to_learned_z and to_lru_z must be >= 0")
        if not (self.min_disagreements_to_lru >= 0 and self.evidence_growth_per_return >= 1):
            raise ValueError("min_disagreements_to_lru >= 0, evidence_growth_per_return >= 1")


class AdaptiveLeafPolicy(LeafEvictionPolicy):
    """Follows whichever of LRU and the learned rule hits more in its miniature (see the
    module docstring). ``device_tokens``: the device's capacity, which the miniatures
    scale."""

    def __init__(
        self,
        device_tokens: int,
        sample_size: int = 64,
        seed: int = 0,
        params: AdaptivePolicyParams | None = None,
        learned_params: LearnedPolicyParams | None = None,
    ) -> None:
        if device_tokens < 1:
            raise ValueError(f"device_tokens must be >= 1, got {device_tokens}")
        self.params = params or AdaptivePolicyParams()
        self.device_tokens = device_tokens
        self.lru = LRULeafPolicy()
        self.learned = LearnedLeafPolicy(sample_size, seed, learned_params)
        self.following = LEARNED if self.params.start_with_learned else LRU
        self.picks = [0, 0]  # victims evicted while following each rule
        self.switches = 0
        self.shadow_hits = [0, 0]  # sampled accesses each miniature hit
        self.sampled_accesses = 0
        self._seed = seed
        self._wins = 0.0  # decayed: learned's miniature hit and LRU's missed, minus the reverse
        self._var = 0.0  # decayed sum of the squared net lead of each request
        self._disagreements = 0.0  # decayed count of those accesses
        self._lead = 0  # the request being served: the learned miniature's net lead so far
        self._decay = 1.0 - 1.0 / self.params.decision_window_disagreements
        self._broken = [False, False]  # the request being served missed in that miniature
        self.host_tier = False  # a load-back from a host tier was seen
        self._to_learned_evidence = self.params.min_disagreements
        self.attach(1)

    # -- introspection -------------------------------------------------------------------

    @property
    def following_name(self) -> str:
        """The rule whose victims go: "lru" or "learned"."""
        return RULE_NAMES[self.following]

    @property
    def sign_test(self) -> float:
        """The decayed evidence for the learned rule, in standard deviations (module
        docstring); 0 while the miniatures have not disagreed."""
        if not self._var:
            return 0.0
        return self._wins / math.sqrt(self._var)

    # -- the miniatures ------------------------------------------------------------------

    def attach(self, page_size: int) -> None:
        self.learned.attach(page_size)
        p = self.params
        self._unit_tokens = -(-p.unit_tokens // page_size) * page_size
        self._unit_bytes = self._unit_tokens * TOKEN_BYTES
        self._fp_bytes = min(self.learned.params.fingerprint_tokens, page_size) * TOKEN_BYTES
        device_units = max(1, self.device_tokens // self._unit_tokens)
        rate = min(p.max_sample_rate, p.shadow_units / device_units)
        self.sample_rate = rate
        self._threshold = 0 if self.host_tier else int(rate * (1 << _FP_SAMPLE_BITS))
        capacity = max(1, round(rate * device_units))
        history = max(1, round(rate * self.learned.params.history_entries))
        self.shadows = (
            ShadowLRU(capacity),
            ShadowLearned(capacity, history, p.shadow_use_classes, self.learned.params),
        )

    def _sampled_units(self, node: TreeNode) -> tuple[int, ...]:
        """The fingerprints of the sampled units that start in ``node``, in order; kept on
        its state while its tokens and the sample stay the same (a split or a cut tail
        shortens its key), so a node hit again costs no hashing."""
        st = node.policy_state
        key, threshold = node.key, self._threshold
        kept = st.sampled
        if kept is not None and kept[0] == len(key) and kept[1] == threshold:
            return kept[2]
        # A unit's id: its position and first tokens (as the learned rule's fingerprint).
        start, step, head, digest = node.start, self._unit_bytes, self._fp_bytes, xxh3
        units = tuple(
            fp
            for at in range(-start % self._unit_tokens * TOKEN_BYTES, len(key), step)
            if (fp := digest(key[at : at + head], seed=start + at // TOKEN_BYTES)) & _FP_SAMPLE_MASK
            < threshold
        )
        st.sampled = (len(key), threshold, units)
        return units

    def _accessed(self, node: TreeNode) -> None:
        """A request uses ``node``'s tokens: feed the sampled units that start in it to
        both miniatures, and weigh their disagreements."""
        broken = self._broken
        if node.start == 0:  # every request's accesses begin at the root
            if self._lead:  # the previous request's lead is one observation
                self._weigh(self._lead)
                self._lead = 0
            broken[LRU] = broken[LEARNED] = False
        if not self._threshold:
            return
        units = self._sampled_units(node)
        if not units:
            return
        # Each miniature hits the units before its first miss (the request's prefix ends
        # there, in it) and none once an earlier node missed: where they disagree, the one
        # with the longer run of hits won every unit between the two ends.
        now = self.learned._now
        by_lru, by_learned = self.shadows
        n = len(units)
        leads = [by_lru.access_run(units, now), by_learned.access_run(units, now)]
        for rule in (LRU, LEARNED):
            if broken[rule]:
                leads[rule] = 0
            elif leads[rule] < n:
                broken[rule] = True
            self.shadow_hits[rule] += leads[rule]
        self.sampled_accesses += n
        by_lru.trim(now)
        by_learned.trim(now)
        self._lead += leads[LEARNED] - leads[LRU]

    def _weigh(self, lead: int) -> None:
        """A request ended where one miniature hit ``abs(lead)`` units more than the other
        (``lead > 0``: the learned one): update the evidence, maybe switch."""
        decay = self._decay ** abs(lead)
        self._wins = self._wins * decay + lead
        self._var = self._var * decay + lead * lead
        self._disagreements = self._disagreements * decay + abs(lead)
        p = self.params
        z = self.sign_test
        if self.following == LRU:
            if self._disagreements >= self._to_learned_evidence and z >= p.to_learned_z:
                self._switch(LEARNED)
        elif self._disagreements >= p.min_disagreements_to_lru and z <= -p.to_lru_z:
            # The learned rule was tried and lost: ask more evidence of it next time.
            self._to_learned_evidence = min(
                self._to_learned_evidence * p.evidence_growth_per_return,
                p.decision_window_disagreements / 2,
            )
            self._switch(LRU)

    def _switch(self, rule: int) -> None:
        """Follow ``rule``; the evidence starts anew (what it says from now on is about the
        cache that rule shapes)."""
        self.following = rule
        self.switches += 1
        self._wins = self._var = self._disagreements = 0.0

    # -- hooks from the tree -------------------------------------------------------------

    def add(self, node: TreeNode) -> None:
        st = node.policy_state
        if st is not None and st.evicted and not self.host_tier:  # back from the host tier
            self._below_is_a_host_tier()
        self.lru.add(node)
        self.learned.add(node)

    def _below_is_a_host_tier(self) -> None:
        """The miniatures count device hits only: with a host tier a device miss is often
        a host hit (a copy, not a recomputation), which they cannot see, and the rule
        they prefer can lose total hits (the learned rule did, with write-back). So from
        the first load-back on, LRU is followed and the miniatures stop."""
        self.host_tier = True
        self.following = LRU
        self._threshold = 0

    def remove(self, node: TreeNode) -> None:
        self.lru.remove(node)
        self.learned.remove(node)

    def touch(self, node: TreeNode) -> None:
        self.lru.touch(node)
        self.learned.touch(node)

    def on_insert(self, node: TreeNode) -> None:
        self.learned.on_insert(node)
        self._accessed(node)

    def on_hit(self, node: TreeNode) -> None:
        self.learned.on_hit(node)
        self._accessed(node)

    def on_split(self, node: TreeNode) -> None:
        self.learned.on_split(node)

    def on_evict(self, node: TreeNode) -> None:
        self.learned.on_evict(node)

    def members(self) -> set[int]:
        lru, learned = self.lru.members(), self.learned.members()
        if lru != learned:
            raise AssertionError("adaptive policy: its two rules disagree on the members")
        return lru

    # -- eviction ------------------------------------------------------------------------

    def pop(self) -> TreeNode | None:
        if self.following == LRU:
            victim = self.lru.peek()
        else:
            victim = self.learned.propose()
        if victim is None:
            return None
        self.picks[self.following] += 1
        self.lru.remove(victim)
        self.learned.remove(victim)
        return victim
