"""One vLLM CPU instance, run as a process by the tests and the benchmark (no tests here).

    python vllm_instance.py --model DIR --requests FILE --out FILE [--socket PATH] [--native]

It builds a ``vllm.LLM`` over the tiny model (eager, float32, no tokenizer), with
hicache's connector unless ``--native``, serves the prompts of ``--requests`` (JSON: a
list of rounds, each a list of token-id prompts, served in order) and writes, per round,
each prompt's generated tokens, their logprobs, the time of the round, and the
connector's counters to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def build_llm(model: str, socket: str | None, extra: dict) -> object:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv_transfer = None
    if socket is not None:
        kv_transfer = KVTransferConfig(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"hicache_socket": socket, **extra},
        )
    return LLM(
        model=model,
        enforce_eager=True,
        dtype="float32",
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        block_size=32,
        max_model_len=1024,
        max_num_seqs=4,
        seed=0,
        kv_transfer_config=kv_transfer,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--requests", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--socket")
    p.add_argument("--extra", default="{}", help="more kv_connector_extra_config (JSON)")
    p.add_argument("--max-tokens", type=int, default=4)
    a = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = build_llm(a.model, a.socket, json.loads(a.extra))
    params = SamplingParams(
        max_tokens=a.max_tokens, temperature=0.0, logprobs=0, detokenize=False, ignore_eos=True
    )
    rounds = json.load(open(a.requests))
    out = []
    for prompts in rounds:
        t0 = time.perf_counter()
        results = llm.generate([TokensPrompt(prompt_token_ids=t) for t in prompts], params)
        seconds = time.perf_counter() - t0
        served = []
        for r in results:
            c = r.outputs[0]
            served.append(
                {
                    "tokens": list(c.token_ids),
                    "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                    "num_cached_tokens": r.num_cached_tokens,
                }
            )
        out.append({"seconds": seconds, "results": served})
    json.dump(out, open(a.out, "w"))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
