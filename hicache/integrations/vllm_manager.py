"""The scheduler side of hicache under vLLM: lookups, pins and store plans.

``OffloadingConnector`` asks :meth:`HiCacheOffloadingManager.lookup` about one key at a
time, inside its scheduling step. The first key of a request that is not answered yet
sends one ``lookup`` for every key the request has (all groups, all TP ranks) on a
background thread and waits ``lookup_wait_ms`` for it; an answer that takes longer makes
the request wait a step (``RETRY``), and one not there after ``lookup_deadline_ms`` is a
miss. A sidecar that is down answers at once (the client's breaker is open): all misses.

A pin (on its own thread, so the step never waits for it) keeps the pages of a load in
the sidecar from ``prepare_load`` to ``complete_load``. Once answered, it names each
page's host page in the load's spec, and a worker that receives the spec with them
copies at once while it pins the pages in its own session, a pin the sidecar makes only
if this one still holds (``EngineBlocks.load_handed``); without them it pins first. A pin
that failed or expired costs a hit, never bytes.
``prepare_store`` leaves out the keys the sidecar said it holds; the sidecar's backup
skips what it holds anyway, so a stale answer costs a copy, never a page.

A request with a ``cache_salt`` is its tenant's (:func:`~hicache.integrations.vllm_pages.
tenant_label`): the connector tells this manager of each new request
(:meth:`HiCacheOffloadingManager.note_request`), its lookup names the tenant and its store
spec carries it to the worker, whose stores name it: the sidecar's per-tenant quotas and
metrics apply (docs/isolation.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    get_offload_group_idx,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hicache import P_ABSENT, P_DISK, P_HOST, P_REMOTE, ComponentType, PageKey, PinReceipt
from hicache.controller import SidecarController
from hicache.controller.client import SidecarClientConfig
from hicache.integrations.engine_blocks import HandedPages
from hicache.integrations.vllm_config import HiCacheVllmConfig
from hicache.integrations.vllm_pages import PageNamespace, tenant_label

log = logging.getLogger(__name__)

FULL = ComponentType.FULL


class HiCacheLoadSpec(LoadStoreSpec):
    """Where a load's pages are in the sidecar: the keys, in the order vLLM's destination
    blocks come (group by group, block order); and, once this manager's pin of them has
    been answered (a spec sent to the workers before that carries None), the pin and the
    host page of each page, rank by rank (rank r's page of ``keys[i]`` at
    ``r * len(keys) + i``), which the workers copy from at once."""

    def __init__(self, keys: Sequence[OffloadKey]) -> None:
        self.keys = list(keys)
        self.handed: HandedPages | None = None

    def __repr__(self) -> str:
        return f"HiCacheLoadSpec({len(self.keys)} pages)"


class HiCacheStoreSpec(LoadStoreSpec):
    """The pages a store writes: keys (group by group, block order), each with its parent
    in its group's chain (None for a group's first block) and its block index; and the
    tenant whose pages they are (None: no tenant)."""

    def __init__(
        self,
        keys: Sequence[OffloadKey],
        parents: Sequence[OffloadKey | None],
        blocks: Sequence[int],
        tenant: str | None = None,
    ) -> None:
        self.keys = list(keys)
        self.parents = list(parents)
        self.block_indices = list(blocks)
        self.tenant = tenant

    def __repr__(self) -> str:
        return f"HiCacheStoreSpec({len(self.keys)} pages)"


@dataclass(frozen=True)
class RequestTenant:
    """A request's tenant, kept in its ``ReqContext`` (``get_state``)."""

    name: str


def _tenant(req_context: ReqContext) -> str | None:
    state = req_context.get_state(RequestTenant)
    return None if state is None else state.name


# A lookup's answer per key, counted by tier (the remote tier's pages load as disk's do:
# the load's pin has the sidecar read them to host first).
_LOOKUP_COUNTER = {
    P_ABSENT: "lookup_miss", P_HOST: "lookup_host", P_DISK: "lookup_disk",
    P_REMOTE: "lookup_remote",
}  # fmt: skip


@dataclass
class _RequestLookups:
    """What the sidecar said about one request's keys (key -> tier of the slowest rank)."""

    answers: dict[OffloadKey, int] = field(default_factory=dict)
    # A load of this request failed: it is recomputed, with no more connector hits (its
    # pages may fail again, and vLLM would retry the load for ever).
    load_failed: bool = False
    pending: Future | None = None
    pending_keys: list[OffloadKey] = field(default_factory=list)
    deadline: float = 0.0


class HiCacheOffloadingManager(OffloadingManager):
    """``OffloadingManager`` over the sidecar (see the module docstring)."""

    def __init__(
        self, namespace: PageNamespace, config: HiCacheVllmConfig, groups: Sequence
    ) -> None:
        self.namespace = namespace
        self.config = config
        self.counters: Counter[str] = Counter()
        self._tokens_per_block = {g.group_id: g.tokens_per_block for g in groups}
        self._ranks = range(namespace.tp_size)
        self._requests: dict[str, _RequestLookups] = {}
        self._pins: dict[str, list[tuple[frozenset, Future]]] = {}
        self._new_pins: list[Future] = []  # since the last settle_pins
        self._arriving: dict[str, str] = {}  # req id -> tenant, until on_new_request
        self._lock = threading.Lock()
        # One thread: lookups, pins and unpins reach the sidecar in the order they were made.
        self._calls = ThreadPoolExecutor(1, thread_name_prefix="hicache-vllm-scheduler")
        base = config.engine_id or f"vllm:{time.time_ns():x}"
        self.client = SidecarController(
            config.socket,
            engine_id=f"{base}-scheduler",
            config=SidecarClientConfig(
                request_timeout_s=config.request_timeout_s,
                lookup_timeout_s=config.lookup_deadline_ms / 1000,
                connect_timeout_s=config.request_timeout_s,
                prefill_tokens_per_s=config.prefill_tokens_per_s,
            ),
        )
        self.client.attach(namespace.layout(), 1)

    # -- lookups ---------------------------------------------------------------------------

    def _presence(self, keys: list[OffloadKey], tenant: str | None) -> np.ndarray:
        """For each key, the slowest tier holding every TP rank's page (0: some rank's
        page is absent); the sidecar counts the lookup to ``tenant``."""
        hashes = [self.namespace.page_hash(k, r) for r in self._ranks for k in keys]
        rows = self.client.lookup(hashes, [FULL], tenant).presence[FULL]
        rows = rows.reshape(len(self._ranks), -1)
        absent = (rows == P_ABSENT).any(axis=0)
        tiers = np.where(absent, P_ABSENT, rows.max(axis=0))
        if self.config.read_ahead:
            try:  # the answers stand whatever becomes of the read-ahead
                self._read_ahead(hashes, rows, tiers)
            except Exception as exc:
                self.counters["read_ahead_failed"] += 1
                log.warning("hicache read-ahead failed: %s", exc)
        return tiers

    def _read_ahead(self, hashes: list[bytes], rows: np.ndarray, tiers: np.ndarray) -> None:
        """Have the sidecar start reading the pages of the request's leading hit that are
        only on disk or the remote tier (any rank's) to host, not waiting: by the time the
        load is planned and pinned they may be there (the worker then copies at once)."""
        miss = np.flatnonzero(tiers == P_ABSENT)
        lead = int(miss[0]) if miss.size else tiers.size
        slow = rows[:, :lead] >= P_DISK  # (ranks, leading keys); hashes are rank-major
        if slow.any():
            at = (np.arange(rows.shape[0])[:, None] * rows.shape[1] + np.arange(lead))[slow]
            self.client.prefetch([PageKey(FULL, hashes[i]) for i in at.tolist()])
            self.counters["read_ahead_pages"] += int(slow.sum())

    def _settle(self, state: _RequestLookups) -> None:
        """Take a finished lookup's answers, or make a late one all misses."""
        fut = state.pending
        if fut is None:
            return
        if fut.done():
            try:
                tiers = fut.result().tolist()
            except Exception as exc:  # a client bug: answer misses, never stall vLLM
                log.error("hicache lookup failed: %s", exc)
                tiers = [P_ABSENT] * len(state.pending_keys)
        elif time.monotonic() >= state.deadline:
            self.counters["lookup_deadline_misses"] += len(state.pending_keys)
            tiers = [P_ABSENT] * len(state.pending_keys)
        else:
            return
        for key, tier in zip(state.pending_keys, tiers):
            state.answers[key] = int(tier)
            self.counters[_LOOKUP_COUNTER[int(tier)]] += 1
        state.pending, state.pending_keys = None, []

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when every TP rank's page of ``key`` is in the sidecar (host or disk), MISS
        when not or when the sidecar did not answer in time, RETRY while it may still."""
        state = self._requests.setdefault(req_context.req_id, _RequestLookups())
        if state.load_failed:
            return LookupResult.MISS
        self._settle(state)
        tier = state.answers.get(key)
        if tier is None and state.pending is None:
            # Every key of the request this manager has not asked about, this one first.
            # vLLM records them all in the context before its first lookup; the context
            # has no public way to list them (vllm 0.32).
            keys = [key, *(k for k in req_context._offload_key_positions if k != key)]
            state.pending_keys = [k for k in keys if k not in state.answers]
            state.deadline = time.monotonic() + self.config.lookup_deadline_ms / 1000
            tenant = _tenant(req_context)
            state.pending = self._calls.submit(self._presence, state.pending_keys, tenant)
            wait_futures([state.pending], timeout=self.config.lookup_wait_ms / 1000)
            self._settle(state)
            tier = state.answers.get(key)
        if tier is None:
            return LookupResult.RETRY
        return LookupResult.MISS if tier == P_ABSENT else LookupResult.HIT

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        state = self._requests.get(req_context.req_id)
        tier = None if state is None else state.answers.get(key)
        if tier == P_HOST:
            return CacheHitSource.HOST
        if tier == P_DISK:
            return CacheHitSource.DISK
        return CacheHitSource.EXTERNAL_UNSPECIFIED

    def load_failed(self, req_id: str) -> None:
        """A load of ``req_id`` failed (the connector saw it): vLLM recomputes the request,
        and its lookups are misses from now on."""
        self.counters["requests_with_failed_loads"] += 1
        self._requests.setdefault(req_id, _RequestLookups()).load_failed = True

    def has_pending_work(self) -> bool:
        """True while a lookup is in flight: vLLM keeps stepping to ask again."""
        return any(s.pending is not None for s in self._requests.values())

    # -- loads ----------------------------------------------------------------------------

    def _pin(self, keys: list[OffloadKey], spec: HiCacheLoadSpec) -> PinReceipt | None:
        ns = self.namespace
        page_keys = [PageKey(FULL, ns.page_hash(k, r)) for r in self._ranks for k in keys]
        ttl = self.config.pin_ttl_s
        asked = self.client.send_pin(page_keys, ttl, host_pages=True)
        receipt = self.client.receive_pin(asked) if asked else self.client.pin(page_keys, ttl)
        self.counters["pins" if receipt is not None else "pin_failures"] += 1
        if receipt is not None and receipt.host_pages is not None:
            instance = self.client.sidecar_instance(receipt.generation)
            if instance is not None:
                spec.handed = HandedPages(
                    receipt.pin_id, instance, receipt.deadline, tuple(receipt.host_pages)
                )
        return receipt

    def _unpin(self, pinned: Future) -> None:
        receipt = pinned.result()
        if receipt is not None:
            self.client.unpin(receipt)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        ordered = list(keys)
        self.counters["loads"] += 1
        spec = HiCacheLoadSpec(ordered)
        pinned = self._calls.submit(self._pin, ordered, spec)
        with self._lock:
            self._pins.setdefault(req_context.req_id, []).append((frozenset(ordered), pinned))
            self._new_pins.append(pinned)
        return spec

    def settle_pins(self) -> None:
        """Wait, up to ``pin_wait_ms`` in all, for the pins of the loads planned since the
        last call (the connector calls this as it builds a step's metadata), so that their
        host pages go to the workers with the loads."""
        with self._lock:
            fresh, self._new_pins = self._new_pins, []
        if fresh:
            wait_futures(fresh, timeout=self.config.pin_wait_ms / 1000)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        done = frozenset(keys)
        with self._lock:
            held = self._pins.get(req_context.req_id, [])
            for i, (pinned_keys, pinned) in enumerate(held):
                if pinned_keys == done:
                    del held[i]
                    self._calls.submit(self._unpin, pinned)
                    break
            if not held:
                self._pins.pop(req_context.req_id, None)

    # -- stores ---------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Every key the sidecar was not seen holding, with its parent and block index."""
        state = self._requests.get(req_context.req_id)
        known = {} if state is None else state.answers
        to_store = [k for k in keys if known.get(k, P_ABSENT) == P_ABSENT]
        self.counters["store_skipped_held"] += len(keys) - len(to_store)
        by_position = {
            (get_offload_group_idx(k), end): k
            for k, end in req_context._offload_key_positions.items()
        }
        parents: list[OffloadKey | None] = []
        blocks: list[int] = []
        for key in to_store:
            group = get_offload_group_idx(key)
            tokens = self._tokens_per_block[group]
            end = req_context.get_offload_key_position(key) or tokens
            blocks.append(-(-end // tokens) - 1)
            parents.append(by_position.get((group, end - tokens)))
        return PrepareStoreOutput(
            keys_to_store=to_store,
            store_spec=HiCacheStoreSpec(to_store, parents, blocks, _tenant(req_context)),
            evicted_keys=[],
        )

    # -- requests -------------------------------------------------------------------------

    def note_request(self, request: Any) -> None:
        """A vLLM ``Request`` is about to reach :meth:`on_new_request` (the connector
        calls this first): its tenant, from its ``cache_salt``."""
        tenant = tenant_label(getattr(request, "cache_salt", None))
        if tenant is not None:
            self._arriving[request.request_id] = tenant

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        tenant = self._arriving.pop(req_context.req_id, None)
        if tenant is not None:
            req_context.set_state(RequestTenant(tenant))
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._requests.pop(req_context.req_id, None)

    def reset_cache(self) -> None:
        """Forget every answer (the sidecar's pages are the sidecar's to clear)."""
        self._requests.clear()

    def shutdown(self) -> None:
        with self._lock:
            pins = [p for held in self._pins.values() for _, p in held]
            self._pins.clear()
        for pinned in pins:
            self._calls.submit(self._unpin, pinned)
        self._calls.shutdown(wait=True, cancel_futures=False)
        self.client.close()
