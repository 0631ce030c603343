"""The cache-off baseline: greedy generation with slots taken straight from the pools.

Every cached run of the engine is compared, logit for logit, with :func:`generate` on the
same prompt; it prefills in page-aligned chunks and decodes one token at a time, as the
scheduler does, but shares nothing between requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hicache.apps.engine.model import HybridModel
from hicache.pools import DevicePools

DEFAULT_PREFILL_CHUNK_TOKENS = 64


@dataclass
class Generation:
    """Greedy output: ``token_ids`` (``max_new_tokens`` ids) and the float32 ``logits``
    ``[max_new_tokens, vocab]`` from which each of them was chosen."""

    token_ids: list[int]
    logits: torch.Tensor


def generate(
    model: HybridModel,
    pools: DevicePools,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
) -> Generation:
    """Greedy-decode ``max_new_tokens`` tokens after ``prompt_ids`` without any cache.

    Prefills in chunks of ``prefill_chunk_tokens`` (a multiple of the page size, so every
    chunk but the last ends on a page boundary), then decodes token by token. Allocates
    KV pages as the sequence grows and one Mamba state slot (zeroed), and frees all of
    them before returning, also on error: the pools' free counts are unchanged.
    """
    prompt = torch.as_tensor(prompt_ids, dtype=torch.int64).reshape(-1)
    page_size = pools.full.page_size
    if prompt.numel() == 0:
        raise ValueError("generate needs a non-empty prompt")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if prefill_chunk_tokens < 1 or prefill_chunk_tokens % page_size:
        raise ValueError(
            f"prefill_chunk_tokens={prefill_chunk_tokens} must be a positive multiple of the "
            f"page size {page_size}, so that chunks end on page boundaries"
        )

    pages: list[np.ndarray] = []
    mamba_slot = None
    try:
        if pools.mamba is not None:
            mamba_slot = pools.mamba.alloc_state()
            pools.mamba.conv[:, mamba_slot].zero_()
            pools.mamba.ssm[:, mamba_slot].zero_()

        def slots_for(length: int) -> np.ndarray:
            missing = -(-length // page_size) - len(pages)
            if missing > 0:
                pages.append(pools.alloc_kv_pages(missing))
            return pools.full.pages_to_slots(np.concatenate(pages))[:length]

        def run(tokens: torch.Tensor, start: int) -> torch.Tensor:
            end = start + tokens.numel()
            positions = torch.arange(start, end)
            return model.forward(pools, tokens, positions, slots_for(end), mamba_slot)

        generated: list[int] = []
        logits: list[torch.Tensor] = []
        last = None
        for start in range(0, prompt.numel(), prefill_chunk_tokens):
            last = run(prompt[start : start + prefill_chunk_tokens], start)[-1]
        length = prompt.numel()
        while len(generated) < max_new_tokens:
            assert last is not None
            logits.append(last)
            generated.append(int(torch.argmax(last)))
            if len(generated) == max_new_tokens:
                break
            last = run(torch.tensor([generated[-1]]), length)[0]
            length += 1
        vocab = model.config.vocab_size
        stacked = torch.stack(logits) if logits else torch.empty(0, vocab)
        return Generation(generated, stacked)
    finally:
        if pages:
            pools.free_kv_pages(np.concatenate(pages))
        if mamba_slot is not None:
            assert pools.mamba is not None
            pools.mamba.free_state(mamba_slot)
