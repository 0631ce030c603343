"""Never another deployment's or tenant's pages, through vLLM's own types and a sidecar.

* Two salts never share a page: vLLM puts a request's ``cache_salt`` into its first
  block's hash, so every block hash of the chain differs; hicache names a page by that
  hash in the deployment's namespace. A request of another salt (or none) finds nothing
  of what one salt stored; the same salt finds it.
* The namespace names the model beyond vLLM's offloading config (the model's name and KV
  dtype): revision, quantization, served dtype and a digest of the HF config each give
  another namespace, so another sidecar layout, which a sidecar serving one refuses.
"""

from __future__ import annotations

import types

import torch
from test_vllm_hybrid import (  # noqa: F401 (hybrid: the fixture, used by name)
    BLOCK,
    FULL_G,
    MAMBA_G,
    SWA_G,
    hybrid,
    kv_cache_config,
    lookup_until_answered,
    offloading_config,
    store,
)
from transformers import LlamaConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request

from hicache.integrations.vllm import (
    HiCacheOffloadingSpec,
    building_with_groups,
    describe_groups,
    describe_model,
)


def salted(rid: str, tokens: list[int], salt: str | None) -> Request:
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BLOCK, sha256_cbor),
    )


def test_two_salts_never_share_a_page(hybrid) -> None:  # noqa: F811
    scheduler, manager, worker, _, _ = hybrid
    tokens = list(range(1, 5 * BLOCK + 1))
    first = salted("a", tokens, "tenant-a")
    scheduler.on_new_request(first)
    assert lookup_until_answered(scheduler, first) == 0
    src = {FULL_G: [1, 2, 3, 4, 5], SWA_G: [0, 0, 8, 9, 10], MAMBA_G: [0, 0, 0, 14, 0]}
    store(manager, worker, first, src, job_id=1)

    for rid, salt, hit in (("b", "tenant-b", 0), ("none", None, 0), ("a2", "tenant-a", 4)):
        again = salted(rid, tokens, salt)
        scheduler.on_new_request(again)
        assert lookup_until_answered(scheduler, again) == hit * BLOCK, salt


MODEL = types.SimpleNamespace(
    model="org/tiny", revision="r1", quantization=None, dtype=torch.bfloat16,
    hf_config=LlamaConfig(hidden_size=64, num_attention_heads=4),
)  # fmt: skip


def test_revision_quantization_dtype_and_config_each_name_another_namespace() -> None:
    kv_config = kv_cache_config()
    groups = describe_groups(kv_config)
    narrower = LlamaConfig(hidden_size=48, num_attention_heads=4)
    changes = [{}, {"revision": "r2"}, {"quantization": "fp8"}, {"dtype": torch.float16},
               {"hf_config": narrower}]  # fmt: skip
    variants = [types.SimpleNamespace(**{**vars(MODEL), **c}) for c in changes]
    layouts = []
    for model_config in variants:
        with building_with_groups(groups, describe_model(model_config)):
            spec = HiCacheOffloadingSpec(offloading_config(kv_config, "/nonexistent.sock"))
        layouts.append(spec.namespace.layout())
    assert len({layout.fingerprint(1) for layout in layouts}) == len(variants)
    # The same model described again: the same namespace (a restart finds its pages).
    with building_with_groups(groups, describe_model(MODEL)):
        spec = HiCacheOffloadingSpec(offloading_config(kv_config, "/nonexistent.sock"))
    assert spec.namespace.layout().fingerprint(1) == layouts[0].fingerprint(1)
