"""Throughput of the reference model on the CPU: prefill and decode tokens per second.

Run ``python -m hicache.apps.engine.bench_model`` (``--help`` for sizes). It prints prefill
tokens/s per chunk size and decode tokens/s for one request per step (the baseline) and
for batches of requests, with the ratio of each to the baseline, all measured in the
same run on the default tiny hybrid layout.

Times are CPU seconds of this process (``time.process_time``) with one torch thread, the
best of ``--repeats`` runs: on a machine shared with other work, wall time measures the
neighbours as much as the model.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np
import torch

from hicache.apps.engine.model import DEFAULT_KINDS, HybridModel, SequenceChunk, tiny_hybrid
from hicache.pools import DevicePools


def _prefill_tokens_per_s(
    model: HybridModel, pools: DevicePools, prompt_tokens: int, chunk_tokens: int, prompts: int
) -> float:
    gen = torch.Generator().manual_seed(1)
    elapsed = 0.0
    for _ in range(prompts):
        tokens = torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=gen)
        slots, state = _alloc(pools, prompt_tokens)
        began = time.process_time()
        for start in range(0, prompt_tokens, chunk_tokens):
            end = min(start + chunk_tokens, prompt_tokens)
            model.forward(pools, tokens[start:end], torch.arange(start, end), slots[:end], state)
        elapsed += time.process_time() - began
        _free(pools, slots, state)
    return prompts * prompt_tokens / elapsed


def _decode_tokens_per_s(
    model: HybridModel, pools: DevicePools, context_tokens: int, batch: int, steps: int
) -> float:
    gen = torch.Generator().manual_seed(2)
    requests = []
    for _ in range(batch):
        slots, state = _alloc(pools, context_tokens + steps)
        tokens = torch.randint(0, model.config.vocab_size, (context_tokens,), generator=gen)
        model.forward(pools, tokens, torch.arange(context_tokens), slots[:context_tokens], state)
        requests.append((slots, state))
    began = time.process_time()
    for step in range(steps):
        length = context_tokens + step + 1
        chunks = [
            SequenceChunk([step % model.config.vocab_size], [length - 1], slots[:length], state)
            for slots, state in requests
        ]
        model.forward_batch(pools, chunks)
    elapsed = time.process_time() - began
    for slots, state in requests:
        _free(pools, slots, state)
    return batch * steps / elapsed


def _alloc(pools: DevicePools, tokens: int) -> tuple[np.ndarray, int | None]:
    pages = pools.alloc_kv_pages(-(-tokens // pools.full.page_size))
    state = None
    if pools.mamba is not None:
        state = pools.mamba.alloc_state()
        pools.mamba.conv[:, state].zero_()
        pools.mamba.ssm[:, state].zero_()
    return pools.full.pages_to_slots(pages)[:tokens], state


def _free(pools: DevicePools, slots: np.ndarray, state: int | None) -> None:
    pools.free_kv_pages(pools.full.slots_to_pages(slots))
    if state is not None and pools.mamba is not None:
        pools.mamba.free_state(state)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hicache.apps.engine.bench_model", description=__doc__
    )
    parser.add_argument(
        "--kinds", default=",".join(DEFAULT_KINDS), help="layer kinds, comma-separated"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--prompt-tokens", type=int, default=320)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--chunk-tokens", default="16,64,128", help="prefill chunk sizes")
    parser.add_argument("--context-tokens", type=int, default=320, help="context before decode")
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes; 1 is the baseline")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per batch size")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; best is kept")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    spec = tiny_hybrid(
        tuple(args.kinds.split(",")),
        full_slots=16
        * (max(batches) + 2)
        * (max(args.prompt_tokens, args.context_tokens + args.steps) // 16 + 2),
        mamba_slots=max(batches) + 2,
    )
    model, pools = spec.build()
    layout = spec.layout
    print(
        f"layout {','.join(k.value for k in layout.layer_kinds)}  d_model {model.config.d_model}  "
        f"page {spec.cache_config.page_size}  window {spec.cache_config.sliding_window}  "
        f"threads {args.threads}  (tokens per CPU second, best of {args.repeats})"
    )
    prefill = {}
    for chunk in (int(c) for c in args.chunk_tokens.split(",")):
        prefill[chunk] = _prefill_tokens_per_s(
            model, pools, args.prompt_tokens, chunk, args.prompts
        )
    base_chunk = min(prefill)
    for chunk, rate in prefill.items():
        print(
            f"prefill  chunk {chunk:4d}: {rate:8.0f} tokens/s  "
            f"({rate / prefill[base_chunk]:.2f}x chunk {base_chunk})"
        )
    decode = {
        b: _decode_tokens_per_s(model, pools, args.context_tokens, b, args.steps) for b in batches
    }
    base = decode[batches[0]]
    for batch, rate in decode.items():
        print(
            f"decode   batch {batch:4d}: {rate:8.0f} tokens/s  ({rate / base:.2f}x batch "
            f"{batches[0]}), context {args.context_tokens}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
