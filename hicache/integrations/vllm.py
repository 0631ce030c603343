"""hicache as vLLM's host and disk tier: an ``OffloadingSpec`` over the node's sidecar.

vLLM's ``OffloadingConnector`` decides, for every KV cache group (full attention, sliding
window, Mamba), which blocks to offload and which to load back; the spec here carries
those blocks to the node's ``hicache serve``:

* the scheduler's :class:`~hicache.integrations.vllm_manager.HiCacheOffloadingManager`
  answers lookups from the sidecar's index (batched per request, within a deadline; a
  miss when the sidecar is slow or down), pins pages between ``prepare_load`` and
  ``complete_load`` and leaves out of stores what the sidecar holds;
* each worker's :class:`~hicache.integrations.vllm_worker.HiCacheOffloadingWorker`
  registers a staging area with the sidecar once and moves pages by block id between
  vLLM's KV tensors and that area, for every group, Mamba state pages included.

Use it through :class:`HiCacheConnector` (an ``OffloadingConnector`` that also tells vLLM
which loads failed, so that it recomputes them, and tells the sidecar each request's
tenant, named by its ``cache_salt``)::

    --kv-transfer-config '{"kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "hicache.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {}}'

Every option (``kv_connector_extra_config``, prefixed ``hicache_``) is a field of
:class:`HiCacheVllmConfig`; docs/integrations/vllm.md explains them. With
``hicache_layerwise`` the connector also implements vLLM's layer-wise hooks: a hit is
scheduled at once and loaded inside the step that computes the rest of the prompt
(``start_load_kv`` starts every layer's copy, ``wait_for_layer_load`` waits for one
layer's, ``wait_for_save`` ends the step's loads; a failed one is reported by its blocks,
``get_block_ids_with_load_errors``, and vLLM recomputes them). The scheduler side times
vLLM's steps into the prefill rate it sends with its lookups, for the sidecar's cost
rule (:mod:`hicache.integrations.vllm_prefill`). vLLM is imported here only: ``import
hicache`` never needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    get_offloading_group_ids,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)

from hicache import ConfigError
from hicache.integrations.transformers_identity import config_digest
from hicache.integrations.vllm_config import HiCacheVllmConfig
from hicache.integrations.vllm_pages import GroupPages, PageNamespace
from hicache.integrations.vllm_prefill import StepRate

log = logging.getLogger(__name__)

# The connector hands the KV cache groups to the spec it builds (vLLM gives a spec only
# its OffloadingConfig, which has no page sizes); set only while the connector is built.
_building = threading.local()


@contextlib.contextmanager
def building_with_groups(
    groups: tuple[GroupPages, ...], model: str | None = None
) -> Iterator[None]:
    """Specs built in this thread while this is open describe their pages by ``groups``
    and name their model ``model`` (:func:`describe_model`; None: the offloading config's
    model name alone). :class:`HiCacheConnector` opens it around vLLM's construction of
    the spec."""
    _building.groups, _building.model = groups, model
    try:
        yield
    finally:
        _building.groups = _building.model = None


def describe_model(model_config: Any) -> str:
    """The model as its pages' namespace names it: vLLM's model name, and what the
    offloading config leaves out that decides the bytes of its pages: the revision, the
    quantization, the served dtype and a digest of the HF config (overrides included)."""
    hf_config = getattr(model_config, "hf_config", None)
    parts = [
        str(model_config.model),
        f"revision={model_config.revision}",
        f"quantization={model_config.quantization}",
        f"dtype={str(model_config.dtype).removeprefix('torch.')}",
        f"config={'none' if hf_config is None else config_digest(hf_config)}",
    ]
    return "|".join(parts)


def describe_groups(kv_cache_config: Any) -> tuple[GroupPages, ...]:
    """The offloaded groups of a ``KVCacheConfig`` with their layers' page bytes, as
    vLLM's offloading worker cuts them (un-padded attention pages, Mamba state pages)."""
    out = []
    for group_id in get_offloading_group_ids(kv_cache_config):
        group = kv_cache_config.kv_cache_groups[group_id]
        spec = group.kv_cache_spec
        per_layer = spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else {}
        sizes = []
        for name in group.layer_names:
            layer = per_layer.get(name, spec)
            if isinstance(layer, AttentionSpec):
                sizes.append(layer.unpadded_page_size_bytes)
            elif isinstance(layer, MambaSpec):
                sizes.append(dataclasses.replace(layer, page_size_padded=None).page_size_bytes)
            else:
                raise ConfigError(f"layer {name}: {type(layer).__name__} is not offloadable")
        kind = type(spec).__name__
        if isinstance(spec, SlidingWindowSpec):
            kind += f"({spec.sliding_window})"
        out.append(
            GroupPages(
                group_id,
                kind,
                tuple(sizes),
                event_kind=get_kv_cache_spec_kind(spec).value,
                block_size=spec.block_size,
                sliding_window=get_kv_cache_spec_sliding_window(spec),
            )
        )
    return tuple(out)


class HiCacheOffloadingSpec(OffloadingSpec):
    """The spec ``OffloadingConnector`` builds; made by :class:`HiCacheConnector`."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        groups = getattr(_building, "groups", None)
        if groups is None:
            raise ConfigError(
                "HiCacheOffloadingSpec needs the KV cache groups: use kv_connector "
                "'HiCacheConnector' from hicache.integrations.vllm"
            )
        if self.blocks_per_chunk != 1:
            raise ConfigError(
                "hicache stores one vLLM block per page: leave 'block_size' and "
                "'blocks_per_chunk' out of kv_connector_extra_config"
            )
        self.hicache = HiCacheVllmConfig.from_extra_config(self.extra_config)
        self.namespace = PageNamespace.build(
            model=getattr(_building, "model", None) or config.model.name,
            kv_dtype=config.model.dtype,
            tokens_per_block=self.tokens_per_block,
            groups=groups,
            tp_size=config.parallel.world_size,
        )
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            from hicache.integrations.vllm_manager import HiCacheOffloadingManager

            self._manager = HiCacheOffloadingManager(
                self.namespace, self.hicache, self.config.groups
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from hicache.integrations.vllm_worker import HiCacheOffloadingWorker

            self._worker = HiCacheOffloadingWorker(
                self.namespace, self.hicache, kv_caches, rank=self.config.parallel.rank
            )
        return self._worker


class HiCacheConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` with :class:`HiCacheOffloadingSpec`, which also
    reports failed loads (``failed_recving``) so that vLLM recomputes those requests
    (with ``kv_load_failure_policy = "recompute"``) instead of reading their blocks."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config
        extra.setdefault("spec_name", HiCacheOffloadingSpec.__name__)
        extra.setdefault("spec_module_path", __name__)
        if transfer.kv_load_failure_policy != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: a failed hicache load fails its request; "
                "set it to 'recompute' to recompute instead",
                transfer.kv_load_failure_policy,
            )
        model = describe_model(vllm_config.model_config)
        groups = describe_groups(kv_cache_config)
        # Layer-wise loads run inside the step; vLLM can recompute a failed one only by
        # its block ids, which name blocks of one KV cache group alone.
        self._layerwise = HiCacheVllmConfig.from_extra_config(extra).layerwise
        if self._layerwise and len(groups) != 1:
            log.warning("hicache_layerwise needs one KV cache group: whole-block loads run")
            self._layerwise = False
        self._layer_names = [
            kv_cache_config.kv_cache_groups[g.group_id].layer_names for g in groups
        ]
        self._load_errors: set[int] = set()
        with building_with_groups(groups, model):
            super().__init__(vllm_config, role, kv_cache_config)
        # The scheduler's steps timed into its client's prefill rate (vllm_prefill.py).
        self._steps: StepRate | None = None
        manager = self.connector_scheduler.manager if self.connector_scheduler else None
        options = HiCacheVllmConfig.from_extra_config(extra)
        if hasattr(manager, "client") and options.prefill_tokens_per_s is None:
            self._steps = StepRate(manager.client, options.prefill_min_tokens)

    def on_new_request(self, request: Any) -> None:
        """As the offloading connector; first tells the manager the request's tenant (its
        ``cache_salt``), which vLLM's ``ReqContext`` does not carry."""
        manager = self.connector_scheduler.manager if self.connector_scheduler else None
        if hasattr(manager, "note_request"):
            manager.note_request(request)
        super().on_new_request(request)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return HiCacheVllmConfig.from_extra_config(extra_config).layerwise

    # -- layer-wise loads (hicache_layerwise) ---------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """As the offloading connector; layer-wise, a hit is loaded inside the step that
        computes the rest of the prompt (not asynchronously, before it)."""
        hit, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return (hit, False) if self._layerwise else (hit, load_async)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """As the offloading connector, which loads into the blocks vLLM has not cached
        yet; a hit loaded inside the step has its blocks cached at once, so they are shown
        to it as not cached (the blocks of the hit are the ones past the local prefix)."""
        if self._layerwise and num_external_tokens:
            blocks = SimpleNamespace(blocks=tuple([_Uncached(b) for b in g] for g in blocks.blocks))
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """As the offloading connector; then hands the step's store jobs that this rank
        writes (vLLM's ``_is_store_writer``) to the worker, which asks for their host
        pages now: vLLM submits them at the next step's start (``hicache_store_ahead``)."""
        super().bind_connector_metadata(connector_metadata)
        worker = self.connector_worker
        transfers = None if worker is None else worker.worker
        jobs = getattr(connector_metadata, "store_jobs", None)
        if jobs is None or not hasattr(transfers, "store_ahead"):
            return
        if getattr(worker, "_is_store_writer", True):  # every step: stale ones go back
            transfers.store_ahead([(j, e.src_spec, e.dst_spec) for j, e in jobs.items()])

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        transfers = self.connector_worker.worker if self.connector_worker else None
        if self._layerwise and not transfers.enable_layerwise(self._layer_names):
            log.warning("hicache_layerwise: no layer-wise copies here; hits are recomputed")

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layerwise:
            self.connector_worker.worker.wait_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._layerwise:  # the step's forward is done: its loads end here
            self._load_errors |= self.connector_worker.worker.finish_layered()
        super().wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        manager = self.connector_scheduler.manager if self.connector_scheduler else None
        if not self._layerwise and hasattr(manager, "settle_pins"):
            manager.settle_pins()  # the loads' host pages go with them (vllm_manager.py)
        meta = super().build_connector_meta(scheduler_output)
        if self._steps is not None:  # the step runs next
            self._steps.planned(scheduler_output)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        if self._steps is not None:  # the step's output is back
            self._steps.finished()
        manager = self.connector_scheduler.manager if self.connector_scheduler else None
        if hasattr(manager, "load_failed"):
            for req_id in connector_output.failed_recving or ():
                manager.load_failed(req_id)
        super().update_connector_output(connector_output)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        worker = self.connector_worker
        # Which request each load job serves, before the base class forgets finished ones.
        load_jobs = dict(worker._load_jobs) if worker is not None else {}
        results = super().get_transfer_results(finished_req_ids)
        if self._layerwise:  # loads inside a step: their requests never waited for them
            results.finished_recving.difference_update(load_jobs.values())
        transfers = None if worker is None else worker.worker
        if transfers is not None and hasattr(transfers, "take_failed_loads"):
            for job_id in transfers.take_failed_loads():
                if job_id in load_jobs:
                    results.failed_recving.add(load_jobs[job_id])
        return results


class _Uncached:
    """A KV cache block as the offloading scheduler reads it (id, null or not), shown as
    not cached yet: where a hit loaded inside the step goes."""

    __slots__ = ("block_id", "is_null")
    block_hash = None

    def __init__(self, block: Any) -> None:
        self.block_id, self.is_null = block.block_id, block.is_null
