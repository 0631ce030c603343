"""A device-tier leaf eviction policy that learns from history which leaves are dead.

On prefix-cache traces most pages are never used again, and LRU keeps them exactly as long
as the pages that are: a leaf used by twenty requests and a leaf no request will ever ask
for again leave the cache in the order they were last touched. This policy ranks each
evictable leaf by an estimate of its *reuse rate*, the uses per tick it can expect,

    rate = (uses + prior_uses) / (age + prior_ticks)

and evicts the tail of the lowest of a random sample of evictable leaves: one quantum
(``evict_quantum_tokens``, 512 tokens) per pick, then it samples again. So the room a
request needs comes off the tails of several unpromising leaves rather than all of one:
a request that returns to a leaf hits its head first, and the head stays.

* ``uses`` counts the requests that used the leaf's prefix since it was first cached:
  matches that covered it, and returns seen through the history below. A leaf nobody
  used since it was inserted has ``uses = 0`` and goes first; on the traces this policy
  is measured on, most of those never come back, while a prefix used twice is used again
  four times out of five.
* ``age`` is the time since its last use, on the tree's clock (one tick per touch:
  every match, insert and release), so a leaf whose requests stopped coming loses its
  rank in proportion, however often it was used before.
* ``prior_ticks`` is learned: ``prior_turnovers`` times the cache's *turnover*, the
  running mean age of the leaves it evicts. It puts ``age`` on the scale of this cache
  (a 1 %-of-trace device and a 20 % one differ by 30x in turnover), so the same rule fits
  every capacity. ``prior_uses`` keeps never-used leaves ordered by age among
  themselves.
* With a host (or disk) tier, a leaf whose pages the controller also holds costs only a
  load-back to drop, not a recomputation: its rate is multiplied by ``backed_discount``.
  With write-back, this keeps on the device the leaves the host does not have, so the
  two tiers hold more distinct prefixes between them.
* **History**: an evicted leaf is remembered in a bounded ring of ``history_entries``
  (a fingerprint of its start position and first tokens, and its uses). When a node with
  a remembered fingerprint is inserted again, the prefix came back: the node starts
  with the old count + 1 instead of 0, and it ends where that piece ended
  (``insert_end``): a chain evicted quantum by quantum comes back as nodes cut where its
  pieces were, each with its own count, so blocks nobody reused do not ride on the
  count of a hot head. Nodes that stay in the tree as host-only (a host
  tier backs them) keep their own state, and a load-back counts as a use the same way.
  Without the history, a prefix evicted between its uses would look new at every
  return and never earn its rank.

Costs: O(1) per add/remove/touch/hit/insert (a swap-remove array of members, a dict
into the ring), O(sample) per pick, one pick per quantum evicted. Memory: a small record
per node, and the ring.

Only evictable leaves are members (the tree guarantees it), so a chain is always cut from
its tail: a parent is never a candidate while it has a device child, whatever its rate.
Determinism: the sample comes from ``random.Random(seed)`` over a member order that
depends only on the sequence of calls, so equal call sequences evict equal nodes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from hicache.eviction import LeafEvictionPolicy

if TYPE_CHECKING:
    from hicache.node import TreeNode

_TOKEN_BYTES = 8


@dataclass(frozen=True)
class LearnedPolicyParams:
    """Tuning of :class:`LearnedLeafPolicy`; every number has its unit in its name."""

    prior_uses: float = 0.05
    backed_discount: float = 0.1  # rate factor of a leaf the host/disk tier also holds
    prior_turnovers: float = 0.5  # prior_ticks = this × the mean age of evicted leaves
    initial_prior_ticks: float = 50.0  # until the first eviction measured the turnover
    turnover_window_evictions: int = 256  # horizon of the running mean of eviction ages
    history_entries: int = 1 << 16
    fingerprint_tokens: int = 8  # first tokens of a node that, with its start, identify it
    evict_quantum_tokens: int = 512  # tail tokens evicted per pick (at least one page)

    def __post_init__(self) -> None:
        if not self.prior_uses > 0 or not self.prior_turnovers > 0:
            raise ValueError("prior_uses and prior_turnovers must be > 0")
        if not 0 <= self.backed_discount <= 1:
            raise ValueError("backed_discount must be within [0, 1]")
        if not self.initial_prior_ticks > 0:
            raise ValueError("initial_prior_ticks must be > 0")
        if self.turnover_window_evictions < 1 or self.history_entries < 1:
            raise ValueError("turnover_window_evictions and history_entries must be >= 1")
        if self.fingerprint_tokens < 1 or self.evict_quantum_tokens < 1:
            raise ValueError("fingerprint_tokens and evict_quantum_tokens must be >= 1")


class _LeafState:
    """What the policy keeps on a node (in ``node.policy_state``)."""

    __slots__ = ("evicted", "fp", "sampled", "slot", "stamp", "uses")

    def __init__(self, stamp: int, uses: int) -> None:
        self.stamp = stamp  # tree clock of the last use (insert, hit or return)
        self.uses = uses
        self.slot = -1  # index in the member array, -1 when not a member
        self.evicted = False  # left the device (and may come back from the host tier)
        self.fp: int | None = None  # the node's fingerprint, once asked for
        # The adaptive policy's: (key bytes, sample threshold, sampled units' fingerprints).
        self.sampled: tuple[int, int, tuple[int, ...]] | None = None


class _History:
    """A ring of evicted leaves, found by fingerprint: their uses and where they ended."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fp = np.zeros(size, dtype=np.uint64)
        self.uses = np.zeros(size, dtype=np.int64)
        self.end = np.zeros(size, dtype=np.int64)  # token position where the leaf ended
        self.live = np.zeros(size, dtype=bool)
        self.slot_of: dict[int, int] = {}
        self.head = 0

    def push(self, fp: int, uses: int, end: int) -> None:
        """Remember a leaf, forgetting the oldest entry when the ring is full."""
        i = self.head
        self.head = (i + 1) % self.size
        if self.live[i]:
            del self.slot_of[int(self.fp[i])]
        old = self.slot_of.pop(fp, None)
        if old is not None:  # the same fingerprint again: the newer entry wins
            self.live[old] = False
        self.fp[i], self.uses[i], self.end[i] = fp, uses, end
        self.live[i] = True
        self.slot_of[fp] = i

    def take(self, fp: int) -> tuple[int, int] | None:
        """(uses, end) of the entry with fingerprint ``fp``, forgotten now; None if absent."""
        i = self.slot_of.pop(fp, None)
        if i is None:
            return None
        self.live[i] = False
        return int(self.uses[i]), int(self.end[i])

    def __len__(self) -> int:
        return len(self.slot_of)


class LearnedLeafPolicy(LeafEvictionPolicy):
    """Evicts, of ``sample_size`` random evictable leaves, the one with the lowest
    estimated reuse rate (see the module docstring)."""

    def __init__(
        self, sample_size: int = 8, seed: int = 0, params: LearnedPolicyParams | None = None
    ) -> None:
        if sample_size < 1:
            raise ValueError(f"sample_size must be >= 1, got {sample_size}")
        self.sample_size = sample_size
        self.params = params or LearnedPolicyParams()
        self._rng = random.Random(seed)
        self._members: list[TreeNode] = []
        self._now = 0
        self._turnover_ticks = 0.0
        self._evictions = 0
        self._history = _History(self.params.history_entries)
        self._fp_bytes = self.params.fingerprint_tokens * _TOKEN_BYTES

    # -- introspection (tests, docs) -----------------------------------------------------

    @property
    def prior_ticks(self) -> float:
        """The learned time scale of ``age`` (ticks)."""
        if not self._evictions:
            return self.params.initial_prior_ticks
        return max(1.0, self.params.prior_turnovers * self._turnover_ticks)

    def uses(self, node: TreeNode) -> int:
        """The uses the policy counts for ``node`` (history included)."""
        return self._state(node).uses

    @property
    def history_size(self) -> int:
        """Evicted leaves currently remembered (at most ``history_entries``)."""
        return len(self._history)

    # -- node state ----------------------------------------------------------------------

    def _state(self, node: TreeNode) -> _LeafState:
        """``node``'s state, created on first sight: a node the tree made by a split (the
        only nodes created without ``on_insert``) takes its suffix's history (uses, last
        use, whether it left the device), since both parts shared it until the split."""
        st = node.policy_state
        if st is None:
            st = node.policy_state = _LeafState(node.last_access, 0)
            for child in node.children.values():
                cst = child.policy_state
                if cst is not None:
                    st.uses, st.stamp, st.evicted = cst.uses, cst.stamp, cst.evicted
                    break
        return st

    def attach(self, page_size: int) -> None:
        # Every node, and every piece eviction cuts, is at least a page: fingerprint no
        # more than its first page, so a piece and the same tokens inserted again agree.
        self._fp_bytes = min(self.params.fingerprint_tokens, page_size) * _TOKEN_BYTES

    def fingerprint(self, node: TreeNode) -> int:
        """A 64-bit id of ``node``'s start position and first tokens: equal for the same
        prefix piece cached again, or the head a split leaves (kept on the node's state;
        a split resets the suffix's, whose start moved)."""
        st = self._state(node)
        if st.fp is None:
            st.fp = self._fingerprint(node)
        return st.fp

    def _fingerprint(self, node: TreeNode, offset_tokens: int = 0) -> int:
        return self._fingerprint_at(node.key, offset_tokens, node.start + offset_tokens)

    def _fingerprint_at(self, key: bytes | memoryview, offset_tokens: int, position: int) -> int:
        """Of the tokens of ``key`` from ``offset_tokens``, which sit at ``position``."""
        off = offset_tokens * _TOKEN_BYTES
        return xxhash.xxh3_64_intdigest(key[off : off + self._fp_bytes], seed=position)

    def _recall(self, node: TreeNode) -> int | None:
        """Uses of the evicted leaves that ``node`` covers from its start (the history
        forgets them: they are back), or None when its start is not remembered."""
        first = None
        offset = 0
        while offset < node.num_tokens:
            found = self._history.take(self._fingerprint(node, offset))
            if found is None:
                break
            uses, end = found
            first = uses if first is None else first
            if end - node.start <= offset:  # a colliding fingerprint: stop following
                break
            offset = end - node.start
        return first

    def insert_end(self, key: bytes | memoryview, start: int, end: int) -> int:
        """End a new node where the evicted leaf remembered at ``start`` ended, so each
        returning leaf gets back its own uses and the blocks after it start from none."""
        if not len(self._history):
            return end
        i = self._history.slot_of.get(self._fingerprint_at(key, start, start))
        if i is None:
            return end
        old_end = int(self._history.end[i])
        return old_end if start < old_end < end else end

    def _saw(self, node: TreeNode) -> None:
        self._now = max(self._now, node.last_access)

    # -- hooks from the tree -------------------------------------------------------------

    def on_insert(self, node: TreeNode) -> None:
        self._saw(node)
        past = self._recall(node) if len(self._history) else None
        node.policy_state = _LeafState(self._now, 0 if past is None else past + 1)

    def on_split(self, node: TreeNode) -> None:
        # Both parts share the state until now: take it before the suffix's changes.
        self._state(node).fp = None
        for child in node.children.values():
            if child.policy_state is not None:
                child.policy_state.fp = None  # the suffix starts later now

    def on_hit(self, node: TreeNode) -> None:
        self._saw(node)
        st = self._state(node)
        st.uses += 1
        st.stamp = self._now

    def add(self, node: TreeNode) -> None:
        self._saw(node)
        st = self._state(node)
        if st.evicted:  # back on the device from the host tier: a use of the prefix
            st.evicted = False
            st.uses += 1
            st.stamp = self._now
            if len(self._history):
                self._history.take(self._fingerprint(node))
        if st.slot < 0:
            st.slot = len(self._members)
            self._members.append(node)

    def remove(self, node: TreeNode) -> None:
        st = node.policy_state
        if st is None or st.slot < 0:
            return
        last = self._members.pop()
        if last is not node:
            self._members[st.slot] = last
            last.policy_state.slot = st.slot
        st.slot = -1

    def touch(self, node: TreeNode) -> None:
        self._saw(node)

    def members(self) -> set[int]:
        return {n.id for n in self._members}

    # -- eviction ------------------------------------------------------------------------

    def pop(self) -> TreeNode | None:
        victim = self.propose()
        if victim is not None:
            self.remove(victim)
        return victim

    def propose(self) -> TreeNode | None:
        """The leaf ``pop`` would name now, left a member (a fresh sample each call)."""
        n = len(self._members)
        if n == 0:
            return None
        if n <= self.sample_size:
            candidates = self._members
        else:
            candidates = self._rng.choices(self._members, k=self.sample_size)
        # The rate of the module docstring, in one loop (the policy's cost per pick); a
        # leaf the host or disk tier also holds costs a load-back, not a recomputation, to
        # drop: discounted; ties go least recently used first.
        now, prior = self._now, self.prior_ticks
        prior_uses, discount = self.params.prior_uses, self.params.backed_discount
        victim, best = None, None
        for node in candidates:
            st = node.policy_state
            rate = (st.uses + prior_uses) / (now - st.stamp + prior)
            if node.data[0].backed:
                rate *= discount
            key = (rate, node.last_access)
            if best is None or key < best:
                victim, best = node, key
        return victim

    def tail_tokens(self, node: TreeNode, want_tokens: int) -> int:
        """A quantum at most: a victim's tail goes, then the next pick samples anew, so the
        room is taken from the tails of several unpromising leaves rather than all of one
        (a later request that returns to a leaf hits its head first). When the pick saw
        every leaf, the head (same state, same rank) would be picked again at once: then
        all that is asked goes in one piece."""
        if len(self._members) < self.sample_size:  # the pick saw them all, and ``node``
            return want_tokens
        return min(want_tokens, self.params.evict_quantum_tokens)

    def on_evict(self, node: TreeNode) -> None:
        st = self._state(node)
        st.evicted = True
        self._history.push(self._fingerprint(node), st.uses, node.end)
        # A running mean of the age at eviction over about the last window of evictions.
        age = self._now - st.stamp
        self._evictions += 1
        weight = 1.0 / min(self._evictions, self.params.turnover_window_evictions)
        self._turnover_ticks += weight * (age - self._turnover_ticks)
