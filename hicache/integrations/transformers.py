"""Prefix-cached greedy generation for a ``transformers`` causal LM, hybrid or not.

:class:`PrefixCachedLM` serves requests with a model built by transformers 5.x over a
:class:`~hicache.UnifiedRadixCache` (device pools on the model's device) and any
controller (``None``, :class:`~hicache.controller.store.local.LocalController`,
:class:`~hicache.controller.client.sidecar_client.SidecarController`). Per request:

1. the longest cached prefix of the prompt but its last token is matched, and loaded back
   when it lies on the host or disk tier;
2. the prefix is restored into a fresh transformers cache object
   (:class:`~hicache.integrations.transformers_state.CacheCodec`) and only the rest is
   computed, in chunks that end on a fixed grid of ``chunk_tokens`` positions, and for
   Mamba layouts also on the last page boundary before the end: the recurrent state is
   checkpointed at every page boundary a chunk or a decode step reaches;
3. greedy decode, one token per step; :meth:`PrefixCachedLM.generate_batch` decodes
   requests of equal length as one batch (transformers' hybrid caches cannot pad a
   recurrent state, so requests of different lengths decode apart);
4. what was computed (prompt and every generated token but the last) is cached.

The computed suffix of each prompt (the part after the layer-wise first chunk, where that
runs) is timed, and the engine's prefill rate measured from it goes to the controller
for its cost rule (``prefill_meter``: hicache/prefill_rate.py).

A restored prefix holds the very bytes the live cache object held, so the continuation is
bit-identical to one from the live object; against a one-shot prefill of the whole prompt
the logits differ by the reordering of sums that chunking brings (Mamba2 chunked scans).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache import (
    CacheConfig,
    CacheController,
    ConfigError,
    DevicePools,
    LayeredLoadBack,
    PoolExhaustedError,
    PrefillMeter,
    Request,
    UnifiedRadixCache,
    request_namespace,
)
from hicache.integrations.transformers_identity import model_identity, weights_digest
from hicache.integrations.transformers_layerwise import (
    decoder_layers,
    layer_groups,
    layered_chunk,
)
from hicache.integrations.transformers_layout import HFLayerMap, hf_layout
from hicache.integrations.transformers_state import (
    CacheCodec,
    check_live_cache,
    observed_states,
)


@dataclass
class GenerationResult:
    """What one request produced and what the cache saved it.

    ``logits`` are float32 ``[vocab]`` logits of each generated token's position (kept
    with ``keep_logits``); ``ttft_s`` is the time from admission to the first token, of
    which ``match_s`` went to matching (with a controller: its lookup), ``load_back_s``
    to loading from the host or disk tier and ``restore_s`` to building the model's
    cache object from the pools.
    """

    output_ids: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    computed_tokens: int = 0
    ttft_s: float = 0.0
    match_s: float = 0.0
    load_back_s: float = 0.0
    restore_s: float = 0.0

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.disk_hit_tokens


def cache_keyword(model: Any) -> str:
    """The keyword the model's forward takes its cache object by: ``cache`` in current
    transformers, ``past_key_values`` (``cache_params`` for pure Mamba models) in older
    ones. A wrong keyword is silently ignored there (the model recomputes), so it is
    looked up, never guessed."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values", "cache_params"):
        if name in params:
            return name
    raise ConfigError(f"{type(model).__name__}.forward takes no cache object")


class PrefixCachedLM:
    """A transformers causal LM that reuses cached prefixes (see the module doc)."""

    def __init__(
        self,
        model: Any,
        cache: UnifiedRadixCache,
        hf_map: HFLayerMap,
        chunk_tokens: int = 64,
        keep_logits: bool = True,
        layerwise: bool | None = None,
        layer_group_size: int = 1,
    ) -> None:
        ps = cache.page_size
        check_chunk_tokens(chunk_tokens, ps)
        self.model = model
        self.cache = cache
        self.map = hf_map
        self.page_size = ps
        self.chunk_tokens = chunk_tokens
        self.keep_logits = keep_logits
        self.codec = CacheCodec(model.config, hf_map, cache.pools)
        self.device = cache.pools.full.buffer.device
        self._kw = cache_keyword(model)
        self._has_mamba = bool(hf_map.mamba)
        # Host hits loaded layer by layer while the suffix's first chunk computes
        # (transformers_layerwise.py), in groups of ``layer_group_size`` layers. None: on
        # a GPU, where it was measured faster than a whole load (docs/performance.md,
        # "Layer-wise load-back"), off on a CPU, where its copy thread shares the cores.
        if layerwise is None:
            layerwise = self.device.type == "cuda"
        self.layer_groups = layer_groups(hf_map, layer_group_size) if layerwise else None
        self.decoder_layers = decoder_layers(model) if layerwise else None  # checked now
        # The engine's prefill rate, measured on each prompt's computed suffix and handed
        # to the controller for its cost rule (hicache/prefill_rate.py).
        self.prefill_meter = PrefillMeter(cache.controller)
        self._rids = 0
        self._closed = False

    @classmethod
    def build(
        cls,
        model: Any,
        page_size: int = 16,
        full_slots: int = 4096,
        mamba_slots: int = 64,
        controller: CacheController | None = None,
        chunk_tokens: int = 64,
        keep_logits: bool = True,
        model_id: str | None = None,
        layerwise: bool | None = None,
        **config: Any,
    ) -> PrefixCachedLM:
        """Pools on the model's device sized as given, a cache over ``controller``.

        One probe forward of a single token checks the layout against the model's own
        cache object and takes the Mamba states' dtypes from it. The layout's model id is
        the model's identity (name, revision, config and weights digests, and
        ``model_id`` where given: see :mod:`~hicache.integrations.transformers_identity`),
        so another model's pages are never served. ``config`` goes to
        :class:`CacheConfig` (e.g. ``shared_memory=True`` for a sidecar on the CPU).
        When the controller refuses the layout (or anything else fails), the pools are
        freed before the error propagates.
        """
        check_chunk_tokens(chunk_tokens, page_size)
        device = next(model.parameters()).device
        hf_map = probe_layout(model, model_id)
        cfg = CacheConfig(
            page_size=page_size,
            sliding_window=hf_map.cache_sliding_window,
            full_slots=full_slots,
            mamba_slots=mamba_slots if hf_map.mamba else 0,
            device=str(device),
            **config,
        )
        pools = DevicePools.allocate(hf_map.layout, cfg)
        try:
            cache = UnifiedRadixCache(hf_map.layout, cfg, pools, controller=controller)
            return cls(model, cache, hf_map, chunk_tokens, keep_logits, layerwise)
        except BaseException:
            pools.close()
            raise

    def close(self, close_controller: bool = True) -> None:
        """Wait for pending backups, close the controller (a sidecar client: the sidecar
        releases this engine's pins; a LocalController: its disk writes finish) unless
        ``close_controller`` is False (one shared with other engines), and free the
        pools' shared memory. The object is unusable afterwards; a second call does
        nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.cache.flush_backups()
        finally:
            if close_controller and self.cache.controller is not None:
                self.cache.controller.close()
            self.cache.pools.close()

    def __enter__(self) -> PrefixCachedLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the model -----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, hf_cache: Any) -> torch.Tensor:
        """Logits (float32) of the last position of each row of ``ids [batch, tokens]``."""
        out = self.model(
            input_ids=ids.to(self.device), use_cache=True, logits_to_keep=1, **{self._kw: hf_cache}
        )
        return out.logits[:, -1].float()

    def chunk_ends(self, start: int, end: int) -> list[int]:
        """Where the chunks computing tokens ``start .. end-1`` end: on the grid of
        ``chunk_tokens`` positions, at ``end``, and (Mamba layouts) at the last page
        boundary before ``end``, so that a state exists there to cache."""
        ends, pos, c = [], start, self.chunk_tokens
        last_page = end - end % self.page_size
        while pos < end:
            nxt = min(end, (pos // c + 1) * c)
            if self._has_mamba and nxt == end and pos < last_page < end:
                nxt = last_page
            ends.append(nxt)
            pos = nxt
        return ends

    @torch.inference_mode()
    def reference(
        self, prompt_ids: Any, max_new_tokens: int, prefix_len: int = 0
    ) -> list[torch.Tensor]:
        """The same arithmetic as :meth:`generate` on one live cache object, no pools:
        ``prompt[:prefix_len]`` is computed as a request of that prompt would compute it,
        then the rest as a request that matched that prefix would. Returns the logits of
        each generated token's position: what a restored prefix must reproduce exactly."""
        seq = _token_list(prompt_ids)
        hf = self.codec.new_cache()
        logits = None
        for start, stop in ((0, prefix_len), (prefix_len, len(seq))):
            pos = start
            for end in self.chunk_ends(start, stop):
                logits = self.forward(torch.tensor([seq[pos:end]]), hf)
                self.codec.trim_sliding(hf)
                pos = end
        out = [logits[0]]
        for _ in range(max_new_tokens - 1):
            logits = self.forward(logits.argmax(dim=-1, keepdim=True), hf)
            self.codec.trim_sliding(hf)
            out.append(logits[0])
        return out

    # -- requests ------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: Any,
        max_new_tokens: int,
        extra_key: str | None = None,
        use_cache: bool = True,
        tenant: str | None = None,
    ) -> GenerationResult:
        """Greedy-decode ``max_new_tokens`` after ``prompt_ids`` (with ``use_cache=False``
        nothing is matched or cached: the baseline).

        ``tenant`` and ``extra_key`` (e.g. an adapter's name) name the request's namespace
        (:func:`request_namespace`): a page cached in one namespace is never matched in
        another, on any tier."""
        return self.generate_batch([prompt_ids], max_new_tokens, extra_key, use_cache, tenant)[0]

    def generate_batch(
        self,
        prompts: list[Any],
        max_new_tokens: int,
        extra_key: str | None = None,
        use_cache: bool = True,
        tenant: str | None = None,
    ) -> list[GenerationResult]:
        """:meth:`generate` for several prompts of one namespace: each is admitted and
        prefilled in turn, then requests of equal length decode together, one batch per
        length."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        extra_key = request_namespace(extra_key, tenant)
        runs = [_Run(_token_list(p)) for p in prompts]
        capacity = self.cache.pools.full.capacity
        for run in runs:
            if len(run.sequence) + max_new_tokens - 1 > capacity:
                raise ValueError(
                    f"a request of {len(run.sequence)} prompt and {max_new_tokens} new tokens "
                    f"needs more token slots than the device pool's {capacity}; give the "
                    "cache more full_slots"
                )
        try:
            for run in runs:
                self._admit(run, extra_key, use_cache)
                run.logits = self._prefill(run, use_cache)
                run.result.ttft_s = time.perf_counter() - run.started
            groups: dict[int, list[_Run]] = {}
            for run in runs:
                groups.setdefault(len(run.sequence), []).append(run)
            for group in groups.values():
                self._decode_group(group, max_new_tokens, use_cache)
        finally:
            for run in runs:
                if run.req is not None and not run.req.finished:
                    self.cache.cache_finished_req(run.req, insert=use_cache and run.done)
        return [run.result for run in runs]

    def _admit(self, run: _Run, extra_key: str | None, use_cache: bool) -> None:
        self._rids += 1
        req = run.req = Request(f"hf-{self._rids}", extra_key)
        run.started = time.perf_counter()
        run.result.prompt_tokens = len(run.sequence)
        if not use_cache:
            self.cache.match_prefix(np.zeros(0, dtype=np.int64), extra_key, req=req)
            run.hf = self.codec.new_cache()
            return
        m = self.cache.match_prefix(run.sequence[:-1], extra_key, req=req)
        run.result.match_s = time.perf_counter() - run.started
        run.result.device_hit_tokens = m.prefix_len
        if m.load_node is not None and self.layer_groups is not None:
            t0, run.host_hit_len = time.perf_counter(), m.host_hit_len
            run.pending = self.cache.start_load_back(m.load_node, req, self.layer_groups)
            run.result.load_back_s = time.perf_counter() - t0
            if run.pending is not None:
                return  # restored layer by layer as the first chunk computes
        elif m.load_node is not None:
            before, t0 = req.prefix_len, time.perf_counter()
            if self.cache.load_back(m.load_node, req=req):
                loaded = req.prefix_len - before
                run.result.host_hit_tokens = min(loaded, m.host_hit_len)
                run.result.disk_hit_tokens = loaded - run.result.host_hit_tokens
            run.result.load_back_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        slots = torch.from_numpy(req.kv_slots[: req.prefix_len]).to(self.device)
        run.hf = self.codec.restore(slots, req.mamba_slot)
        run.result.restore_s = time.perf_counter() - t0

    def _prefill(self, run: _Run, use_cache: bool) -> torch.Tensor:
        req, seq = run.req, run.sequence
        logits = None
        if run.pending is not None:
            logits, run.pending = layered_chunk(self, run, run.pending, use_cache), None
        meter, start = self.prefill_meter, req.computed_len
        t0 = meter.clock()
        for end in self.chunk_ends(req.computed_len, len(seq)):
            logits = self._step(run, seq[req.computed_len : end], use_cache)
            if end < len(seq) and use_cache:
                with contextlib.suppress(PoolExhaustedError):
                    self.cache.cache_unfinished_req(req)
        if len(seq) - start >= meter.min_tokens:  # timed to the end of its kernels
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            meter.observe(len(seq) - start, meter.clock() - t0)
        return logits[0]

    def _step(self, run: _Run, tokens: list[int], use_cache: bool) -> torch.Tensor:
        """Compute ``tokens`` of one request and record them in its slots."""
        req = run.req
        new = self.cache.alloc_tokens(req, len(tokens))
        logits = self.forward(torch.tensor([tokens], dtype=torch.long), run.hf)
        self._record(run, 0, run.hf, new, tokens, use_cache)
        self.codec.trim_sliding(run.hf)
        run.result.computed_tokens += len(tokens)
        return logits

    def _record(
        self, run: _Run, row: int, hf: Any, new: np.ndarray, tokens: list[int], use_cache: bool
    ) -> None:
        req = run.req
        self.codec.write_kv(hf, torch.from_numpy(new).to(self.device), row)
        req.append_tokens(tokens)
        if use_cache and self._has_mamba and req.computed_len % self.page_size == 0:
            self.codec.write_states(hf, req.mamba_slot, row)
            # Without a state slot for the copy the older checkpoint stays valid; only
            # what can be cached at the end shrinks.
            with contextlib.suppress(PoolExhaustedError):
                self.cache.checkpoint_mamba(req)
        self.cache.release_swa_outside_window(req)

    def _decode_group(self, group: list[_Run], max_new_tokens: int, use_cache: bool) -> None:
        hf = group[0].hf if len(group) == 1 else _stack_caches([r.hf for r in group])
        logits = torch.stack([r.logits for r in group])
        for step in range(max_new_tokens):
            tokens = logits.argmax(dim=-1).tolist()
            for run, tok, lg in zip(group, tokens, logits):
                run.result.output_ids.append(int(tok))
                if self.keep_logits:
                    run.result.logits.append(lg.clone())
                run.sequence.append(int(tok))
            if step == max_new_tokens - 1:
                break
            news = [self.cache.alloc_tokens(run.req, 1) for run in group]
            logits = self.forward(torch.tensor([[t] for t in tokens], dtype=torch.long), hf)
            for row, (run, new, tok) in enumerate(zip(group, news, tokens)):
                self._record(run, row, hf, new, [tok], use_cache)
                run.result.computed_tokens += 1
            self.codec.trim_sliding(hf)
        for run in group:
            run.done = True


class _Run:
    def __init__(self, sequence: list[int]) -> None:
        self.sequence = sequence
        self.req: Request | None = None
        self.hf: Any = None
        self.logits: torch.Tensor | None = None
        self.result = GenerationResult([])
        self.started = 0.0
        self.done = False
        self.pending: LayeredLoadBack | None = None  # a layer-wise load in flight
        self.host_hit_len = 0


def _token_list(ids: Any) -> list[int]:
    if isinstance(ids, torch.Tensor):
        ids = ids.reshape(-1).tolist()
    out = [int(t) for t in np.asarray(ids, dtype=np.int64).reshape(-1)]
    if not out:
        raise ValueError("the prompt is empty")
    return out


def _stack_caches(caches: list[Any]) -> Any:
    """One batched cache object from per-request ones of equal length (batch dim 0)."""
    out = caches[0]
    for j, layer in enumerate(out.layers):
        others = [c.layers[j] for c in caches]
        if getattr(layer, "keys", None) is not None and isinstance(layer.keys, torch.Tensor):
            layer.keys = torch.cat([o.keys for o in others])
            layer.values = torch.cat([o.values for o in others])
        if hasattr(layer, "conv_states"):
            for idx, t in layer.conv_states.items():
                if t is not None:
                    layer.conv_states[idx] = torch.cat([o.conv_states[idx] for o in others])
            for idx, t in layer.recurrent_states.items():
                if t is not None:
                    layer.recurrent_states[idx] = torch.cat(
                        [o.recurrent_states[idx] for o in others]
                    )
    return out


def check_chunk_tokens(chunk_tokens: int, page_size: int) -> None:
    """Raise ConfigError unless ``chunk_tokens`` is a positive multiple of ``page_size``."""
    if chunk_tokens < page_size or chunk_tokens % page_size:
        raise ConfigError(
            f"chunk_tokens={chunk_tokens} must be a positive multiple of the page size {page_size}"
        )


def probe_layout(model: Any, model_id: str | None = None) -> HFLayerMap:
    """The model's layout from its config, checked against (and with Mamba state dtypes
    taken from) its own cache object after a one-token forward. Its model id is the
    model's identity, weights included, with the user's ``model_id`` where given."""
    dtype = next(model.parameters()).dtype
    text_config = model.config.get_text_config(decoder=True)
    identity = model_identity(model.config, text_config.model_type, weights_digest(model), model_id)
    base = hf_layout(model.config, dtype=dtype, model_id=identity)
    from transformers import DynamicCache

    live = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    with torch.inference_mode():
        model(
            input_ids=torch.ones((1, 1), dtype=torch.long, device=device),
            use_cache=True,
            logits_to_keep=1,
            **{cache_keyword(model): live},
        )
    hf_map = base
    if base.mamba:
        seen = observed_states(live, base)
        names = [t.name for t in base.layout.state_tensors]
        if sorted(seen) != sorted(names):
            raise ConfigError(f"the model keeps states {sorted(seen)}, the layout {names}")
        hf_map = hf_layout(
            model.config,
            dtype=dtype,
            model_id=identity,
            state_dtypes={n: seen[n][1] for n in seen},
        )
    check_live_cache(live, hf_map)
    return hf_map
