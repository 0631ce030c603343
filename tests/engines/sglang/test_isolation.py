"""Never another run's or tenant's pages, through SGLang's own code and one sidecar.

* Two salts never share a page: SGLang seeds a request's storage key chain with its
  ``extra_key`` and ``cache_salt`` (``get_storage_hash_str``), and hicache's page hashes
  are SGLang's keys hashed in the run's namespace, so a page stored under one salt is
  found under that salt only.
* Two runs of one model name with another revision (or quantization, dtype, KV dtype,
  config overrides) have other namespaces: a sidecar serving one refuses the other.
"""

from __future__ import annotations

import types

import pytest
import sglang.srt.runtime_context as runtime_context
from sglang.srt.managers.cache_controller import PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang_support import PAGE_SIZE, ControllerShim, fill_pages, hicache_backend, mha_host_pool

from hicache.controller_api import ControllerError

PAGES = 4


def _found(ctl: ControllerShim, key: RadixKey) -> int:
    """Tokens of ``key`` the storage tier holds, as SGLang's prefetch asks for them."""
    _, hit_tokens = ctl._storage_hit_query(PrefetchOperation("req", key, None, prefix_keys=[]))
    return hit_tokens


def test_a_page_stored_under_one_salt_is_found_under_it_only(sidecar_per_layout, token_base):
    sidecar = sidecar_per_layout("layer_first")
    pool = mha_host_pool("layer_first")
    ctl = ControllerShim(hicache_backend(sidecar.endpoint, pool), pool, zero_copy=True)
    tokens = list(range(token_base, token_base + PAGES * PAGE_SIZE))
    stored = RadixKey(tokens, cache_salt="tenant-a")
    op = StorageOperation(
        fill_pages(pool, PAGES, seed=3),
        stored,
        hash_value=get_storage_hash_str(stored, None, page_size=PAGE_SIZE),
        prefix_keys=[],
    )
    ctl._page_backup(op)
    assert op.completed_tokens == len(tokens)

    assert _found(ctl, RadixKey(tokens, cache_salt="tenant-a")) == len(tokens)
    assert _found(ctl, RadixKey(tokens, cache_salt="tenant-b")) == 0
    assert _found(ctl, RadixKey(tokens)) == 0  # no salt: a namespace of its own
    assert _found(ctl, RadixKey(tokens, extra_key="tenant-a")) == 0  # an adapter, not a salt


def _server_args(revision: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        revision=revision, quantization=None, dtype="bfloat16", kv_cache_dtype="auto",
        json_model_override_args="{}",
    )  # fmt: skip


def test_another_revision_of_one_model_is_refused_by_its_sidecar(sidecar, monkeypatch):
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: _server_args("r1"))
    first = hicache_backend(sidecar.endpoint, mha_host_pool("layer_first"))
    assert "|revision=r1|" in first.layout.model_id
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: _server_args("r2"))
    with pytest.raises(ControllerError, match="one sidecar per layout"):
        hicache_backend(sidecar.endpoint, mha_host_pool("layer_first"))
