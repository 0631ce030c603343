"""A worker thread that serves its owners in turn: the sidecar's lane for large lookups
and pins.

A lookup of many thousand hashes or a pin of many thousand keys is too long for the I/O
thread, which answers every engine's small lookups; on the shared worker pool a burst of
them would take every worker from the copies. Here they run one at a time, one request
of each owner (engine) in turn, so one engine flooding the lane delays another's large
request by at most one request of its own, and never the I/O thread by more than a chunk
of one (the handlers yield between chunks:
:func:`hicache.controller.wire.fields.yield_to_io`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable

log = logging.getLogger("hicache.sidecar")


class FairLane:
    """Jobs queued per owner, run by one thread, owners taken round-robin."""

    def __init__(self, name: str) -> None:
        self._queues: OrderedDict[str, deque[Callable[[], None]]] = OrderedDict()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, owner: str, job: Callable[[], None]) -> None:
        """Queue ``job`` behind ``owner``'s earlier ones (it must not raise)."""
        with self._cond:
            self._queues.setdefault(owner, deque()).append(job)
            self._cond.notify()

    def _next(self) -> Callable[[], None] | None:
        with self._cond:
            while not self._queues:
                if self._stopping:
                    return None
                self._cond.wait()
            owner, jobs = next(iter(self._queues.items()))
            job = jobs.popleft()
            # To the back of the turn: every other owner with work goes first.
            del self._queues[owner]
            if jobs:
                self._queues[owner] = jobs
            return job

    def _run(self) -> None:
        while (job := self._next()) is not None:
            try:
                job()
            except Exception:  # a job answers its own errors; this is a bug in one
                log.exception("a job of the fair lane failed")

    def shutdown(self, timeout_s: float) -> None:
        """Run what is queued, then stop the thread (waiting up to ``timeout_s``)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)
