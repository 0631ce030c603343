"""One vLLM CPU instance, run as a process by the tests and the benchmark (no tests here).

    python vllm_instance.py --model DIR --requests FILE --out FILE [--socket PATH]
        [--kv-events ENDPOINT]

It builds a ``vllm.LLM`` over the tiny model (eager, float32, no tokenizer), with
hicache's connector when ``--socket`` is given (and vLLM's own KV event publisher on
``--kv-events``), serves the prompts of ``--requests``
(JSON: a list of rounds, each a list of prompts, served in order: a prompt is a list of
token ids, or ``{"tokens": [...], "cache_salt": "..."}``; ``--pause-before N`` waits for
the test before round N, ``--reset-before N`` empties vLLM's own prefix cache before it,
so that round's hits are the connector's) and writes, per round, each
prompt's generated tokens, their logprobs, its cached tokens and the round's time to
``--out`` (JSON), and what the engine decided about its KV cache to ``--out`` with the
suffix ``.engine.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _save_random(model_class, config, path: Path, seed: int) -> Path:
    """``model_class(config)`` with weights normal(0, 0.05), saved with
    ``save_pretrained`` at ``path`` (vLLM's dummy loader gives degenerate output)."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(path)
    return path


def make_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A random-weight Llama (hidden 256, head_dim 64, 2 layers, weights normal(0, 0.05)),
    saved with ``save_pretrained``: vLLM's dummy loader gives degenerate output."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    return _save_random(LlamaForCausalLM, config, path, seed)


def make_tiny_gemma3(path: Path, seed: int = 0) -> Path:
    """A random-weight Gemma 3 text model: 4 layers, sliding windows of 64 tokens on
    layers 0, 1 and 3, full attention on layer 2 (vLLM's hybrid allocator gives it two
    KV cache groups), saved with ``save_pretrained``."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=64,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        max_position_embeddings=2048,
        query_pre_attn_scalar=64,
        tie_word_embeddings=True,
    )
    return _save_random(Gemma3ForCausalLM, config, path, seed)


def build_llm(model: str, socket: str | None, extra: dict, kv_events: str | None = None) -> object:
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

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
        kv_events_config=(
            None
            if kv_events is None
            else KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events)
        ),
    )


def pause(directory: Path, round_index: int, timeout_s: float = 600.0) -> None:
    """Tell the test this round is next and wait until it says go."""
    (directory / f"ready-{round_index}").touch()
    go = directory / f"go-{round_index}"
    end = time.monotonic() + timeout_s
    while not go.exists():
        if time.monotonic() > end:
            raise SystemExit(f"no go-{round_index} within {timeout_s}s")
        time.sleep(0.05)


def token_prompt(make, prompt: list[int] | dict) -> object:
    """vLLM's ``TokensPrompt`` of one prompt of ``--requests``."""
    if isinstance(prompt, dict):
        return make(prompt_token_ids=prompt["tokens"], cache_salt=prompt["cache_salt"])
    return make(prompt_token_ids=prompt)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--requests", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--socket")
    p.add_argument("--kv-events", help="publish vLLM's own KV events on this ZeroMQ endpoint")
    p.add_argument("--extra", default="{}", help="more kv_connector_extra_config (JSON)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument(
        "--pause-before",
        type=int,
        action="append",
        default=[],
        help="before this round, write <pause-dir>/ready-N and wait for go-N",
    )
    p.add_argument("--pause-dir")
    p.add_argument(
        "--reset-before",
        type=int,
        action="append",
        default=[],
        help="before this round, empty vLLM's prefix cache (reset_prefix_cache)",
    )
    a = p.parse_args()
    # The hicache worker's counters at shutdown (its INFO line) in the instance's log, from
    # vLLM's worker processes too: vLLM applies this logging config in each of them.
    logged = {"handlers": ["err"], "level": "INFO", "propagate": False}
    logging_config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
        "handlers": {
            "err": {
                "class": "logging.StreamHandler",
                "formatter": "plain",
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {"vllm": logged, "hicache.integrations.vllm_worker": logged},
    }
    config_path = Path(a.out).with_suffix(".logging.json")
    config_path.write_text(json.dumps(logging_config))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_path)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = build_llm(a.model, a.socket, json.loads(a.extra), a.kv_events)
    # What the engine decided about its KV cache, for the tests: whether vLLM's hybrid
    # allocator runs (a full + sliding-window model then has a KV cache group of each).
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    engine = {"hybrid_kv_cache_manager": not scheduler.disable_hybrid_kv_cache_manager}
    Path(a.out).with_suffix(".engine.json").write_text(json.dumps(engine))
    params = SamplingParams(
        max_tokens=a.max_tokens, temperature=0.0, logprobs=0, detokenize=False, ignore_eos=True
    )
    with open(a.requests) as f:
        rounds = json.load(f)
    out = []
    for i, prompts in enumerate(rounds):
        if i in a.pause_before:
            pause(Path(a.pause_dir), i)
        if i in a.reset_before and not llm.reset_prefix_cache():
            raise SystemExit(f"vLLM did not reset its prefix cache before round {i}")
        t0 = time.perf_counter()
        results = llm.generate([token_prompt(TokensPrompt, t) for t in prompts], params)
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
    with open(a.out, "w") as f:
        json.dump(out, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
