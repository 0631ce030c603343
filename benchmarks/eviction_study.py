"""What the device-tier eviction order could gain from which features, on a Mooncake trace.

A block-level simulator of the prefix cache (a request hits the longest cached prefix of
its chain, then its whole chain is cached; only leaves are evicted, the evictable leaf
chosen among ``--sample`` random ones), driven by rankers that differ only in what they
know:

* ``lru`` and ``rule``: least recently used, and the learned policy's rate
  ``(uses + 0.05) / (age + 0.5 × turnover)`` (the formula of
  :mod:`hicache.learned_eviction`, here per block rather than per tree node);
* ``fitted:<classes>``: a table of P(next use within ``--horizon`` requests | class, age
  bucket) counted over the *whole* trace, i.e. knowing its future. It bounds what any
  policy that ranks by those classes can reach;
* ``online:<classes>``: the same table estimated while the replay runs, from the use
  intervals whose outcome is already known (an interval that started ``age + horizon``
  requests ago or earlier), refreshed every 50 requests;
* ``first-half:<classes>``, ``second-half:<classes>``: the fitted table counted over one
  half of the trace only, ranking the whole replay: whether what a table learns on one
  part of the trace holds on another;
* ``final:<classes>``: the table the online estimate reached at the end of the trace,
  fixed from the start (what the online estimate would give if the trace's statistics
  were known from its first request).

Classes: ``uses`` (uses so far, buckets 0..5, 6-10, 11+), ``uses+length`` (and the
log2 bucket of the length of the request that first cached the block), ``uses+output``
(and the log2 bucket of that request's output length, which an engine knows when it
inserts a finished request), ``uses+gap`` (and the log4 bucket of the time between the
last two uses). Run::

    .venv/bin/python benchmarks/eviction_study.py \
        --trace ../shared/data/mooncake_synthetic_trace.jsonl

It prints the hit ratio of each ranker, and its fraction of the offline optimum.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from hicache.apps.replay import BlockShape, load_trace, page_chains, unique_blocks
from hicache.apps.replay_bounds import optimal_hits

AGE_BUCKETS = 14


def age_bucket(age: int) -> int:
    return 0 if age < 1 else min(int(math.log2(age)) + 1, AGE_BUCKETS - 1)


def uses_bucket(uses: int) -> int:
    return uses if uses < 6 else (6 if uses < 11 else 7)


class Block:
    """What a ranker may know of a cached (or evicted and remembered) block."""

    __slots__ = ("cls", "first_len", "first_out", "gap", "stamp", "uses")

    def __init__(self, stamp: int, first_len: int, first_out: int = 0) -> None:
        self.uses = 0
        self.stamp = stamp  # request index of the last use
        self.gap = 0  # requests between the last two uses (0 before the second)
        self.first_len = first_len  # blocks of the request that first cached it
        self.first_out = first_out  # output tokens of that request
        self.cls: object = None


CLASSES: dict[str, Callable[[Block], object]] = {
    "uses": lambda b: uses_bucket(b.uses),
    "uses+length": lambda b: (uses_bucket(b.uses), age_bucket(b.first_len)),
    "uses+output": lambda b: (uses_bucket(b.uses), age_bucket(b.first_out)),
    "uses+gap": lambda b: (uses_bucket(b.uses), age_bucket(b.gap) // 2),
}


class Ranker:
    """Lower rank is evicted first. ``opened``/``closed`` see every use interval."""

    def rank(self, b: Block, now: int) -> tuple:
        raise NotImplementedError

    def opened(self, b: Block, now: int) -> None:
        pass

    def closed(self, b: Block, now: int) -> None:
        pass

    def evicted(self, b: Block, now: int) -> None:
        pass


class LRU(Ranker):
    def rank(self, b: Block, now: int) -> tuple:
        return (b.stamp,)


class Rule(Ranker):
    """The learned policy's rate, with its running mean of eviction ages as the clock."""

    def __init__(self) -> None:
        self.turnover = 0.0
        self.evictions = 0

    def rank(self, b: Block, now: int) -> tuple:
        prior = max(1.0, 0.5 * self.turnover) if self.evictions else 50.0
        return ((b.uses + 0.05) / (now - b.stamp + prior), b.stamp)

    def evicted(self, b: Block, now: int) -> None:
        self.evictions += 1
        self.turnover += (now - b.stamp - self.turnover) / min(self.evictions, 256)


class Table(Ranker):
    """Ranks by a table value per (class, age bucket), then LRU."""

    def __init__(self, table: dict[object, list[float]], default: float = 0.2) -> None:
        self.table = table
        self.default = default

    def rank(self, b: Block, now: int) -> tuple:
        row = self.table.get(b.cls)
        value = self.default if row is None else row[age_bucket(now - b.stamp)]
        return (value, b.stamp)


def table_from_intervals(
    starts: np.ndarray,
    gaps: np.ndarray,
    open_starts: np.ndarray,
    now: int,
    horizon: int,
    min_alive: int = 20,
) -> list[float]:
    """P(next use within ``horizon`` | no use for ``age``) per age bucket, over intervals
    whose outcome is known at ``now``. ``gaps`` of closed intervals; open ones count as
    no use. A bucket with fewer than ``min_alive`` known intervals takes the previous one."""
    row: list[float] = []
    for ab in range(AGE_BUCKETS):
        lo = 0 if ab == 0 else 1 << (ab - 1)
        known = starts <= now - lo - horizon
        alive = int(np.count_nonzero(known & (gaps > lo)))
        used = int(np.count_nonzero(known & (gaps > lo) & (gaps <= lo + horizon)))
        alive += int(np.count_nonzero(open_starts <= now - lo - horizon))
        row.append((used + 0.2) / (alive + 1.0) if alive >= min_alive or not row else row[-1])
    return row


class Online(Table):
    """The table estimated from the past only; ``fitted`` is the same over the whole trace."""

    def __init__(self, horizon: int, refresh: int = 50) -> None:
        super().__init__({})
        self.horizon = horizon
        self.refresh = refresh
        self.starts: dict[object, list[int]] = defaultdict(list)
        self.gaps: dict[object, list[int]] = defaultdict(list)
        self.open: dict[object, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.built_at = -(1 << 30)

    def opened(self, b: Block, now: int) -> None:
        self.open[b.cls][now] += 1

    def closed(self, b: Block, now: int) -> None:
        self.open[b.cls][b.stamp] -= 1
        self.starts[b.cls].append(b.stamp)
        self.gaps[b.cls].append(now - b.stamp)

    def rank(self, b: Block, now: int) -> tuple:
        if now - self.built_at >= self.refresh:
            self.rebuild(now)
        return super().rank(b, now)

    def rebuild(self, now: int) -> None:
        self.built_at = now
        table = {}
        for cls in set(self.starts) | set(self.open):
            opened = [t for t, n in self.open[cls].items() for _ in range(n)]
            table[cls] = table_from_intervals(
                np.asarray(self.starts[cls], dtype=np.int64),
                np.asarray(self.gaps[cls], dtype=np.int64),
                np.asarray(opened, dtype=np.int64),
                now,
                self.horizon,
            )
        self.table = table


def simulate(
    chains: Sequence[list[int]],
    capacity: int,
    ranker: Ranker,
    classify: Callable[[Block], object],
    sample: int = 8,
    seed: int = 0,
    outputs: Sequence[int] | None = None,
) -> int:
    """Blocks hit; every use interval is reported to the ranker (evicted blocks are
    remembered, so a return closes its interval like a hit). ``outputs``: each request's
    output length, for the ``first_out`` of the blocks it caches first."""
    rng = random.Random(seed)
    cached: dict[int, Block] = {}
    remembered: dict[int, Block] = {}
    parent: dict[int, int | None] = {}
    children: dict[int, int] = {}
    leaves: list[int] = []
    slot: dict[int, int] = {}

    def add_leaf(b: int) -> None:
        slot[b] = len(leaves)
        leaves.append(b)

    def drop_leaf(b: int) -> None:
        i = slot.pop(b)
        last = leaves.pop()
        if last != b:
            leaves[i] = last
            slot[last] = i

    def use(b: Block, now: int) -> None:
        ranker.closed(b, now)
        b.uses += 1
        b.gap = now - b.stamp
        b.stamp = now
        b.cls = classify(b)
        ranker.opened(b, now)

    hits = 0
    for now, chain in enumerate(chains):
        n = len(chain)
        k = 0
        while k < n and chain[k] in cached:
            k += 1
        hits += k
        for j in range(k):
            use(cached[chain[j]], now)
        held = set(chain)
        need = len(cached) + n - k - capacity
        while need > 0:
            m = len(leaves)
            pool = [leaves[rng.randrange(m)] for _ in range(sample)] if m > sample else leaves
            pool = [b for b in pool if b not in held] or [b for b in leaves if b not in held]
            victim = min(pool, key=lambda b: ranker.rank(cached[b], now))
            drop_leaf(victim)
            state = cached.pop(victim)
            ranker.evicted(state, now)
            remembered[victim] = state
            up = parent[victim]
            if up is not None:
                children[up] -= 1
                if children[up] == 0 and up in cached:
                    add_leaf(up)
            need -= 1
        prev = chain[k - 1] if k else None
        if prev is not None and k < n and prev in slot:
            drop_leaf(prev)
        for j in range(k, n):
            b = chain[j]
            state = remembered.pop(b, None)
            if state is None:
                state = Block(now, n, outputs[now] if outputs else 0)
                state.cls = classify(state)
                ranker.opened(state, now)
            else:
                use(state, now)
            cached[b] = state
            children[b] = 0
            parent[b] = prev
            if prev is not None:
                children[prev] += 1
            prev = b
        if k < n:
            add_leaf(chain[-1])
    return hits


def fitted_table(
    chains: Sequence[list[int]],
    classify: Callable[[Block], object],
    horizon: int,
    outputs: Sequence[int] | None = None,
) -> dict[object, list[float]]:
    """The table over the whole trace: every use interval of every block, classified by
    the state the block had when the interval opened."""
    starts: dict[object, list[int]] = defaultdict(list)
    gaps: dict[object, list[int]] = defaultdict(list)
    opened: dict[object, list[int]] = defaultdict(list)
    state: dict[int, Block] = {}
    for now, chain in enumerate(chains):
        for b in chain:
            st = state.get(b)
            if st is None:
                st = state[b] = Block(now, len(chain), outputs[now] if outputs else 0)
            else:
                starts[st.cls].append(st.stamp)
                gaps[st.cls].append(now - st.stamp)
                st.uses += 1
                st.gap = now - st.stamp
                st.stamp = now
            st.cls = classify(st)
    for st in state.values():
        opened[st.cls].append(st.stamp)
    end = len(chains) + horizon  # every interval's outcome is known at the end
    return {
        cls: table_from_intervals(
            np.asarray(starts[cls], dtype=np.int64),
            np.asarray(gaps[cls], dtype=np.int64),
            np.asarray(opened[cls], dtype=np.int64),
            end,
            horizon,
        )
        for cls in set(starts) | set(opened)
    }


def drift(
    chains: Sequence[list[int]],
    capacity: int,
    total: int,
    horizon: int,
    sample: int,
    seeds: int,
    outputs: Sequence[int] | None = None,
) -> int:
    """Whether what a table learns early still holds later: the online ``uses`` table as
    known at requests 1,000 / 2,000 / 3,000 / the end (age bucket 0, i.e. P(next use within
    ``horizon`` | uses)) and each snapshot fixed for the whole replay; then, per quarter of
    the trace and class of the first request's length (and of its output length), how
    often a new block is used again within 300 requests and at all."""
    marks = [t for t in (1000, 2000, 3000) if t < len(chains)]
    snaps: dict[object, dict[object, list[float]]] = {}

    class Snapshots(Online):
        def rebuild(self, now: int) -> None:
            super().rebuild(now)
            for t in marks:
                if t not in snaps and now >= t:
                    snaps[t] = dict(self.table)

    classify = CLASSES["uses"]
    learner = Snapshots(horizon)
    online = simulate(chains, capacity, learner, classify, sample, 0) / total
    learner.rebuild(len(chains) + horizon)
    snaps["end"] = learner.table
    print(f"online:uses {100 * online:.2f}% (seed 0)")
    print(
        f"{'table known at':>14} "
        + " ".join(f"{'uses=' + str(u):>7}" for u in range(1, 6))
        + f" {'fixed, hit %':>13}"
    )
    for t, table in snaps.items():
        cells = [table.get(u) for u in range(1, 6)]
        hit = (
            sum(simulate(chains, capacity, Table(table), classify, sample, s) for s in range(seeds))
            / seeds
            / total
        )
        print(
            f"{t!s:>14} "
            + " ".join(f"{'-' if c is None else format(c[0], '.2f'):>7}" for c in cells)
            + f" {100 * hit:13.2f}"
        )
    first: dict[int, int] = {}
    length: dict[int, int] = {}
    again: dict[int, int] = {}
    for now, chain in enumerate(chains):
        for b in chain:
            if b not in first:
                first[b], length[b] = now, len(chain)
            elif b not in again:
                again[b] = now
    by_length = {b: length[b] for b in first}
    _reuse_by_quarter("first length", first, again, by_length, len(chains), 7)
    if outputs:
        by_output = {b: outputs[t] for b, t in first.items()}
        what = "first request's output length"
        _reuse_by_quarter(what, first, again, by_output, len(chains), 9)
    return 0


def _reuse_by_quarter(
    what: str,
    first: dict[int, int],
    again: dict[int, int],
    size: dict[int, int],
    n: int,
    top: int,
) -> None:
    """How often a new block is used again within 300 requests / ever, per quarter of the
    trace and log2 class of ``size`` (a number known of each block when it is cached;
    classes from ``2**top`` up are one)."""
    counts: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0, 0])
    for b, t in first.items():
        row = counts[(t * 4 // n, min(max(age_bucket(size[b]) - 1, 0), top))]
        row[0] += 1
        if b in again:
            row[1] += again[b] - t <= 300
            row[2] += 1
    print(f"new blocks used again within 300 requests / ever, by quarter and {what}")
    classes = sorted({c for _, c in counts})
    print(f"{'quarter':>7} " + " ".join(f"{'>=' + str(1 << c):>11}" for c in classes))
    for q in range(4):
        cells = []
        for c in classes:
            m, soon, ever = counts.get((q, c), (0, 0, 0))
            cells.append(f"{soon / m:.2f}/{ever / m:.2f}" if m else "-")
        print(f"{q:>7} " + " ".join(f"{c:>11}" for c in cells))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--device", type=float, default=5.0, help="capacity, %% of unique blocks")
    p.add_argument("--horizon", type=int, default=100, help="requests (the table's H)")
    p.add_argument("--sample", type=int, default=8)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--classes", default="uses,uses+length,uses+gap")
    p.add_argument(
        "--drift",
        action="store_true",
        help="print how the online table and new blocks' first reuse change along the trace",
    )
    args = p.parse_args(argv)

    trace = load_trace(args.trace)
    chains = [list(r.hash_ids) for r in trace]
    outputs = [r.output_length for r in trace]
    total = sum(len(c) for c in chains)
    capacity = max(1, round(args.device / 100 * unique_blocks(trace)))
    if args.drift:
        return drift(chains, capacity, total, args.horizon, args.sample, args.seeds, outputs)
    optimum = optimal_hits(page_chains(trace, BlockShape()), capacity) / total
    print(
        f"{len(chains)} requests, {total} blocks, device {args.device:g}% = {capacity} blocks, "
        f"optimum {100 * optimum:.2f}%, horizon {args.horizon} requests"
    )
    print(f"{'ranker':28} {'hit %':>8} {'of optimum':>11} {'s':>6}")

    def row(name: str, make: Callable[[], Ranker], classify: Callable[[Block], object]) -> None:
        t0 = time.perf_counter()
        ratios = [
            simulate(chains, capacity, make(), classify, args.sample, seed, outputs) / total
            for seed in range(args.seeds)
        ]
        mean = sum(ratios) / len(ratios)
        print(
            f"{name:28} {100 * mean:8.2f} {mean / optimum:11.3f} {time.perf_counter() - t0:6.1f}",
            flush=True,
        )

    row("lru", LRU, CLASSES["uses"])
    row("rule", Rule, CLASSES["uses"])
    for name in args.classes.split(","):
        classify = CLASSES[name]
        fitted = fitted_table(chains, classify, args.horizon, outputs)
        row(f"fitted:{name}", lambda f=fitted: Table(f), classify)
        half = len(chains) // 2
        for part, cut in (("first", slice(None, half)), ("second", slice(half, None))):
            table = fitted_table(chains[cut], classify, args.horizon, outputs[cut])
            row(f"{part}-half:{name}", lambda f=table: Table(f), classify)
        learner = Online(args.horizon)
        simulate(chains, capacity, learner, classify, args.sample, 0, outputs)
        learner.rebuild(len(chains) + args.horizon)
        row(f"online:{name}", lambda: Online(args.horizon), classify)
        row(f"final:{name}", lambda t=learner.table: Table(t), classify)
    return 0


if __name__ == "__main__":
    sys.exit(main())
