"""hicache as SGLang's HiCache L3 storage backend: the node's sidecar behind SGLang's host tier.

SGLang loads it as a dynamic backend (docs/integrations/sglang.md)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicache",
        "module_path": "hicache.integrations.sglang", "class_name": "HiCacheSidecarStorage",
        "interface_v1": 1}'

and builds it as ``cls(storage_config, extra_config)``, then registers its host pools
(``register_mem_pool_host`` for the KV pool, ``register_mem_host_pool_v2`` for each extra
pool: Mamba, SWA) and calls ``on_host_pools_registered``, where the backend derives the
namespace from the pools, allocates its staging pages and registers with the sidecar.

Every instance of the node that runs the same model shares the sidecar's host and disk
tiers: a page one instance backed up is a hit for the others. Nothing raises into SGLang's
controller threads: a sidecar that is down or slow answers misses (``exists``) and
failures (``get``/``set``) within the client's timeouts, and a circuit breaker makes later
calls misses at once until it is back.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from hicache import ComponentType
from hicache.controller.client import SidecarClientConfig, SidecarController, StagingArea
from hicache.integrations.engine_blocks import EngineBlocks
from hicache.integrations.sglang_pages import (
    POOL_COMPONENTS,
    PageHasher,
    SGLangNamespace,
    describe_pool,
    page_bytes,
    ranks_of,
    sidecar_layout,
)
from hicache.integrations.sglang_segments import page_segments
from hicache.integrations.sglang_transfers import SidecarPages
from hicache.integrations.sglang_zero_copy import memfd_description, pool_memfd

log = logging.getLogger("hicache.integrations.sglang")
_FULL = ComponentType.FULL

# extra-config keys and their defaults (seconds, pages); docs/integrations/sglang.md
DEFAULTS: dict[str, Any] = {
    "hicache_endpoint": None,  # the sidecar's socket; None: the default socket
    "hicache_namespace": "",  # a salt: runs with different salts never share pages
    "hicache_lookup_timeout_s": 0.25,
    "hicache_request_timeout_s": 2.0,
    "hicache_load_timeout_s": 2.0,
    "hicache_backup_timeout_s": 10.0,
    "hicache_connect_timeout_s": 2.0,
    "hicache_reconnect_interval_s": 1.0,
    "hicache_staging_pages": 128,  # per call (a get and a set at once): STORAGE_BATCH_SIZE
    "hicache_zero_copy": True,  # map a memfd-allocated layer_first KV pool in the sidecar
    "hicache_engine_copies": True,  # copy pages straight to/from a local sidecar's host pages
    "hicache_settle_timeout_s": 5.0,  # wait for a zero-copy transfer given up on to end
    "hicache_read_ahead": True,  # a hit query starts reading its disk-only pages to host
    "hicache_prefill_tokens_per_s": None,  # for the sidecar's cost rule (tokens/s); None: unsent
}


def _options(storage_config: HiCacheStorageConfig, extra_config: Any) -> dict[str, Any]:
    """The backend's options: defaults, then the storage config's extra config, then the
    constructor's (SGLang passes its kwargs there, usually empty)."""
    opts = dict(DEFAULTS)
    for source in (storage_config.extra_config or {}, extra_config or {}):
        opts.update({k: v for k, v in source.items() if k in DEFAULTS})
    return opts


def _rate(value: Any) -> float | None:
    """``hicache_prefill_tokens_per_s`` as a number (None: not given)."""
    return None if value is None else float(value)


#: Server arguments besides the model's name that change the bytes of its pages (the
#: config overrides enter as a digest: a JSON document of any length).
IDENTITY_ARGS = ("revision", "quantization", "dtype", "kv_cache_dtype")


def served_model(storage_config: HiCacheStorageConfig) -> str:
    """The model as SGLang names its storage (``model_name``) and, where this process has
    SGLang's server arguments (a scheduler does; a backend driven alone does not), the
    :data:`IDENTITY_ARGS` and config overrides that also decide its pages' bytes: part of
    the namespace, so a run of another revision, quantization or dtype never shares a
    page."""
    name = str(storage_config.model_name or "")
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except (ImportError, ValueError):  # no server arguments published in this process
        return name
    overrides = str(getattr(args, "json_model_override_args", "") or "").encode()
    digest = hashlib.blake2b(overrides, digest_size=8).hexdigest()
    parts = [f"{a}={getattr(args, a, None)}" for a in IDENTITY_ARGS]
    return "|".join([name, *parts, f"overrides={digest}"])


class HiCacheSidecarStorage(HiCacheStorage):
    """A ``HiCacheStorage`` whose pages live in the node's ``hicache serve``."""

    def __init__(self, storage_config: HiCacheStorageConfig, extra_config: Any = None) -> None:
        self.storage_config = storage_config
        self.options = _options(storage_config, extra_config)
        self.counters: Counter[str] = Counter()
        self._reported: Counter[str] = Counter()  # what get_stats has reported so far
        self.mem_pool_host: Any = None
        self.registered_pools: dict[str, Any] = {}
        self.controller: SidecarController | None = None
        self.staging: StagingArea | None = None
        self.hasher: PageHasher | None = None
        self.pages: SidecarPages | None = None  # the transfers, once registered
        self.page_size = 0
        self.zero_copy = False  # the sidecar maps the KV host pool itself
        self._lock = threading.Lock()

    # -- registration --------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        name = str(host_pool_name)
        if self.controller is not None:
            log.warning(
                "host pool %r registered after the sidecar session began: its pages are misses",
                name,
            )
        self.registered_pools[name] = host_pool

    def _held_pools(self) -> dict[str, Any]:
        pools = {"kv": self.mem_pool_host}
        for name, pool in self.registered_pools.items():
            if name in POOL_COMPONENTS and name != "kv":
                pools[name] = pool
            elif name != "kv":
                log.warning("hicache holds no %r pool: its pages are misses", name)
        return pools

    def on_host_pools_registered(self) -> None:
        """Derive the namespace from the pools and register with the sidecar. Raises for a
        layout the sidecar refuses (another model served there); an unreachable sidecar is
        not an error (the client keeps trying)."""
        if self.mem_pool_host is None:
            raise ValueError("hicache: on_host_pools_registered before register_mem_pool_host")
        pools = self._held_pools()
        self.page_size = int(self.mem_pool_host.page_size)
        ns = SGLangNamespace(
            model_name=served_model(self.storage_config),
            ranks=ranks_of(self.storage_config),
            pools={name: describe_pool(pool) for name, pool in pools.items()},
            salt=str(self.options["hicache_namespace"]),
        )
        layout = sidecar_layout(ns, self.page_size)
        self.hasher = PageHasher(layout, self.page_size)
        # One get and one set (SGLang's prefetch and backup threads) stage at once.
        staging_pages = 2 * int(self.options["hicache_staging_pages"])
        self.staging = StagingArea(layout, self.page_size, staging_pages)
        o = self.options
        config = SidecarClientConfig(
            request_timeout_s=o["hicache_request_timeout_s"],
            lookup_timeout_s=o["hicache_lookup_timeout_s"],
            backup_timeout_s=o["hicache_backup_timeout_s"],
            connect_timeout_s=o["hicache_connect_timeout_s"],
            reconnect_interval_s=o["hicache_reconnect_interval_s"],
            prefill_tokens_per_s=_rate(o["hicache_prefill_tokens_per_s"]),
        )
        self.controller = SidecarController(o["hicache_endpoint"], config=config)
        fd = pool_memfd(self.mem_pool_host) if o["hicache_zero_copy"] else None
        if fd is not None and self.controller.endpoint.startswith("ipc://"):
            describe = memfd_description(
                self.controller.endpoint, self.staging.pools, layout, self.mem_pool_host, fd
            )
            self.controller.register_described(layout, self.page_size, describe)
            self.zero_copy = True
        else:
            self.controller.register(layout, self.page_size, self.staging.pools)
        self.layout = layout
        self.pages = SidecarPages(
            self.controller, self.hasher, self.staging, self.page_size, o, self.counters
        )
        if o["hicache_engine_copies"] and self.controller.endpoint.startswith("ipc://"):
            for name, pool in pools.items():
                found = page_segments(pool, page_bytes(pool))
                if found is not None:
                    component = POOL_COMPONENTS[name]
                    blocks = EngineBlocks(
                        self.controller, [found[0]], torch.device("cpu"), component
                    )
                    self.pages.copied[component] = (blocks, int(pool.page_size))
        # The sidecar's host pool mapped (and populated) now, at SGLang's start, not in its
        # first backup or prefetch (70-100 ms for 2 GiB on the 2-core dev box).
        mapped = all([blocks.available for blocks, _ in self.pages.copied.values()])
        copied = {c.name.lower() for c in self.pages.copied}
        log.info(
            "hicache L3 namespace %s (pools: %s; copied by the engine: %s%s; KV otherwise %s)",
            layout.model_id,
            ", ".join(pools),
            ", ".join(sorted(copied)) or "none",
            "" if mapped else ", host pages not mapped yet",
            "zero-copy" if self.zero_copy else "through staging",
        )

    def _pool(self, name: str) -> Any:
        return self.mem_pool_host if name == "kv" else self.registered_pools.get(name)

    # -- presence ------------------------------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading KV pages are held (those only on disk start coming to host:
        ``hicache_read_ahead``)."""
        row = self._guarded("exists", lambda: self.pages.present(keys, [_FULL], True), None)
        return 0 if row is None else _leading(row[_FULL])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix under each extra pool's hit policy (SGLang's rule: ALL_PAGES
        needs every page up to the cut, TRAILING_PAGES only the last ``len(keys)`` ones)."""
        result = self._guarded("exists", lambda: self._exists_v2(keys, pool_transfers or []), None)
        return result if result is not None else PoolTransferResult.empty()

    def _exists_v2(self, keys: list[str], transfers: list[PoolTransfer]) -> PoolTransferResult:
        comps = [ComponentType.FULL] + [
            POOL_COMPONENTS[str(t.name)] for t in transfers if str(t.name) in POOL_COMPONENTS
        ]
        present = self.pages.present(keys, comps, True)
        kv_pages = _leading(present[ComponentType.FULL])
        hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for t in transfers:
            if not restorable:
                break
            name = str(t.name)
            row = present.get(POOL_COMPONENTS.get(name), [False] * len(keys))
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = _leading(row[:kv_pages])
                pool_ok = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(t.keys) if t.keys else 1)
                pool_ok = {n for n in range(1, kv_pages + 1) if all(row[max(0, n - trailing) : n])}
                boundary = max(pool_ok, default=0)
            else:
                raise ValueError(f"hicache does not support the pool hit policy {t.hit_policy}")
            if boundary:
                hit_count[t.name] = boundary
            restorable = [p for p in restorable if p in pool_ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    # -- zero-copy by host page index ------------------------------------------------------

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        prefix = extra_info.prefix_keys if extra_info is not None else None
        return self._set_pool("kv", keys, host_indices, prefix)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._get_pool("kv", keys, host_indices)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        prefix = extra_info.prefix_keys if extra_info is not None else None
        return {
            t.name: self._set_pool(str(t.name), t.keys or [], t.host_indices, prefix)
            for t in transfers
        }

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {
            t.name: self._get_pool(str(t.name), t.keys or [], t.host_indices) for t in transfers
        }

    def _page_offsets(self, pool: Any, keys: list[str], host_indices: Any) -> list[int] | None:
        ps = int(getattr(pool, "page_size", 1) or 1)
        if host_indices is None or host_indices.numel() != len(keys) * ps:
            self.counters["bad_indices"] += 1
            log.error(
                "hicache: %d keys but %s host indices (page size %d)",
                len(keys),
                None if host_indices is None else host_indices.numel(),
                ps,
            )
            return None
        # each page's first token index (one slice, not a tensor index per key)
        return host_indices.reshape(-1)[::ps].tolist()

    def _set_pool(
        self, name: str, keys: list[str], host_indices: Any, prefix: list[str] | None
    ) -> list[bool]:
        pool = self._pool(name)
        if pool is None or name not in POOL_COMPONENTS or not keys:
            return [False] * len(keys)
        offsets = self._page_offsets(pool, keys, host_indices)
        if offsets is None:
            return [False] * len(keys)
        component = POOL_COMPONENTS[name]
        if self.pages is not None and self.pages.copies(component) is not None:
            return self._guarded(
                "set",
                lambda: self.pages.store_copied(component, keys, offsets, prefix),
                [False] * len(keys),
            )
        if name == "kv" and self.zero_copy:
            return self._guarded(
                "set", lambda: self.pages.store_direct(keys, offsets, prefix), [False] * len(keys)
            )
        pages = [pool.get_data_page(o, flat=True) for o in offsets]
        return self._guarded(
            "set",
            lambda: self.pages.store(POOL_COMPONENTS[name], keys, pages, prefix),
            [False] * len(keys),
        )

    def _get_pool(self, name: str, keys: list[str], host_indices: Any) -> list[bool]:
        pool = self._pool(name)
        if pool is None or name not in POOL_COMPONENTS or not keys:
            return [False] * len(keys)
        offsets = self._page_offsets(pool, keys, host_indices)
        if offsets is None:
            return [False] * len(keys)
        component = POOL_COMPONENTS[name]
        if self.pages is not None and self.pages.copies(component) is not None:
            return self._guarded(
                "get",
                lambda: self.pages.fetch_copied(component, keys, offsets),
                [False] * len(keys),
            )
        if name == "kv" and self.zero_copy:
            return self._guarded(
                "get", lambda: self.pages.fetch_direct(keys, offsets), [False] * len(keys)
            )
        dtype = pool.get_dummy_flat_data_page().dtype

        def deliver(i: int, data: torch.Tensor) -> None:
            pool.set_from_flat_data_page(offsets[i], data.view(dtype))

        return self._guarded(
            "get", lambda: self.pages.fetch(component, keys, deliver), [False] * len(keys)
        )

    # -- the two transfers -----------------------------------------------------------------

    def _guarded(self, what: str, fn: Callable[[], Any], fallback: Any) -> Any:
        """``fn()``, or ``fallback`` (counted, logged) for anything it raises: SGLang's
        controller threads never see an exception from the backend."""
        if self.pages is None:
            self.counters[f"{what}_before_registration"] += 1
            return fallback
        try:
            return fn()
        except Exception:
            self.counters[f"{what}_errors"] += 1
            log.exception("hicache %s failed; answering a miss", what)
            return fallback

    # -- the generic interface (a value per key, KV pages) ---------------------------------

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if not keys or values is None or len(values) != len(keys):
            return False
        return all(
            self._guarded(
                "set",
                lambda: self.pages.store(ComponentType.FULL, keys, list(values), None),
                [False],
            )
        )

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Each page into its target (a flat tensor of one page), or None when missing."""
        if not keys:
            return []
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if any(t is None for t in targets):
            targets = [
                self.mem_pool_host.get_dummy_flat_data_page() if t is None else t for t in targets
            ]

        def deliver(i: int, data: torch.Tensor) -> None:
            targets[i].view(-1).view(torch.uint8).copy_(data)

        ok = self._guarded(
            "get", lambda: self.pages.fetch(ComponentType.FULL, keys, deliver), [False] * len(keys)
        )
        return [t if hit else None for t, hit in zip(targets, ok)]

    # -- administration --------------------------------------------------------------------

    def clear(self) -> bool:
        """Drop this namespace's pages from the sidecar's host and disk tiers (through an
        admin connection: needs the sidecar's admin token, readable by its user only)."""
        from hicache.controller.client import AdminClient

        try:
            if self.pages is not None:  # a hit query's pin would keep its pages
                self.pages.hit_pins.release_all()
            admin = AdminClient(self.options["hicache_endpoint"], timeout_s=10.0)
            try:
                admin.clear(("host", "disk"), all_namespaces=False)
            finally:
                admin.close()
            return True
        except Exception as exc:
            log.error("hicache clear failed: %s", exc)
            return False

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics: pages prefetched and backed up since the last call (the
        backend's cumulative counters stay in ``counters``)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            got = self.counters["get_pages"] - self._reported["get_pages"]
            put = self.counters["set_pages"] - self._reported["set_pages"]
            self._reported.update(get_pages=got, set_pages=put)
        metrics = StorageMetrics()
        if got:
            metrics.prefetch_pgs.append(got)
        if put:
            metrics.backup_pgs.append(put)
        return metrics

    def close(self) -> None:
        """End the sidecar session and release the staging memory."""
        if self.controller is not None:
            self.controller.close()
            self.controller = None
            self.pages = None
        if self.staging is not None:
            self.staging.close()
            self.staging = None


def _leading(row: Sequence[bool]) -> int:
    for i, hit in enumerate(row):
        if not hit:
            return i
    return len(row)
