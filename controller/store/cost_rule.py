"""Never slower than recompute: a lookup offers a lower tier's pages only where loading
them beats computing them again.

* :class:`ReadCost` keeps what a tier's reads cost, measured on its own reads: seconds per
  byte of one reader (a moving average over read batches, each page's fixed cost
  included) and how many readers run at once. The disk tier feeds it every batch.
* :class:`CostRule` holds each engine's prefill rate (tokens per second, reported by the
  engine with its lookups) and cuts a looked-up chain where the run of pages that only a
  lower tier holds would take longer to load than the engine takes to compute those
  tokens. The cut pages are reported absent (the engine recomputes them) and counted as
  ``slower_than_recompute`` misses of that tier. No rate reported, or no read measured
  yet: nothing is cut. ``cost_rule = false`` turns it off.

Loading a run costs ``bytes × seconds_per_byte / readers`` (its batches are read in
parallel); computing it ``tokens / rate``. Both grow with the run, so a run that is worth
loading is worth loading whole: the rule keeps or cuts each run after the host pages.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hicache.controller.store.miss_reasons import MissReason
from hicache.controller_api import P_ABSENT, P_DISK, P_HOST, P_REMOTE
from hicache.types import ComponentType, Tier

__all__ = ["CostRule", "ReadCost"]

_SMOOTHING = 0.25  # weight of the newest batch in the moving average
_TIER_OF = {P_DISK: Tier.DISK, P_REMOTE: Tier.REMOTE}


class ReadCost:
    """What reading from one tier costs, measured (see the module docstring)."""

    def __init__(self, readers: int) -> None:
        self.readers = max(1, readers)
        self.seconds_per_byte: float | None = None  # one reader's; None: nothing read yet
        self._lock = threading.Lock()

    def observe(self, nbytes: int, seconds: float) -> None:
        """One reader read ``nbytes`` in ``seconds`` (a batch, checks included)."""
        if nbytes <= 0 or seconds <= 0:
            return
        s = seconds / nbytes
        with self._lock:
            old = self.seconds_per_byte
            self.seconds_per_byte = s if old is None else old + _SMOOTHING * (s - old)

    def seconds(self, nbytes: int) -> float | None:
        """How long reading ``nbytes`` takes with every reader at work; None: unknown."""
        s = self.seconds_per_byte
        return None if s is None else nbytes * s / self.readers

    def stats(self) -> dict[str, float | None]:
        s = self.seconds_per_byte
        return {"read_bytes_per_s": None if not s else round(self.readers / s)}


class CostRule:
    """Cuts looked-up chains where recomputing is faster (see the module docstring)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._rates: dict[str, float] = {}

    def report_rate(self, engine_id: str, tokens_per_s: float | None) -> None:
        """``engine_id`` prefills this many tokens per second (None: forget it)."""
        if tokens_per_s is None or not tokens_per_s > 0:
            self._rates.pop(engine_id, None)
        else:
            self._rates[engine_id] = float(tokens_per_s)

    def forget(self, engine_id: str) -> None:
        self._rates.pop(engine_id, None)

    def apply(
        self,
        engine_id: str,
        rows: dict[ComponentType, list[int]],
        page_tokens: int,
        page_bytes: dict[ComponentType, int],
        cost: Callable[[Tier], ReadCost | None],
        count: Callable[[MissReason, Tier, ComponentType, int], None],
    ) -> None:
        """Cut ``rows`` (presence per component, one entry per page) where the engine
        would wait longer for a lower tier than it would compute; ``count`` the pages cut,
        per tier and component."""
        rate = self._rates.get(engine_id)
        if not self.enabled or rate is None or not rows:
            return
        n = min(len(r) for r in rows.values())
        i = 0
        while i < n:
            where = [r[i] for r in rows.values()]
            if any(p == P_ABSENT for p in where):
                return  # the engine's hit ends here anyway
            if all(p == P_HOST for p in where):
                i += 1
                continue
            # A run of pages some component of which only a lower tier holds.
            tier = _TIER_OF.get(next(p for p in where if p != P_HOST))
            start, nbytes = i, 0
            while i < n:
                col = [r[i] for r in rows.values()]
                if any(p == P_ABSENT for p in col) or all(p == P_HOST for p in col):
                    break
                if _TIER_OF.get(next(p for p in col if p != P_HOST)) is not tier:
                    break
                nbytes += sum(page_bytes.get(c, 0) for c, r in rows.items() if r[i] != P_HOST)
                i += 1
            measured = cost(tier) if tier is not None else None
            load_s = None if measured is None else measured.seconds(nbytes)
            if load_s is not None and load_s > (i - start) * page_tokens / rate:
                self._cut(rows, start, n, tier, count)
                return

    @staticmethod
    def _cut(
        rows: dict[ComponentType, list[int]],
        start: int,
        n: int,
        tier: Tier,
        count: Callable[[MissReason, Tier, ComponentType, int], None],
    ) -> None:
        """Report every page from ``start`` on absent; count those a tier held."""
        for comp, row in rows.items():
            held = sum(1 for p in row[start:n] if p != P_ABSENT)
            row[start:n] = [P_ABSENT] * (n - start)
            if held:
                count(MissReason.SLOWER_THAN_RECOMPUTE, tier, comp, held)
