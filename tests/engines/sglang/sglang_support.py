"""SGLang's real objects for the suite: host pools on the CPU, storage configs, backends
built by SGLang's own factory, and SGLang's controller methods run on a stand-in.

SGLang's ``HiCacheController`` needs a device KV allocator and process groups to be
constructed; its storage methods (``_storage_hit_query``, ``_page_backup``,
``_page_transfer`` and the page get/set functions it picks at attach) need only the
attributes below, so the suite runs those very methods, unmodified, on ``ControllerShim``.
"""

from __future__ import annotations

import contextlib
import queue
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.managers.cache_controller import (
    HiCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MambaStateBufferInfo,
    MHABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolTransfer,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    HybridCacheController,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    PrefetchOperation as HybridPrefetchOperation,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    StorageOperation as HybridStorageOperation,
)
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

PAGE_SIZE = 4
LAYERS, HEADS, HEAD_DIM = 2, 2, 8
DEVICE_TOKENS = 64


def mha_host_pool(
    layout: str = "layer_first", allocator: str = "default", dtype: torch.dtype = torch.bfloat16
) -> MHATokenToKVPoolHost:
    """SGLang's MHA token-to-KV host pool over CPU "device" K/V buffers."""
    k = torch.zeros(LAYERS, DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=dtype)
    v = torch.zeros_like(k)
    ptrs = [torch.tensor([t.data_ptr() for t in x.unbind(0)]) for x in (k, v)]
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=tuple(k.unbind(0)),
            v=tuple(v.unbind(0)),
            k_data_ptrs=ptrs[0],
            v_data_ptrs=ptrs[1],
            layout=KVBufferLayout.NHD,
        ),
        page_size=PAGE_SIZE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE_SIZE,
        layout,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator,
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS,
    )


def mamba_host_pool(allocator: str = "default") -> MambaPoolHost:
    """SGLang's Mamba host pool (conv in bf16, SSM state in fp32, page_first)."""
    temporal = torch.zeros(3, 8, 4, 5, dtype=torch.float32)
    conv = (torch.zeros(3, 8, 6, 3, dtype=torch.bfloat16),)
    return MambaPoolHost(
        MambaStateBufferInfo(temporal=temporal, conv=conv),
        2.0,
        0,
        device_capacity=8,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator,
        layout="page_first",
    )


def storage_config(
    extra: dict | None = None, model: str = "org/model", tp_rank: int = 0, tp_size: int = 1
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=model,
        extra_config=extra,
    )


def hicache_extra(endpoint: str, **overrides: Any) -> dict:
    """The extra config a user passes SGLang for hicache (docs/integrations/sglang.md)."""
    return {
        "backend_name": "hicache",
        "module_path": "hicache.integrations.sglang",
        "class_name": "HiCacheSidecarStorage",
        "interface_v1": 1,
        "hicache_endpoint": endpoint,
        **overrides,
    }


def hicache_backend(
    endpoint: str, kv_pool: Any, extra_pools: dict | None = None, **overrides: Any
) -> Any:
    """hicache's backend as SGLang builds it: the dynamic factory, then the registrations."""
    config = storage_config(hicache_extra(endpoint, **overrides))
    backend = StorageBackendFactory.create_backend("dynamic", config, kv_pool)
    backend.register_mem_pool_host(kv_pool)
    for name, pool in (extra_pools or {}).items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def file_backend(path: str, kv_pool: Any, extra_pools: dict | None = None) -> HiCacheFile:
    """SGLang's reference file backend (the oracle), registered the same way."""
    backend = StorageBackendFactory.create_backend(
        "file", storage_config({"file_storage_path": path}), kv_pool
    )
    backend.register_mem_pool_host(kv_pool)
    for name, pool in (extra_pools or {}).items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def page_keys(tokens: list[int]) -> list[str]:
    """SGLang's storage keys of the whole pages of ``tokens``."""
    return get_hash_str(tokens, None, page_size=PAGE_SIZE)


class ControllerShim:
    """The attributes SGLang's HiCacheController storage methods read, and those methods."""

    _storage_hit_query = HiCacheController._storage_hit_query
    _page_backup = HiCacheController._page_backup
    _page_transfer = HiCacheController._page_transfer
    _page_transfer_kv_batch = HiCacheController._page_transfer_kv_batch
    _page_get_zero_copy = HiCacheController._page_get_zero_copy
    _page_set_zero_copy = HiCacheController._page_set_zero_copy
    _generic_page_get = HiCacheController._generic_page_get
    _generic_page_set = HiCacheController._generic_page_set

    def __init__(self, backend: Any, host_pool: Any, zero_copy: bool) -> None:
        self.storage_backend = backend
        self.mem_pool_host = self.storage_host_pool = host_pool
        self.page_size = host_pool.page_size
        self.prefetch_sync_queue: queue.Queue = queue.Queue()
        # as attach_storage_backend picks them ("interface_v1" selects the zero-copy pair)
        if zero_copy:
            self.page_get_func = self._page_get_zero_copy
            self.page_set_func = self._page_set_zero_copy
        else:
            self.page_get_func = self._generic_page_get
            self.page_set_func = self._generic_page_set

    def backup(self, host_indices: torch.Tensor, tokens: list[int]) -> int:
        """A write-through to storage, as the backup thread runs it; tokens written."""
        op = StorageOperation(host_indices, tokens, hash_value=page_keys(tokens), prefix_keys=[])
        self._page_backup(op)
        return op.completed_tokens

    def prefetch(self, tokens: list[int], host_indices: torch.Tensor) -> tuple[int, int]:
        """A prefetch as the prefetch threads run it: (tokens found, tokens loaded)."""
        op = PrefetchOperation("req", tokens, None, prefix_keys=[])
        hashes, hit_tokens = self._storage_hit_query(op)
        op.hash_value = hashes
        op.host_indices = host_indices[:hit_tokens]
        loaded_pages = self._page_transfer(op) if hashes else 0
        return hit_tokens, loaded_pages * self.page_size


def fill_pages(pool, pages: int, seed: int) -> torch.Tensor:
    """Allocate ``pages`` host pages of ``pool`` and write random bytes into them;
    returns their host indices."""
    idx = pool.alloc(pages * pool.page_size)
    gen = torch.Generator().manual_seed(seed)
    for p in range(pages):
        page = pool.get_data_page(int(idx[p * pool.page_size]), flat=True)
        data = torch.randint(
            0, 255, (page.numel() * page.element_size(),), generator=gen, dtype=torch.uint8
        )
        pool.set_from_flat_data_page(int(idx[p * pool.page_size]), data.view(page.dtype))
    return idx


def host_page_bytes(pool, idx: torch.Tensor, pages: int) -> list[bytes]:
    """The bytes of the first ``pages`` host pages at ``idx``, as SGLang's file backend
    stores them."""
    ps = pool.page_size
    return [
        bytes(
            pool.get_data_page(int(idx[p * ps]), flat=True).contiguous().view(torch.uint8).numpy()
        )
        for p in range(pages)
    ]


class _HostPoolGroup:
    """What the hybrid controller's storage methods read of its host pool group: the
    pools by name, and the layout lease (a no-op on a pool whose layout never changes)."""

    def __init__(self, kv_pool: Any, extra: dict) -> None:
        self.kv_pool = kv_pool
        self.entry_map = {name: SimpleNamespace(host_pool=pool) for name, pool in extra.items()}

    def layout_lease(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class HybridControllerShim(HybridCacheController):
    """SGLang's HybridCacheController with its constructor skipped (it needs device pools
    and process groups): the attributes its storage methods read are set here, and its
    own methods run unmodified (``_storage_hit_query``, ``_page_backup_with_stable_layout``,
    ``_page_transfer_with_stable_layout``, and the base controller's through ``super()``)."""

    def __init__(self, backend: Any, kv_pool: Any, extra_pools: dict, zero_copy: bool) -> None:
        self.storage_backend = backend
        self.storage_backend_type = "dynamic"
        self.storage_config = storage_config()
        self.mem_pool_host = _HostPoolGroup(kv_pool, extra_pools)
        self.storage_host_pool = kv_pool
        self.page_size = kv_pool.page_size
        self.prefetch_sync_queue = queue.Queue()
        if zero_copy:  # as attach_storage_backend picks them
            self.page_get_func = self._page_get_zero_copy
            self.page_set_func = self._page_set_zero_copy
        else:
            self.page_get_func = self._generic_page_get
            self.page_set_func = self._generic_page_set

    def backup(self, kv_idx: torch.Tensor, tokens: list[int], states: dict) -> int:
        """A hybrid write-through as the backup thread runs it: KV of ``tokens`` and, per
        extra pool, its state for the last page (``states``: pool name -> host slots)."""
        transfers = [
            PoolTransfer(
                name=name, host_indices=slots, keys=None, hit_policy=PoolHitPolicy.TRAILING_PAGES
            )
            for name, slots in states.items()
        ]
        keys = page_keys(tokens)
        for t in transfers:
            t.keys = keys[-len(t.host_indices) :]
        op = HybridStorageOperation(
            kv_idx, tokens, hash_value=keys, prefix_keys=[], pool_transfers=transfers
        )
        self._page_backup_with_stable_layout(op)
        return op.completed_tokens

    def prefetch(self, tokens: list[int], kv_dst: torch.Tensor, states: dict) -> dict:
        """A hybrid prefetch as the prefetch threads run it: the hit query under the
        trailing-pages rule, then the KV and each extra pool read into host pages."""
        transfers = [
            PoolTransfer(
                name=name,
                host_indices=slots,
                keys=[None] * len(slots),
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            )
            for name, slots in states.items()
        ]
        op = HybridPrefetchOperation(
            SimpleNamespace(rid="req"), tokens, None, prefix_keys=[], pool_transfers=transfers
        )
        hashes, hit_tokens = self._storage_hit_query(op)
        op.hash_value = hashes
        op.host_indices = kv_dst[:hit_tokens]
        if hashes:
            self._page_transfer_with_stable_layout(op)
        acks = []
        while not self.prefetch_sync_queue.empty():
            acks.append(self.prefetch_sync_queue.get())
        return {
            "hit_tokens": hit_tokens,
            "restorable": op.pool_storage_result.restorable_prefix_pages,
            "query_pool_hit_pages": {str(k): v for k, v in op.query_pool_hit_pages.items()},
            "completed_tokens": [a.completed_tokens for a in acks if a.completed_tokens],
            "pool_hits": [
                {str(k): v for k, v in (a.pool_hits or {}).items()}
                for a in acks
                if getattr(a, "pool_hits", None) is not None
            ],
        }
