"""The worker's stores under vLLM with their host pages asked for a step ahead
(``hicache_store_ahead``).

vLLM's offloading connector learns a step's store jobs when the step's metadata is bound
(``bind_connector_metadata``), queues them once the step's forward is done
(``wait_for_save``) and submits them at the next step's start (``submit_store``). At the
bind, :meth:`StoresAhead.store_ahead` has the store thread send the ``store_begin``
requests of each job's parts (:meth:`EngineBlocks.prebook`): by the time the store runs,
the sidecar has handed its pages out, and it copies at once. A job not submitted when due
(a step later) has its pages given back, and so does every one at shutdown; at most
``store_ahead_jobs`` are outstanding. A part of
:class:`~hicache.integrations.vllm_worker.HiCacheOffloadingWorker`.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm.v1.kv_offload.base import GPULoadStoreSpec

from hicache import PageRef
from hicache.integrations.engine_block_stores import StorePrebook
from hicache.integrations.engine_blocks import EngineBlocks

log = logging.getLogger(__name__)


class StoresAhead:
    """The direct stores of :class:`HiCacheOffloadingWorker` (which sets the attributes
    below, ``_pairs`` and ``_store_refs``)."""

    blocks: EngineBlocks | None
    config: Any
    counters: Counter[str]
    namespace: Any
    _stores: ThreadPoolExecutor
    # Stores whose host pages were asked for ahead, by job id (store thread): the
    # prebook, the job's (key, group, block) pairs, its refs, the announcement it came in.
    _prebooks: dict[int, tuple[StorePrebook, list, list[PageRef], int]]
    _binds: int  # the steps whose stores were announced (vLLM's thread)

    def _pairs(self, spec: Any, keys: Sequence[bytes], blocks: Sequence[int] | None) -> Any: ...
    def _store_refs(self, pairs: list, dst: Any, slots: list[int]) -> list[PageRef]: ...

    def store_ahead(self, jobs: Sequence[tuple[int, GPULoadStoreSpec, object]]) -> None:
        """A step's store jobs this rank writes, known when its metadata is bound and
        submitted at the next step's start: their host pages are asked for now, on the
        store thread (see :meth:`_prebook`). Only where the engine copies into the shared
        host pages, and with ``store_ahead`` on."""
        if self.blocks is None or not self.config.store_ahead:
            return
        self._binds += 1
        if jobs or self._prebooks:  # else nothing to ask for or give back
            self._stores.submit(self._prebook, list(jobs), self._binds)

    def _prebook(self, jobs: list[tuple[int, GPULoadStoreSpec, Any]], bind: int) -> None:
        """On the store thread, after every store submitted before this step's metadata
        was bound: prebooks from two announcements ago or more are of jobs never
        submitted (dropped, or vLLM shut down): given back. Then up to
        ``store_ahead_jobs`` prebooks are outstanding."""
        try:
            for job_id in [j for j, e in self._prebooks.items() if e[3] <= bind - 2]:
                self._drop_prebook(job_id)
            for job_id, src, dst in jobs:
                if len(self._prebooks) >= self.config.store_ahead_jobs:
                    self.counters["store_prebook_skipped"] += 1
                    continue
                pairs = self._pairs(src, dst.keys, dst.block_indices)
                if not pairs or job_id in self._prebooks:
                    continue
                refs = self._store_refs(pairs, dst, [0] * len(pairs))
                prebook = self.blocks.prebook(refs, self.config.store_timeout_s, dst.tenant)
                if prebook is not None:
                    self._prebooks[job_id] = (prebook, pairs, refs, bind)
        except Exception as exc:
            log.error("hicache: asking a step's store pages ahead failed: %s", exc)
            self.counters["store_errors"] += 1

    def _drop_prebook(self, job_id: int) -> None:
        """Give back the pages asked for job ``job_id``, which will not be stored."""
        prebook = self._prebooks.pop(job_id)[0]
        self.blocks.give_back(prebook)
        self.counters["store_prebook_unused"] += 1
        self.counters["store_prebook_unused_pages"] += prebook.pages

    def _drop_prebooks(self) -> None:
        for job_id in list(self._prebooks):
            self._drop_prebook(job_id)

    def _store_direct(
        self, job_id: int, pairs: list[tuple[int, int, int]], dst: Any,
        released: threading.Event,
    ) -> int:  # fmt: skip
        """One copy: vLLM's blocks straight into the host pages the sidecar hands out
        (asked for a step ahead where :meth:`store_ahead` did)."""
        ahead = self._prebooks.pop(job_id, None)
        prebook = None if ahead is None else ahead[0]
        refs = self._store_refs(pairs, dst, [0] * len(pairs)) if ahead is None else ahead[2]
        groups = [pos for _, pos, _ in pairs]
        blocks = [b for _, _, b in pairs]
        before = self.blocks.begins_on_path, self.blocks.prebook_missed
        stored, no_room = self.blocks.store(
            refs, groups, blocks, self.config.store_timeout_s, released.set, dst.tenant, prebook
        )
        self.counters["store_pages"] += stored
        self.counters["store_pages_dropped_host_full"] += no_room
        self.counters["store_begins_on_path"] += self.blocks.begins_on_path - before[0]
        if prebook is not None:
            self.counters["store_prebooked"] += 1
            self.counters["store_prebooked_pages"] += prebook.pages
            self.counters["store_prebook_missed"] += self.blocks.prebook_missed - before[1]
        return stored * self.namespace.page_bytes
