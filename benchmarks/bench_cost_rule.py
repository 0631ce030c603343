"""Never slower than recompute, end to end: the time to first token of a request whose
prefix is held only by a throttled disk or remote tier, with the cost rule on and off,
against the same engine's cold prefill (a miss, the cache on) of a prompt of the same
length, same run, taking turns.

The engine is ``PrefixCachedLM`` over an in-process ``LocalController``; its prefill rate
is the one it measures from its own prefills (``hicache/prefill_rate.py``), never given
by hand. Per tier (LMDB disk, or an in-memory remote store) and per read delay (the
throttle: ``FaultPlan.disk_read_delay_s`` sleeps in every disk read batch, the remote
store in every read, whose deadline is set above it):

1. cold prefills (warm-up): what the meter measures first;
2. prefixes computed, cached and written to the tier, then dropped from the device and
   the host tiers: held by the lower tier only;
3. one request on such a prefix, with the throttle on: the tier's read is measured;
4. ``--repeat`` rounds of three requests: a cold prefill, one on a fresh prefix with the
   rule on, one on another with it off.

Prints, per cell, the median times and two ratios: rule-on over cold (the rule keeps it
near or below 1 however slow the tier) and rule-on over the better of rule-off and cold
(1 when the rule picks the faster path). Every time is the wall time of ``generate`` with
one new token, up to that token on the host.

    .venv/bin/python benchmarks/bench_cost_rule.py [--device cpu] [--tiers disk,remote]
        [--delays-ms 0,5,50,500,2000] [--prefix 1024] [--repeat 5] [--warmup 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hicache.config import PrefetchPolicy
from hicache.controller.config import ControllerConfig
from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.local import LocalController
from hicache.controller.tiers.remote_store import MemoryStore
from hicache.integrations.transformers import PrefixCachedLM
from hicache.types import Tier

SUFFIX = 16  # tokens after the cached prefix, computed in every request


class SlowReads(MemoryStore):
    """An in-memory remote store whose reads take ``read_delay_s`` longer (a slow link:
    its existence checks, a lookup's probes, stay fast)."""

    read_delay_s = 0.0

    def get(self, keys, timeout_s):
        time.sleep(min(self.read_delay_s, timeout_s))
        return super().get(keys, timeout_s)


def build_model(device: str) -> torch.nn.Module:
    """A Llama-shaped model with random weights: small on a CPU, ~1.1 B on a GPU."""
    import transformers

    from hicache.integrations.transformers_models import realistic_config, tiny_config

    if device == "cuda":
        cfg, dtype = realistic_config("llama"), torch.bfloat16
    else:
        cfg, dtype = (
            tiny_config(
                "llama",
                vocab_size=1000,
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=4,
                max_position_embeddings=8192,
            ),
            torch.float32,
        )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype)
    return model.eval()


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def timed(lm: PrefixCachedLM, ids: list[int], use_cache: bool = True) -> tuple[float, int]:
    """Seconds to the first token of ``ids``, and the tokens loaded from below host."""
    t0 = time.perf_counter()
    r = lm.generate(ids, 1, use_cache=use_cache)
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
    return time.perf_counter() - t0, r.disk_hit_tokens


def run_cell(model, device: str, tier: str, delay_s: float, args, workdir: Path) -> dict:
    vocab = model.config.vocab_size
    store = SlowReads() if tier == "remote" else None
    disk = str(workdir / f"lmdb-{tier}-{delay_s}") if tier == "disk" else None
    # A read deadline above the throttle: a throttled store answers late, never not at all.
    config = ControllerConfig(
        host_pool_bytes=args.host_mib << 20,
        disk_path=disk,
        remote_read_timeout_s=max(1.0, 4 * delay_s),
    )
    ctl = LocalController(config, remote_store=store)
    per_prompt = args.prefix + SUFFIX
    lm = PrefixCachedLM.build(
        model,
        page_size=16,
        full_slots=per_prompt * 4,
        controller=ctl,
        chunk_tokens=256,
        keep_logits=False,
        layerwise=False,  # a hit's whole load against recomputing it, as the rule weighs them
        prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
    )
    seed = int(delay_s * 1e6) + (7 if tier == "remote" else 0) * 10**7
    try:
        for i in range(args.warmup):  # warm-up, and the meter's first prefills
            timed(lm, prompt(seed + i, per_prompt, vocab))
        prefixes = [prompt(seed + 100 + i, args.prefix, vocab) for i in range(1 + 2 * args.repeat)]
        for p in prefixes:
            lm.generate(p, 1)  # computed, cached, written below host
            lm.cache.flush_backups()
            assert ctl.flush(120.0), "the tier did not take the prefixes"
            lm.cache.evict(full_tokens=10**9)
        lm.cache.evict(full_tokens=10**9)
        ctl.store.clear([Tier.HOST])
        if store is not None:
            store.read_delay_s = delay_s
        else:
            ctl.faults = FaultPlan(disk_read_delay_s=delay_s)
        suffix = prompt(seed + 999, SUFFIX, vocab)
        timed(lm, prefixes[0] + suffix)  # measures the tier
        cold, on, off = [], [], []
        for k in range(args.repeat):  # in turns: the same load on the machine for each
            cold.append(timed(lm, prompt(seed + 10 + k, per_prompt, vocab))[0])
            ctl.cost_rule.enabled = True
            on.append(timed(lm, prefixes[1 + 2 * k] + suffix))
            ctl.cost_rule.enabled = False
            off.append(timed(lm, prefixes[2 + 2 * k] + suffix))
        cost = ctl.store.read_cost(Tier.DISK if tier == "disk" else Tier.REMOTE)
        cold_s = statistics.median(cold)
        on_s = statistics.median(s for s, _ in on)
        off_s = statistics.median(s for s, _ in off)
        return {
            "tier": tier,
            "delay_ms": delay_s * 1e3,
            "prefix_tokens": args.prefix,
            "cold_ms": cold_s * 1e3,
            "rule_on_ms": on_s * 1e3,
            "rule_off_ms": off_s * 1e3,
            "rule_on_loaded_tokens": [n for _, n in on],
            "rule_off_loaded_tokens": [n for _, n in off],
            "on_over_cold": on_s / cold_s,
            "on_over_best": on_s / min(off_s, cold_s),
            "prefill_tokens_per_s": lm.prefill_meter.rate,
            "tier_read": cost.stats() if cost is not None else None,
        }
    finally:
        ctl.cost_rule.enabled = True
        lm.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiers", default="disk,remote")
    p.add_argument("--delays-ms", default="0,5,50,500,2000")
    p.add_argument("--prefix", type=int, default=1024, help="cached prefix tokens")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5, help="cold prefills before timing")
    p.add_argument("--host-mib", type=int, default=256)
    p.add_argument("--json")
    args = p.parse_args()
    if args.device == "cpu":  # a shared machine: no OpenMP threads spinning against others
        torch.set_num_threads(1)
    model = build_model(args.device)
    rows = []
    print(
        f"{'tier':6} {'delay ms':>8} {'cold ms':>9} {'rule on':>9} {'rule off':>9} "
        f"{'on/cold':>8} {'on/best':>8}  loaded (on | off)   prefill tok/s  tier read"
    )
    with tempfile.TemporaryDirectory(prefix="hc-cost-") as tmp:
        for tier in args.tiers.split(","):
            for delay in (float(d) / 1e3 for d in args.delays_ms.split(",")):
                r = run_cell(model, args.device, tier, delay, args, Path(tmp))
                rows.append(r)
                read = r["tier_read"] or {}
                print(
                    f"{r['tier']:6} {r['delay_ms']:8.0f} {r['cold_ms']:9.1f} "
                    f"{r['rule_on_ms']:9.1f} {r['rule_off_ms']:9.1f} {r['on_over_cold']:8.2f} "
                    f"{r['on_over_best']:8.2f}  {r['rule_on_loaded_tokens']} | "
                    f"{r['rule_off_loaded_tokens']}  {r['prefill_tokens_per_s'] or 0:12.0f}  "
                    f"{read.get('read_bytes_per_s')} B/s, {read.get('read_latency_ms')} ms",
                    flush=True,
                )
    machine = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
