"""A layer-wise load's copies, issued group of layers by group a few groups ahead of the
compute that reads them (:class:`LayerCopies`, made by
:meth:`~hicache.controller.store.transfer_engine.TransferEngine.start_layers_to_device`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from hicache.controller_api import LayerGroups, LoadResult

log = logging.getLogger("hicache.controller.transfer")


class LayerCopies:
    """A load's copies, group of layers by group (a
    :class:`~hicache.controller_api.LayerLoad`).

    On a GPU each group's copy is queued on the load stream, followed by an event:
    ``ahead`` groups at the start, and then, as the caller waits for group ``g``
    (:meth:`wait_group`), every group up to ``g + ahead``; :meth:`finish` queues the rest.
    Waiting makes the caller's stream wait for the group's event, so compute of layer ``i``
    queued after it overlaps the copies of the layers after ``i``. On a CPU a copy thread
    copies the groups in order and sets a flag per group; :meth:`wait_group` blocks until
    that group's copy has ended. A group that fails fails every later one.
    """

    def __init__(
        self, groups: LayerGroups, on_finish: Callable[[bool], None], device: torch.device
    ) -> None:
        self.groups = groups
        self.device = device
        self.events: list[Any] = []  # CUDA: one per group issued, in group order
        self._ready = [threading.Event() for _ in range(len(groups))]
        self._ended = threading.Event()
        self._failed_from = len(groups)  # the first group that failed
        self._on_finish = on_finish
        self._result: LoadResult | None = None
        # A GPU's: what issues the next group, on which stream, how far ahead.
        self._issue: tuple[Callable[[int], None], Any, int] | None = None
        self._issue_lock = threading.Lock()
        #: Host seconds from the start to the first group's copy issued and to the last's.
        self.issue_s: tuple[float, float] | None = None
        self._first_s: float | None = None
        self._t0 = time.perf_counter()

    def failed_at(self, group: int, exc: Exception) -> None:
        log.error("layer-wise load failed at layer group %d: %s", group, exc)
        self._failed_from = min(self._failed_from, group)

    def run_cpu(self, copy_group: Callable[[int], None]) -> None:
        """The copy thread's work: each group in order, its flag set as it ends."""
        try:
            for g in range(len(self.groups)):
                if g < self._failed_from:
                    try:
                        copy_group(g)
                    except Exception as exc:
                        self.failed_at(g, exc)
                self._ready[g].set()
        finally:
            for ev in self._ready:
                ev.set()
            self._ended.set()

    def issue_gpu(
        self, copy_group: Callable[[int], None], stream: torch.cuda.Stream, ahead: int
    ) -> None:
        """Start a GPU load: groups are issued by :meth:`_issue_through` on ``stream``,
        ``ahead`` of the group waited for (0: all of them now)."""
        self._issue = (copy_group, stream, ahead if ahead > 0 else len(self.groups))
        self._issue_through(self._issue[2] - 1)

    def _issue_through(self, last: int) -> None:
        """Issue every group up to ``last`` not issued yet, in order, each followed by its
        event; a group that fails ends the issuing (it and every later group fail)."""
        if self._issue is None or self._ended.is_set() or last < len(self.events):
            return
        copy_group, stream, _ = self._issue
        with self._issue_lock:
            g = len(self.events)
            last = min(last, len(self.groups) - 1)
            try:
                with torch.cuda.stream(stream):
                    while g <= last and g < self._failed_from:
                        try:
                            copy_group(g)
                        except Exception as exc:
                            self.failed_at(g, exc)
                            break
                        done = torch.cuda.Event()
                        done.record(stream)
                        self.events.append(done)
                        self._ready[g].set()
                        if self._first_s is None:
                            self._first_s = time.perf_counter() - self._t0
                        g += 1
            except Exception as exc:  # the stream or an event: nothing after it is issued
                self.failed_at(len(self.events), exc)
            if len(self.events) >= min(len(self.groups), self._failed_from):
                self.issue_s = (self._first_s or 0.0, time.perf_counter() - self._t0)
                for ev in self._ready:
                    ev.set()
                self._ended.set()

    def wait_group(self, group: int) -> bool:
        if self._issue is not None:
            self._issue_through(group + self._issue[2])
        if group >= self._failed_from:
            return False
        self._ready[group].wait()
        if group >= self._failed_from:
            return False
        if self.events:  # a GPU's: the caller's stream waits for the group's copy
            self.events[group].wait(torch.cuda.current_stream(self.device))
        return True

    def finish(self) -> LoadResult:
        if self._result is not None:
            return self._result
        self._issue_through(len(self.groups) - 1)  # what no wait has issued yet
        self._ended.wait()
        ok = self._failed_from >= len(self.groups)
        for ev in self.events:
            try:
                ev.synchronize()
            except Exception as exc:  # a device error: the copy has ended, badly
                log.error("a layer-wise copy failed: %s", exc)
                ok = False
        self._result = LoadResult.LOADED if ok else LoadResult.FAILED
        self._on_finish(ok)
        return self._result
