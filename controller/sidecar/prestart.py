"""The sidecar's threads started before it says it is ready.

A thread pool starts a thread at the first request that finds none idle, and a worker
opens its socket to the I/O loop at the first reply it sends: both were paid by the first
requests a sidecar served, so a restarted sidecar's first load cost more than later ones.
Here every worker thread and the lane's thread start, and open their sockets, at bind.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)


def prestart(
    executor: ThreadPoolExecutor, workers: int, lane: Any, open_socket: Callable[[], object]
) -> None:
    """Run ``open_socket`` on each of ``executor``'s ``workers`` threads (held at a barrier
    until all run, so that each lands on a thread of its own) and on ``lane``'s thread."""
    barrier = threading.Barrier(workers)
    lane_done = threading.Event()

    def on_worker() -> None:
        open_socket()
        barrier.wait(10.0)

    def on_lane() -> None:  # a lane job must not raise
        try:
            open_socket()
        except Exception as exc:
            log.warning("the lane's socket could not be opened ahead: %s", exc)
        finally:
            lane_done.set()

    try:
        jobs = [executor.submit(on_worker) for _ in range(workers)]
        lane.submit("", on_lane)
        for job in jobs:
            job.result(15.0)
        lane_done.wait(15.0)
    except Exception as exc:  # an optimisation: the threads still start when first needed
        log.warning("the sidecar's threads could not be started ahead: %s", exc)
