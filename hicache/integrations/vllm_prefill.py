"""The vLLM scheduler's steps timed for the sidecar's cost rule.

vLLM reports no prefill rate, so the connector's scheduler side measures one: each step
is planned when vLLM builds the connector's metadata for it and done when the step's
connector output comes back (:class:`~hicache.StepTimer` takes out the overlap of
steps planned while another runs); a step that computed at least ``prefill_min_tokens``
prompt tokens gives a rate (all its tokens over its wall time), and the median of the
recent ones (:class:`~hicache.PrefillMeter`) goes to the scheduler's sidecar client,
which sends it with its lookups unless ``hicache_prefill_tokens_per_s`` is set.

Prompt tokens of a step: every token scheduled for a request new to it, and those of
a request that has produced no output yet (a chunked prefill going on); a preempted
request computing its output again is not counted. Nothing here raises into vLLM: a
scheduler output of another shape turns the measurement off, logged once.
"""

from __future__ import annotations

import logging
from typing import Any

from hicache import PrefillMeter, StepTimer

log = logging.getLogger(__name__)

__all__ = ["StepRate", "step_tokens"]


def step_tokens(scheduler_output: Any) -> tuple[int, int]:
    """(tokens scheduled, prompt tokens among them) of one vLLM ``SchedulerOutput``."""
    counts = scheduler_output.num_scheduled_tokens
    prompt = sum(counts.get(r.req_id, 0) for r in scheduler_output.scheduled_new_reqs)
    cached = scheduler_output.scheduled_cached_reqs
    prompt += sum(
        counts.get(rid, 0)
        for rid, produced in zip(cached.req_ids, cached.num_output_tokens, strict=True)
        if produced == 0
    )
    return scheduler_output.total_num_scheduled_tokens, prompt


class StepRate:
    """The scheduler's steps, timed into ``client``'s measured prefill rate."""

    def __init__(self, client: Any, min_tokens: int) -> None:
        self.meter = PrefillMeter(client, min_tokens)
        self.timer = StepTimer(self.meter)
        self._off = False

    def planned(self, scheduler_output: Any) -> None:
        """vLLM built the connector's metadata of a step (it runs next)."""
        if self._off:
            return
        try:
            self.timer.planned(*step_tokens(scheduler_output))
        except (AttributeError, TypeError, ValueError) as exc:
            log.warning(
                "vLLM's scheduler output not understood (%s): prefill rate not measured", exc
            )
            self._off = True

    def finished(self) -> None:
        """A step's connector output came back."""
        if not self._off:
            self.timer.finished()
