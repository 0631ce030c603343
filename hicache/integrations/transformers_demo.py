"""``hicache run-hf``: a multi-turn chat workload on a transformers model, with the cache
(device pools + an in-process controller over a host pool and LMDB) and without, printed
as the demo's table.

Every user shares one system prompt; each turn's prompt is the whole conversation so far
plus a new message, so a turn hits the previous turn's prefix — on the device while it
fits, else on the host or disk tier. The cache-off run serves the same prompts with
nothing matched or cached; both runs' logits are compared.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from hicache.apps.engine.demo_report import PhaseReport, phase_table
from hicache.integrations.transformers_models import FAMILIES, realistic_config, tiny_config


def add_run_hf_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="bamba", choices=FAMILIES, help="the model family")
    p.add_argument(
        "--size", default="tiny", choices=("tiny", "realistic"), help="tiny (CPU) or 1-3 B"
    )
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=96)
    p.add_argument("--message-tokens", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=64)
    p.add_argument(
        "--device-tokens",
        type=int,
        default=512,
        help="FULL slots on the device: fewer than the workload needs sends prefixes to host",
    )
    p.add_argument("--host-pool-bytes", type=int, default=64 << 20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 (default on CPU) or bfloat16")
    p.add_argument("--seed", type=int, default=0)


def run_run_hf(args: argparse.Namespace) -> int:
    import transformers

    from hicache.controller.config import ControllerConfig
    from hicache.controller.store.local import LocalController
    from hicache.integrations.transformers import PrefixCachedLM

    if args.device == "cpu":
        # oneDNN builds a convolution primitive per input shape (~50 ms each); chunks and
        # decode steps bring new shapes all the time, so the plain CPU kernels are faster.
        torch.backends.mkldnn.enabled = False
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    cfg = tiny_config(args.model) if args.size == "tiny" else realistic_config(args.model)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model = model.to(args.device).eval()
    conversations = _workload(args, cfg.vocab_size)
    with tempfile.TemporaryDirectory(prefix="hicache-run-hf-") as tmp:
        ctrl = LocalController(
            ControllerConfig(
                host_pool_bytes=args.host_pool_bytes,
                disk_path=Path(tmp) / "lmdb",
                disk_budget_bytes=4 * args.host_pool_bytes,
            )
        )
        try:
            lm = PrefixCachedLM.build(
                model,
                page_size=args.page_size,
                full_slots=args.device_tokens,
                mamba_slots=4 * args.users + 8,
                controller=ctrl,
                chunk_tokens=args.chunk_tokens,
            )
            phase = PhaseReport(
                f"run-hf {args.model}",
                f"{args.users} users x {args.turns} turns, {args.size} model on {args.device}",
            )
            cached = _serve(lm, conversations, args.new_tokens, use_cache=True, phase=phase)
            lm.cache.flush_backups()
            ctrl.flush(30.0)
            _bytes_moved(phase, ctrl)
            plain = _serve(lm, conversations, args.new_tokens, use_cache=False, phase=phase)
            worst = _compare(phase, cached, plain)
            lm.cache.check_invariants()
        finally:
            ctrl.close()
    print(phase_table(phase))
    print(f"  largest |logit difference| vs cache off: {worst:.3g} (chunking reorders sums)")
    return 1 if phase.mismatches else 0


def _workload(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """Per user, the message of each turn (the first one starts with the system prompt)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    system = torch.randint(3, vocab, (args.system_tokens,), generator=g).tolist()
    out = []
    for _ in range(args.users):
        turns = [
            torch.randint(3, vocab, (args.message_tokens,), generator=g).tolist()
            for _ in range(args.turns)
        ]
        turns[0] = system + turns[0]
        out.append(turns)
    return out


def _serve(lm, conversations, new_tokens: int, use_cache: bool, phase: PhaseReport) -> list:
    """Serve turn by turn, round robin over users; returns each turn's result."""
    history = [[] for _ in conversations]
    results = []
    t0 = time.perf_counter()
    for turn in range(len(conversations[0])):
        for u, turns in enumerate(conversations):
            prompt = history[u] + turns[turn]
            r = lm.generate(prompt, new_tokens, use_cache=use_cache)
            history[u] = prompt + r.output_ids
            results.append(r)
            if use_cache:
                phase.add_result(_as_dict(r))
            else:
                phase.no_cache_computed_tokens += r.computed_tokens
    elapsed = time.perf_counter() - t0
    if use_cache:
        phase.time_s = elapsed
    else:
        phase.no_cache_time_s = elapsed
    return results


def _as_dict(r) -> dict:
    return {
        "prompt_tokens": r.prompt_tokens,
        "output_ids": r.output_ids,
        "device_hit_tokens": r.device_hit_tokens,
        "host_hit_tokens": r.host_hit_tokens,
        "disk_hit_tokens": r.disk_hit_tokens,
        "computed_tokens": r.computed_tokens,
        "preemptions": 0,
        "load_back_failures": 0,
        "error": None,
    }


def _bytes_moved(phase: PhaseReport, ctrl) -> None:
    transfer = ctrl.stats().get("transfer", {})
    for d in phase.bytes_moved:
        phase.bytes_moved[d] = int(transfer.get(d, {}).get("bytes", 0))


def _compare(phase: PhaseReport, cached: list, plain: list) -> float:
    """Count greedy tokens that differ between the runs; returns the largest logit
    difference (the runs chunk differently: the cache-off one from position 0)."""
    worst = 0.0
    for i, (a, b) in enumerate(zip(cached, plain)):
        for x, y in zip(a.logits, b.logits):
            phase.checked_tokens += 1
            worst = max(worst, (x - y).abs().max().item())
        if a.output_ids != b.output_ids:
            phase.mismatches.append({"turn": i, "cached": a.output_ids, "plain": b.output_ids})
    return worst
