"""A device leaf eviction policy that follows, online, the better of LRU and the learned rule.

Neither rule wins everywhere: the learned rule (:mod:`hicache.learned_eviction`) evicts
never-reused leaves first, which pays where most blocks are dead and hot prefixes return
late, and loses where a prefix's next use is its first reuse (the next turn of a
conversation extends a tail nobody has used yet). This policy keeps both rules' state up
to date (every hook goes to both) and at a pick asks both for their victim. When they
name the same leaf, that leaf goes and nothing is learned. When they differ, the rule
being followed has its victim evicted, and the two choices are remembered in a ghost
list, each charged to the rule that made it:

* the evicted victim is charged to its rule if it is inserted (or loaded back) again:
  that rule caused a miss;
* the leaf the other rule named, which stayed, is charged to that rule if a match uses
  it: that rule would have caused a miss.

Each choice counts once, however many picks named it: the rule not followed names the
same leaf pick after pick (LRU its oldest leaf), but had it been followed that leaf would
have gone at the first pick and the next picks would have named others, whose fate is
unknown. Counting every pick charged the rule not followed many times per miss, and the
policy stuck to whichever rule it followed (on conversations, the learned rule, 11 points
below LRU, for more than half the trace).

A ghost entry lives for ``ghost_turnovers`` times the running mean age of LRU's
candidate at a pick: the time a leaf survives in this cache under LRU. That horizon does
not depend on the rule followed (the learned rule's own eviction age shrinks while it
evicts young leaves, which had hidden its misses from a horizon measured on it). Charges
decay by ``1 - 1/charge_window_events`` per charge, and the rule followed switches when
the other's decayed charge is lower by the margin of its direction, once the charges sum
to ``min_switch_charges``: it starts with LRU, the cheaper and safer rule while nothing is
known, and a few early charges (a cold cache, a short burst) are no evidence; a switch on
them cost up to 0.8 points on quarters of traces replayed from empty. A victim that comes
back by a load-back from the host tier cost a copy, not a recomputation, and is charged
``load_back_charge`` of a miss; charged in full, with a write-back host tier the policy
followed the learned rule into fewer total hits than LRU's.

Chains are still cut from the tail: both rules only ever name evictable leaves. Cost, to
stay within half of LRU's: a victim gives all that is asked of it (the learned rule's
own quantum-by-quantum picks, each with a tree split, cost it 3-8x LRU's rate), new nodes
are not cut where evicted pieces ended (the cuts fragment the tree: more nodes to walk
and to split), and while LRU is followed the learned rule is asked for its pick (a sample
of leaves ranked in Python) at one pick in ``lru_dispute_every_picks``. Per hook, the two
rules' own O(1)/O(log n) upkeep.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache.eviction import LeafEvictionPolicy, LRULeafPolicy
from hicache.learned_eviction import LearnedLeafPolicy, LearnedPolicyParams

if TYPE_CHECKING:
    from hicache.tree import TreeNode

LRU, LEARNED = 0, 1
RULE_NAMES = ("lru", "learned")
_EVICTED, _KEPT = 0, 1  # what happened to a ghost entry's leaf when it was remembered


@dataclass(frozen=True)
class AdaptivePolicyParams:
    """Tuning of :class:`AdaptiveLeafPolicy`; units in the names."""

    ghost_turnovers: float = 2.0  # a ghost entry's life, in mean ages of LRU's candidate
    ghost_min_ticks: float = 256.0  # its least life, while that age is not yet known
    # Charges forget at this horizon (in charges): short, so that a switch that was wrong is
    # undone within a few hundred of its misses.
    charge_window_events: int = 512
    # Asymmetric: a wrong switch to the learned rule costs up to 11 points (conversations),
    # a wrong switch to LRU a share of the learned rule's gain.
    to_lru_margin: float = 0.0  # follow LRU as soon as its charge is below the learned's
    to_learned_margin: float = 0.5  # follow the learned rule at half LRU's charge or less
    start_with_learned: bool = False
    min_switch_charges: float = 64.0  # no switch while the decayed charges sum to less
    load_back_charge: float = 0.1  # a victim back from the host tier, as a fraction of a miss
    lru_dispute_every_picks: int = 8  # while following LRU, ask the learned rule this often

    def __post_init__(self) -> None:
        if not self.ghost_turnovers > 0 or not self.ghost_min_ticks > 0:
            raise ValueError("ghost_turnovers and ghost_min_ticks must be > 0")
        if not self.min_switch_charges >= 0 or not 0 <= self.load_back_charge <= 1:
            raise ValueError("min_switch_charges must be >= 0, load_back_charge within [0, 1]")
        if self.charge_window_events < 1 or self.lru_dispute_every_picks < 1:
            raise ValueError("charge_window_events and lru_dispute_every_picks must be >= 1")
        if not (0 <= self.to_lru_margin < 1 and 0 <= self.to_learned_margin < 1):
            raise ValueError("to_lru_margin and to_learned_margin must be within [0, 1)")


class AdaptiveLeafPolicy(LeafEvictionPolicy):
    """Follows whichever of LRU and the learned rule the ghost lists charge less (see the
    module docstring)."""

    def __init__(
        self,
        sample_size: int = 64,
        seed: int = 0,
        params: AdaptivePolicyParams | None = None,
        learned_params: LearnedPolicyParams | None = None,
    ) -> None:
        self.params = params or AdaptivePolicyParams()
        self.lru = LRULeafPolicy()
        self.learned = LearnedLeafPolicy(sample_size, seed, learned_params)
        self.following = LEARNED if self.params.start_with_learned else LRU
        self.charges = [0.0, 0.0]
        self.picks = [0, 0]  # victims evicted on each rule's word (agreements not counted)
        self.switches = 0
        self._decay = 1.0 - 1.0 / self.params.charge_window_events
        self._ghost: dict[int, tuple[int, int, int]] = {}  # fp -> (rule, what, tick)
        self._ghost_order: deque[tuple[int, int]] = deque()  # (tick, fp), oldest first
        self._last_rule = LRU  # the rule whose victim the tree is evicting now
        self._disputed = False  # the rules named different victims at the last pick
        self._pops = 0
        self._lru_age_ticks = 0.0  # running mean age of LRU's candidate at a pick

    # -- introspection -------------------------------------------------------------------

    @property
    def following_name(self) -> str:
        """The rule whose victims go when the two disagree: "lru" or "learned"."""
        return RULE_NAMES[self.following]

    # -- the ghost list --------------------------------------------------------------------

    def _ghost_life_ticks(self) -> float:
        return max(self.params.ghost_min_ticks, self.params.ghost_turnovers * self._lru_age_ticks)

    def _expire(self) -> None:
        horizon = self.learned._now - self._ghost_life_ticks()
        order, ghost = self._ghost_order, self._ghost
        while order and order[0][0] < horizon:
            tick, fp = order.popleft()
            entry = ghost.get(fp)
            if entry is not None and entry[2] == tick:
                del ghost[fp]

    def _remember(self, node: TreeNode, rule: int, what: int) -> None:
        """A pick of ``rule`` named ``node`` (``what`` says whether it went or stayed); a
        leaf named again replaces its entry, so it is charged once."""
        fp = self.learned.fingerprint(node)
        tick = self.learned._now
        self._ghost[fp] = (rule, what, tick)
        self._ghost_order.append((tick, fp))

    def _settle(self, node: TreeNode, what: int, charge: float = 1.0) -> None:
        """``node`` came back (``_EVICTED``) or was used (``_KEPT``): if the ghost list has
        it in that state, charge the rule that chose it and forget the entry."""
        if not self._ghost:
            return
        fp = self.learned.fingerprint(node)
        entry = self._ghost.get(fp)
        if entry is None or entry[1] != what:
            return
        del self._ghost[fp]
        self._expire()
        charges = self.charges
        charges[LRU] *= self._decay
        charges[LEARNED] *= self._decay
        charges[entry[0]] += charge
        other = 1 - self.following
        margin = self.params.to_lru_margin if other == LRU else self.params.to_learned_margin
        evidence = charges[LRU] + charges[LEARNED]
        if (
            evidence >= self.params.min_switch_charges
            and charges[other] < (1.0 - margin) * charges[self.following]
        ):
            self.following = other
            self.switches += 1

    # -- hooks from the tree ---------------------------------------------------------------

    def attach(self, page_size: int) -> None:
        self.learned.attach(page_size)

    def add(self, node: TreeNode) -> None:
        st = node.policy_state
        if st is not None and st.evicted:  # loaded back from the host tier: a return
            self._settle(node, _EVICTED, self.params.load_back_charge)
        self.lru.add(node)
        self.learned.add(node)

    def remove(self, node: TreeNode) -> None:
        self.lru.remove(node)
        self.learned.remove(node)

    def touch(self, node: TreeNode) -> None:
        self.lru.touch(node)
        self.learned.touch(node)

    def on_insert(self, node: TreeNode) -> None:
        self._settle(node, _EVICTED)
        self.learned.on_insert(node)

    def on_hit(self, node: TreeNode) -> None:
        self._settle(node, _KEPT)
        self.learned.on_hit(node)

    def on_split(self, node: TreeNode) -> None:
        self.learned.on_split(node)

    def members(self) -> set[int]:
        lru, learned = self.lru.members(), self.learned.members()
        if lru != learned:
            raise AssertionError("adaptive policy: its two rules disagree on the members")
        return lru

    # -- eviction --------------------------------------------------------------------------

    def pop(self) -> TreeNode | None:
        by_lru = self.lru.peek()
        if by_lru is None:
            return None
        self._disputed = False
        self._pops += 1
        window = min(self._pops, self.learned.params.turnover_window_evictions)
        self._lru_age_ticks += (
            self.learned._now - by_lru.last_access - self._lru_age_ticks
        ) / window
        if self.following == LRU and self._pops % self.params.lru_dispute_every_picks:
            # Following LRU, a sample of the picks is enough to keep judging the rules;
            # the learned rule's pick (a sample of leaves ranked in Python) is the cost.
            by_learned = by_lru
        else:
            by_learned = self.learned.propose()
        if by_learned is by_lru:
            victim, rule = by_lru, self.following
        else:
            rule = self.following
            victim, kept = (by_lru, by_learned) if rule == LRU else (by_learned, by_lru)
            self.picks[rule] += 1
            self._remember(kept, 1 - rule, _KEPT)
            self._disputed = True  # on_evict remembers the piece that actually goes
        self._last_rule = rule
        self.lru.remove(victim)
        self.learned.remove(victim)
        return victim

    def on_evict(self, node: TreeNode) -> None:
        if self._disputed:
            self._disputed = False
            self._remember(node, self._last_rule, _EVICTED)
        self.learned.on_evict(node)
