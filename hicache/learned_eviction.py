"""A device-tier leaf eviction policy that learns from history which leaves are dead.

On prefix-cache traces most pages are never used again, and LRU keeps them exactly as long
as the pages that are. This policy ranks leaves by their *hit density*: the hits a token of
the leaf can still expect per unit of cache space-time it would occupy, learned online for
each class of leaf and each age, and evicts the worst of a small random sample of
evictable leaves (the ranking idea of "least hit density", Beckmann et al., NSDI'18; the
estimator below differs).

* **Classes** sort leaves by what their history says: how many times the prefix was used
  since it was first cached (0, 1, 2, 3+), and whether the node was appended below a
  prefix that was already cached (a new turn of a conversation) or started a new chain.
* **Age** is the time since the leaf's last use, on the tree's clock (one tick per
  touch: every match, insert and release), in log-spaced buckets (``buckets_per_octave``
  per doubling), so that one table covers reuse after a few requests and after a million.
* **History**: reuse often comes long after LRU would have evicted a page, so the policy
  cannot learn it from what it keeps. Every evicted leaf goes into a bounded ring of
  ``history_entries`` (fingerprint = start position and first tokens, class, time of
  last use, tokens): its lifetime goes on *virtually*. When a node with a remembered
  fingerprint is inserted again (or a host-only node is loaded back), that lifetime ends
  with a hit at its age, and the node starts in the next class. An entry pushed out of
  the ring is censored at its age (seen alive until then, no hit).
* **Learning**: per class and age bucket, the tokens of lifetimes that ended by a hit
  there, and of lifetimes that ended or were censored there. Every
  ``recompute_every_evictions`` evictions, the hazard of a hit per bucket is estimated
  from them, with the lifetimes still open (leaves, and history entries) counted as at
  risk up to their current age, and a backward pass turns hazards into, per bucket, the
  expected hits and the expected space-time of a leaf kept from that age on; their ratio
  is the density.

Costs: O(1) per add/remove/touch/hit/insert (a swap-remove array of members, a dict into
the ring), O(sample) per eviction, and per recompute O(members + history) vectorised
work, run every ``max(recompute_every_evictions, members + history / 8)`` evictions so
that its amortised cost per eviction stays O(1). Memory: a small record per node, and the
fixed ring.

Only evictable leaves are members (the tree guarantees it), so a chain is always cut from
its tail: a parent is never a candidate while it has a device child. Determinism: the
sample comes from ``random.Random(seed)`` over a member order that depends only on the
sequence of calls, so equal call sequences evict equal nodes.

Until the first recompute (no history yet) the order is least recently used.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from hicache.eviction import LeafEvictionPolicy

if TYPE_CHECKING:
    from hicache.tree import TreeNode

_TOKEN_BYTES = 8


@dataclass(frozen=True)
class LearnedPolicyParams:
    """Tuning of :class:`LearnedLeafPolicy`; every number has its unit in its name."""

    max_class_uses: int = 3  # uses beyond this share a class
    buckets_per_octave: int = 4
    age_buckets: int = 84  # with 4 per octave: ages up to 2**21 ticks
    history_entries: int = 1 << 15
    recompute_every_evictions: int = 256
    fingerprint_tokens: int = 8  # first tokens of a node that, with its start, identify it

    def __post_init__(self) -> None:
        if self.max_class_uses < 1 or self.buckets_per_octave < 1 or self.age_buckets < 4:
            raise ValueError("max_class_uses >= 1, buckets_per_octave >= 1, age_buckets >= 4")
        if self.history_entries < 1 or self.recompute_every_evictions < 1:
            raise ValueError("history_entries >= 1 and recompute_every_evictions >= 1")
        if self.fingerprint_tokens < 1:
            raise ValueError("fingerprint_tokens >= 1")


class _LeafState:
    """What the policy keeps on a node (in ``node.policy_state``)."""

    __slots__ = ("appended", "evicted", "slot", "stamp", "uses")

    def __init__(self, stamp: int, uses: int, appended: bool) -> None:
        self.stamp = stamp  # tree clock of the last use (insert, hit or return)
        self.uses = uses
        self.appended = appended
        self.slot = -1  # index in the member array, -1 when not a member
        self.evicted = False  # left the device; its lifetime goes on in the history


class _History:
    """A ring of evicted leaves whose lifetimes go on virtually, found by fingerprint."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fp = np.zeros(size, dtype=np.uint64)
        self.stamp = np.zeros(size, dtype=np.int64)
        self.end = np.zeros(size, dtype=np.int64)  # token position where the leaf ended
        self.cls = np.zeros(size, dtype=np.int64)
        self.uses = np.zeros(size, dtype=np.int64)
        self.tokens = np.zeros(size, dtype=np.float64)
        self.live = np.zeros(size, dtype=bool)
        self.slot_of: dict[int, int] = {}
        self.head = 0

    def push(
        self, fp: int, stamp: int, end: int, cls: int, uses: int, tokens: int
    ) -> tuple[int, int, float] | None:
        """Remember a leaf; returns (class, stamp, tokens) of the entry it pushed out."""
        i = self.head
        self.head = (i + 1) % self.size
        out = None
        if self.live[i]:
            out = (int(self.cls[i]), int(self.stamp[i]), float(self.tokens[i]))
            del self.slot_of[int(self.fp[i])]
        old = self.slot_of.pop(fp, None)
        if old is not None:
            self.live[old] = False  # a fingerprint collision: the newer leaf wins
        self.fp[i], self.stamp[i], self.end[i] = fp, stamp, end
        self.cls[i], self.uses[i], self.tokens[i] = cls, uses, tokens
        self.live[i] = True
        self.slot_of[fp] = i
        return out

    def take(self, fp: int) -> int | None:
        """The slot of the live entry with fingerprint ``fp``, now dead; None if absent."""
        i = self.slot_of.pop(fp, None)
        if i is not None:
            self.live[i] = False
        return i


class LearnedLeafPolicy(LeafEvictionPolicy):
    """Evicts, of ``sample_size`` random evictable leaves, the one of lowest learned hit
    density (see the module docstring)."""

    def __init__(
        self, sample_size: int = 8, seed: int = 0, params: LearnedPolicyParams | None = None
    ) -> None:
        if sample_size < 1:
            raise ValueError(f"sample_size must be >= 1, got {sample_size}")
        self.sample_size = sample_size
        self.params = p = params or LearnedPolicyParams()
        self._rng = random.Random(seed)
        self._members: list[TreeNode] = []
        self._now = 0
        self._classes = 2 * (p.max_class_uses + 1)
        shape = (self._classes, p.age_buckets)
        self._hit_tokens = np.zeros(shape)  # lifetimes that ended by a hit, per bucket
        self._end_tokens = np.zeros(shape)  # lifetimes that ended (hit or censored)
        self._density: np.ndarray | None = None  # None: no history yet, evict LRU
        self._since_recompute = 0
        self._history = _History(p.history_entries)
        lower = 2.0 ** (np.arange(p.age_buckets) / p.buckets_per_octave) - 1.0
        upper = 2.0 ** (np.arange(1, p.age_buckets + 1) / p.buckets_per_octave) - 1.0
        self._bucket_width = upper - lower
        self._fp_bytes = p.fingerprint_tokens * _TOKEN_BYTES

    # -- node state ----------------------------------------------------------------------

    def _state(self, node: TreeNode) -> _LeafState:
        """``node``'s state, created on first sight (a node the tree made by a split gets
        its suffix's class, since both parts were used by the same requests)."""
        st = node.policy_state
        if st is None:
            uses, appended = 0, node.parent is not None and node.parent.parent is not None
            for child in node.children.values():
                cst = child.policy_state
                if cst is not None:
                    uses, appended = cst.uses, cst.appended
                    break
            st = node.policy_state = _LeafState(node.last_access, uses, appended)
        return st

    def _class(self, st: _LeafState) -> int:
        return 2 * min(st.uses, self.params.max_class_uses) + st.appended

    def _bucket(self, age: int) -> int:
        b = int(math.log2(age + 1) * self.params.buckets_per_octave) if age > 0 else 0
        return min(b, self.params.age_buckets - 1)

    def _fingerprint(self, node: TreeNode, offset_tokens: int = 0) -> int:
        off = offset_tokens * _TOKEN_BYTES
        chunk = node.key[off : off + self._fp_bytes]
        return xxhash.xxh3_64_intdigest(chunk, seed=node.start + offset_tokens)

    def _returned(self, node: TreeNode, st: _LeafState) -> None:
        """``node`` came (back) onto the device: end the virtual lifetimes of the evicted
        leaves it covers with a hit, and put it in the class after theirs."""
        hist = self._history
        offset = 0
        while offset < node.num_tokens:
            i = hist.take(self._fingerprint(node, offset))
            if i is None:
                return
            cls, age = int(hist.cls[i]), self._now - int(hist.stamp[i])
            b = self._bucket(age)
            self._hit_tokens[cls, b] += hist.tokens[i]
            self._end_tokens[cls, b] += hist.tokens[i]
            if offset == 0:
                st.uses = max(st.uses, int(hist.uses[i]) + 1)
            offset = int(hist.end[i]) - node.start

    # -- hooks from the tree -------------------------------------------------------------

    def on_insert(self, node: TreeNode) -> None:
        self._now = max(self._now, node.last_access)
        parent = node.parent
        appended = parent is not None and parent.parent is not None
        st = node.policy_state = _LeafState(self._now, 0, appended)
        self._returned(node, st)

    def on_hit(self, node: TreeNode) -> None:
        self._now = max(self._now, node.last_access)
        st = self._state(node)
        b = self._bucket(self._now - st.stamp)
        c = self._class(st)
        self._hit_tokens[c, b] += node.num_tokens
        self._end_tokens[c, b] += node.num_tokens
        st.uses += 1
        st.stamp = self._now

    def add(self, node: TreeNode) -> None:
        self._now = max(self._now, node.last_access)
        st = self._state(node)
        if st.evicted:  # loaded back from the host tier: a use seen through the history
            st.evicted = False
            self._returned(node, st)
            st.stamp = self._now
        if st.slot >= 0:
            return
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
        self._now = max(self._now, node.last_access)

    def members(self) -> set[int]:
        return {n.id for n in self._members}

    # -- eviction ------------------------------------------------------------------------

    def pop(self) -> TreeNode | None:
        n = len(self._members)
        if n == 0:
            return None
        if n <= self.sample_size:
            candidates = self._members
        else:
            rand = self._rng.randrange
            candidates = [self._members[rand(n)] for _ in range(self.sample_size)]
        victim = min(candidates, key=self._rank)
        self.remove(victim)
        self._evicted(victim)
        return victim

    def _rank(self, node: TreeNode) -> tuple[float, int]:
        """Lower goes first: learned density, then least recently used."""
        if self._density is None:
            return (0.0, node.last_access)
        st = node.policy_state
        return (
            self._density[self._class(st), self._bucket(self._now - st.stamp)],
            node.last_access,
        )

    def _evicted(self, node: TreeNode) -> None:
        st = node.policy_state
        st.evicted = True
        pushed_out = self._history.push(
            self._fingerprint(node),
            st.stamp,
            node.end,
            self._class(st),
            st.uses,
            node.num_tokens,
        )
        if pushed_out is not None:  # censored: seen alive until now, never hit
            cls, stamp, tokens = pushed_out
            self._end_tokens[cls, self._bucket(self._now - stamp)] += tokens
        self._since_recompute += 1
        period = max(
            self.params.recompute_every_evictions,
            (len(self._members) + len(self._history.slot_of)) // 8,
        )
        if self._since_recompute >= period:
            self._recompute()

    def _open_tokens(self) -> np.ndarray:
        """Tokens of lifetimes still open (leaves on the device, live history entries)
        per class and bucket of their current age."""
        p = self.params
        hist = self._history
        cls = [hist.cls[hist.live]]
        ages = [self._now - hist.stamp[hist.live]]
        tokens = [hist.tokens[hist.live]]
        if self._members:
            states = [m.policy_state for m in self._members]
            cls.append(np.array([self._class(s) for s in states], dtype=np.int64))
            ages.append(np.array([self._now - s.stamp for s in states], dtype=np.int64))
            tokens.append(np.array([m.num_tokens for m in self._members], dtype=np.float64))
        c, a, t = np.concatenate(cls), np.concatenate(ages), np.concatenate(tokens)
        b = np.zeros(a.size, dtype=np.int64)
        pos = a > 0
        b[pos] = np.floor(np.log2(a[pos] + 1.0) * p.buckets_per_octave).astype(np.int64)
        np.minimum(b, p.age_buckets - 1, out=b)
        out = np.zeros((self._classes, p.age_buckets))
        np.add.at(out, (c, b), t)
        return out

    def _recompute(self) -> None:
        """Re-estimate each class's hit hazard per age bucket and turn it into the
        density of a leaf kept from each age on."""
        self._since_recompute = 0
        # At risk in bucket x: lifetimes that ended or were censored at x or later, and
        # open ones now at x or later.
        ended_or_open = self._end_tokens + self._open_tokens()
        at_risk = np.cumsum(ended_or_open[:, ::-1], axis=1)[:, ::-1]
        pooled_hits = self._hit_tokens.sum(axis=0)
        pooled_risk = at_risk.sum(axis=0)
        hazard = np.where(at_risk > 0, self._hit_tokens / np.maximum(at_risk, 1e-12), np.nan)
        pooled = np.where(pooled_risk > 0, pooled_hits / np.maximum(pooled_risk, 1e-12), 0.0)
        hazard = np.where(np.isnan(hazard), pooled[None, :], hazard)
        hazard = np.clip(hazard, 0.0, 1.0)
        # Backward over buckets: expected hits and space-time of a leaf alive at the start
        # of bucket x and kept until it is hit (or ages out of the table).
        width = self._bucket_width
        hits = np.zeros_like(hazard)
        space_time = np.zeros_like(hazard)
        nxt_h = np.zeros(self._classes)
        nxt_s = np.zeros(self._classes)
        for x in range(hazard.shape[1] - 1, -1, -1):
            h = hazard[:, x]
            nxt_h = h + (1.0 - h) * nxt_h
            nxt_s = width[x] * (1.0 - 0.5 * h) + (1.0 - h) * nxt_s
            hits[:, x], space_time[:, x] = nxt_h, nxt_s
        self._density = hits / np.maximum(space_time, 1e-12)
