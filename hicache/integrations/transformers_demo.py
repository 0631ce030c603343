"""``hicache run-hf``: a multi-turn chat workload on a transformers model, with the cache
(device pools + an in-process controller over a host pool and LMDB) and without, printed
as the demo's table.

Every user shares one system prompt; each turn's prompt is the whole conversation so far
plus a new message, so a turn hits the previous turn's prefix — on the device while it
fits (``--device-tokens``), else on the host tier. Then the controller restarts on the same
LMDB folder and every user's last turn is served again: its prefix comes back from disk.

The same prompts are then served by a cache that never leaves the device (large enough
never to evict) and with nothing cached. Every token of a request that hit as much in both
cached runs must have bit-identical logits (a restored prefix holds the bytes the live
run computed): the exit status is 1 otherwise. Against the cache-off run, which computes
each prompt from position 0 in other chunks, greedy tokens are compared and the largest
logit difference is printed. Bad flags: a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hicache.apps.engine import PhaseReport, phase_table
from hicache.integrations.transformers import GenerationResult, PrefixCachedLM
from hicache.integrations.transformers_models import (
    FAMILIES,
    REALISTIC_FAMILIES,
    realistic_config,
    tiny_config,
)

DTYPES = ("float32", "bfloat16", "float16")


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
    p.add_argument("--chunk-tokens", type=int, default=64, help="a multiple of --page-size")
    p.add_argument(
        "--device-tokens",
        type=int,
        default=256,
        help="FULL slots on the device: at least one request's tokens (system + turns x "
        "(message + new)); fewer than all users' conversations send prefixes to the host",
    )
    p.add_argument("--host-pool-bytes", type=int, default=64 << 20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="default: float32 on CPU, "
                   "else bfloat16")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)


def run_hf_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with this combination of flags, in one sentence (None: nothing)."""
    for name in ("users", "turns", "message_tokens", "new_tokens", "page_size", "chunk_tokens",
                 "device_tokens", "host_pool_bytes"):  # fmt: skip
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    if args.system_tokens < 0:
        return f"--system-tokens must be at least 0, got {args.system_tokens}"
    if args.chunk_tokens % args.page_size:
        return (
            f"--chunk-tokens {args.chunk_tokens} is not a multiple of --page-size "
            f"{args.page_size}; give a --chunk-tokens that is"
        )
    need = longest_request_tokens(args)
    have = args.device_tokens // args.page_size * args.page_size
    if have < need:
        return (
            f"--device-tokens {args.device_tokens} holds {have} tokens in whole pages, but the "
            f"last turn needs {need} (system + turns x (message + new)); give at least "
            f"{-(-need // args.page_size) * args.page_size} or a shorter workload"
        )
    if args.size == "realistic" and args.model not in REALISTIC_FAMILIES:
        return (
            f"--size realistic has configs for {', '.join(REALISTIC_FAMILIES)} only, not "
            f"{args.model}"
        )
    try:
        device = torch.device(args.device)
    except RuntimeError:
        return f"--device {args.device!r} is not a torch device; use cpu or cuda"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--device {args.device} but no CUDA device is available; use --device cpu"
    return None


def longest_request_tokens(args: argparse.Namespace) -> int:
    """Token slots the last turn of a conversation takes: its prompt and new tokens."""
    prompt = args.system_tokens + args.turns * args.message_tokens
    return prompt + (args.turns - 1) * args.new_tokens + args.new_tokens - 1


def run_run_hf(args: argparse.Namespace) -> int:
    from hicache import ConfigError

    problem = run_hf_problem(args)
    if problem is not None:
        print(f"hicache run-hf: {problem}", file=sys.stderr)
        return 2
    try:
        import transformers
    except ImportError:
        print(
            'hicache run-hf: transformers is not installed; pip install "hicache[transformers]"',
            file=sys.stderr,
        )
        return 2
    if args.device == "cpu":
        # oneDNN builds a convolution primitive per input shape (~50 ms each); chunks and
        # decode steps bring new shapes all the time, so the plain CPU kernels are faster.
        torch.backends.mkldnn.enabled = False
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    cfg = tiny_config(args.model) if args.size == "tiny" else realistic_config(args.model)
    if longest_request_tokens(args) > cfg.max_position_embeddings:
        print(
            f"hicache run-hf: the last turn takes {longest_request_tokens(args)} tokens, more "
            f"than the model's {cfg.max_position_embeddings} positions; shorten the workload",
            file=sys.stderr,
        )
        return 2
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model = model.to(args.device).eval()
    phase = PhaseReport(
        f"run-hf {args.model}",
        f"{args.users} users x {args.turns} turns, then every user's last turn again after "
        f"restarting the controller; {args.size} model on {args.device}",
    )
    try:
        tiered, prompts = _serve_tiered(args, model, cfg.vocab_size, phase)
    except ConfigError as exc:
        print(f"hicache run-hf: {exc}", file=sys.stderr)
        return 2
    live = _serve_live(args, model, prompts)
    t0 = time.perf_counter()
    plain = [live.generate(p, args.new_tokens, use_cache=False) for p in prompts]
    phase.no_cache_time_s = time.perf_counter() - t0
    phase.no_cache_computed_tokens = sum(r.computed_tokens for r in plain)
    exact = _compare_bits(phase, tiered, _serve(live, prompts, args.new_tokens))
    agree, worst = _compare_greedy(tiered, plain)
    print(phase_table(phase))
    print(
        f"  bit-identical to a cache that never left the device: {exact.identical:,} of "
        f"{exact.compared:,} tokens ({exact.skipped} requests not compared: another hit)"
    )
    print(
        f"  greedy tokens equal to the cache-off run: {agree:,} of {phase.generated_tokens:,}; "
        f"largest |logit difference|: {worst:.3g} (its chunks start at 0: sums reordered)"
    )
    return 1 if phase.mismatches else 0


def _serve_tiered(
    args: argparse.Namespace, model: Any, vocab: int, phase: PhaseReport
) -> tuple[list[GenerationResult], list[list[int]]]:
    """The chat with the cache (device pools of --device-tokens over a host pool and
    LMDB), then every user's last turn again after restarting the controller on the same
    LMDB folder. Returns each request's result and prompt."""
    from hicache import PrefetchPolicy
    from hicache.controller import ControllerConfig, LocalController

    conversations = _workload(args, vocab)
    with tempfile.TemporaryDirectory(prefix="hicache-run-hf-") as tmp:

        def controller() -> LocalController:
            return LocalController(
                ControllerConfig(
                    host_pool_bytes=args.host_pool_bytes,
                    disk_path=Path(tmp) / "lmdb",
                    disk_budget_bytes=4 * args.host_pool_bytes,
                )
            )

        # A restarted controller's host pool is empty: waiting for the disk reads is what
        # lets the first request after it hit (best_effort would compute it all).
        policies = (PrefetchPolicy.BEST_EFFORT, PrefetchPolicy.WAIT_COMPLETE)
        t0 = time.perf_counter()
        results: list[GenerationResult] = []
        prompts: list[list[int]] = []
        for stage, policy in enumerate(policies):
            ctrl = controller()
            with _tiered_lm(args, model, ctrl, policy) as lm:
                if stage == 0:
                    _chat(lm, conversations, args.new_tokens, results, prompts)
                else:
                    last = prompts[-len(conversations) :]
                    results += _serve(lm, last, args.new_tokens)
                    prompts += last
                lm.cache.check_invariants()
                lm.cache.flush_backups()
                ctrl.flush(30.0)
                _add_bytes_moved(phase, ctrl)
        phase.time_s = time.perf_counter() - t0
    for r in results:
        phase.add_result(_as_dict(r))
    return results, prompts


def _tiered_lm(args: argparse.Namespace, model: Any, ctrl: Any, policy: Any) -> PrefixCachedLM:
    try:
        return PrefixCachedLM.build(
            model,
            page_size=args.page_size,
            full_slots=args.device_tokens,
            mamba_slots=4 * args.users + 8,
            controller=ctrl,
            chunk_tokens=args.chunk_tokens,
            prefetch_policy=policy,
        )
    except BaseException:
        ctrl.close()
        raise


def _serve_live(args: argparse.Namespace, model: Any, prompts: list[list[int]]) -> PrefixCachedLM:
    """A device-only cache large enough never to evict: the live run the tiered one must
    reproduce bit for bit wherever it hits as much."""
    tokens = sum(len(p) + args.new_tokens for p in prompts)
    return PrefixCachedLM.build(
        model,
        page_size=args.page_size,
        full_slots=tokens + args.page_size,
        mamba_slots=tokens // args.page_size + 4 * args.users + 8,
        chunk_tokens=args.chunk_tokens,
    )


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


def _chat(
    lm: PrefixCachedLM,
    conversations: list[list[list[int]]],
    new_tokens: int,
    results: list[GenerationResult],
    prompts: list[list[int]],
) -> None:
    """Serve turn by turn, round robin over users, appending each request's result and
    prompt (the last turn's of every user last)."""
    history: list[list[int]] = [[] for _ in conversations]
    for turn in range(len(conversations[0])):
        for u, turns in enumerate(conversations):
            prompt = history[u] + turns[turn]
            r = lm.generate(prompt, new_tokens)
            history[u] = prompt + r.output_ids
            results.append(r)
            prompts.append(prompt)


def _serve(lm: PrefixCachedLM, prompts: list[list[int]], new_tokens: int) -> list:
    return [lm.generate(p, new_tokens) for p in prompts]


def _as_dict(r: GenerationResult) -> dict:
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


def _add_bytes_moved(phase: PhaseReport, ctrl: Any) -> None:
    transfer = ctrl.stats().get("transfer", {})
    for d in phase.bytes_moved:
        phase.bytes_moved[d] += int(transfer.get(d, {}).get("bytes", 0))


@dataclass
class BitCheck:
    """Tokens whose logits were compared bit for bit, and how many were identical;
    requests skipped because the two runs hit different lengths (other arithmetic)."""

    compared: int = 0
    identical: int = 0
    skipped: int = 0


def _compare_bits(
    phase: PhaseReport, tiered: list[GenerationResult], live: list[GenerationResult]
) -> BitCheck:
    """Per token: are the tiered run's logits bit-identical to the live run's? Only where
    both hit the same length (the same tokens computed the same way); a token that is not
    is a mismatch."""
    out = BitCheck()
    for i, (a, b) in enumerate(zip(tiered, live)):
        if a.hit_tokens != b.hit_tokens:
            out.skipped += 1
            continue
        for k, (x, y) in enumerate(zip(a.logits, b.logits)):
            out.compared += 1
            phase.checked_tokens += 1
            if torch.equal(x, y):
                out.identical += 1
            else:
                diff = (x - y).abs().max().item()
                phase.mismatches.append({"request": i, "token": k, "max_abs_diff": diff})
    return out


def _compare_greedy(
    tiered: list[GenerationResult], plain: list[GenerationResult]
) -> tuple[int, float]:
    """Greedy tokens equal between the cached and the cache-off run (counted up to the
    first difference of each request: the sequences part there), and the largest logit
    difference over those positions."""
    agree, worst = 0, 0.0
    for a, b in zip(tiered, plain):
        for x, y, ta, tb in zip(a.logits, b.logits, a.output_ids, b.output_ids):
            worst = max(worst, (x - y).abs().max().item())
            if ta != tb:
                break
            agree += 1
    return agree, worst
