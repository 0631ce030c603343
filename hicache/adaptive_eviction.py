"""A device leaf eviction policy that follows, online, the better of LRU and the learned rule.

Neither rule wins everywhere: the learned rule (:mod:`hicache.learned_eviction`) evicts
never-reused leaves first, which pays where most blocks are dead and hot prefixes return
late, and loses where a prefix's next use is its first reuse (the next turn of a
conversation extends a tail nobody has used yet). This policy keeps both rules' state up
to date (every hook goes to both) and at each pick asks both for their victim. When they
name the same leaf, that leaf goes and nothing is learned. When they differ, the rule
being followed has its victim evicted, and the two choices are remembered in a ghost
list, each charged to the rule that made it:

* the evicted victim is charged to its rule if it is inserted (or loaded back) again:
  that rule caused a miss;
* the leaf the other rule named, which stayed, is charged to that rule if a match uses
  it: that rule would have caused a miss.

A ghost entry lives for ``ghost_turnovers`` of the cache's turnover (the learned rule's
running mean age of evicted leaves), so both rules are judged over the same horizon, a
choice whose consequence comes later than that counting as harmless. Charges decay by
``1 - 1/charge_window_events`` per charge, and the rule followed switches when the
other's decayed charge is lower by ``switch_margin`` of it. It starts with LRU, the
cheaper and safer rule while nothing is known.

Chains are still cut from the tail: both rules only ever name evictable leaves, and the
tail the tree takes of a victim is what the rule that named it asks (``tail_tokens``).
Cost per pick: one LRU heap peek and a few dictionary operations, plus a learned sample
(the learned rule's pick) at every pick while it is followed and at one pick in
``lru_dispute_every_picks`` while LRU is; per hook, the two rules' own O(1)/O(log n)
upkeep.
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

    ghost_turnovers: float = 2.0  # a ghost entry's life, in cache turnovers
    ghost_min_ticks: float = 256.0  # its least life, while the turnover is not yet known
    charge_window_events: int = 4096  # horizon of the decayed charges, in charges
    to_lru_margin: float = 0.3  # follow LRU when its charge is this much below the learned's
    to_learned_margin: float = 0.0  # follow the learned rule when its charge is this much below
    start_with_learned: bool = False
    lru_dispute_every_picks: int = 4  # while following LRU, ask the learned rule this often

    def __post_init__(self) -> None:
        if not self.ghost_turnovers > 0 or not self.ghost_min_ticks > 0:
            raise ValueError("ghost_turnovers and ghost_min_ticks must be > 0")
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
        # fp -> (rule, what, tick, picks): ``picks`` is how many picks named the leaf.
        self._ghost: dict[int, tuple[int, int, int, int]] = {}
        self._ghost_order: deque[tuple[int, int]] = deque()  # (tick, fp), oldest first
        self._last_rule = LRU  # the rule whose victim the tree is evicting now
        self._disputed = False  # the rules named different victims at the last pick
        self._pops = 0

    # -- introspection -------------------------------------------------------------------

    @property
    def following_name(self) -> str:
        """The rule whose victims go when the two disagree: "lru" or "learned"."""
        return RULE_NAMES[self.following]

    # -- the ghost list --------------------------------------------------------------------

    def _ghost_life_ticks(self) -> float:
        turnover = self.learned._turnover_ticks if self.learned._evictions else 0.0
        return max(self.params.ghost_min_ticks, self.params.ghost_turnovers * turnover)

    def _expire(self) -> None:
        horizon = self.learned._now - self._ghost_life_ticks()
        order, ghost = self._ghost_order, self._ghost
        while order and order[0][0] < horizon:
            tick, fp = order.popleft()
            entry = ghost.get(fp)
            if entry is not None and entry[2] == tick:
                del ghost[fp]

    def _remember(self, node: TreeNode, rule: int, what: int) -> None:
        """One pick of ``rule`` named ``node``. A leaf the other rule keeps evicting around
        is named again at every pick: each pick counts, so that both rules are charged
        per pick, the one followed (a new victim each pick) and the other alike."""
        fp = self.learned.fingerprint(node)
        tick = self.learned._now
        entry = self._ghost.get(fp)
        picks = entry[3] + 1 if entry is not None and entry[:2] == (rule, what) else 1
        self._ghost[fp] = (rule, what, tick, picks)
        self._ghost_order.append((tick, fp))

    def _settle(self, node: TreeNode, what: int) -> None:
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
        charges[entry[0]] += entry[3]
        other = 1 - self.following
        margin = self.params.to_lru_margin if other == LRU else self.params.to_learned_margin
        if charges[other] < (1.0 - margin) * charges[self.following]:
            self.following = other
            self.switches += 1

    # -- hooks from the tree ---------------------------------------------------------------

    def attach(self, page_size: int) -> None:
        self.learned.attach(page_size)

    def add(self, node: TreeNode) -> None:
        st = node.policy_state
        if st is not None and st.evicted:  # loaded back from the host tier: a return
            self._settle(node, _EVICTED)
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

    def insert_end(self, key: bytes, start: int, end: int) -> int:
        return self.learned.insert_end(key, start, end)

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

    def tail_tokens(self, node: TreeNode, want_tokens: int) -> int:
        if self._last_rule == LRU:
            return self.lru.tail_tokens(node, want_tokens)
        return self.learned.tail_tokens(node, want_tokens)

    def on_evict(self, node: TreeNode) -> None:
        if self._disputed:
            self._disputed = False
            self._remember(node, self._last_rule, _EVICTED)
        self.learned.on_evict(node)
