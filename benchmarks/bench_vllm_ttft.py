"""Time to first token on vLLM's CPU engine: a prompt served with hicache connector hits
against the same prompt cold, same engine, same run.

One ``hicache serve`` and one ``vllm.LLM`` (the test suite's tiny random Llama, eager,
float32) with hicache's connector. For each prompt: served cold (its blocks are then
stored in the sidecar), vLLM's own prefix cache reset (``reset_prefix_cache``: the
sidecar keeps its pages), the same prompt again — its blocks now come from the sidecar's
host tier — and once more, a native prefix-cache hit, for scale. TTFT is the time of a
``generate`` of one token. CPU only; run it in ``.venv-vllm`` (``scripts/vllm_env.sh``).

Usage: ``.venv-vllm/bin/python benchmarks/bench_vllm_ttft.py [--prompts 5] [--tokens 992]``
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "engines" / "vllm"))

from vllm_instance import build_llm, make_tiny_llama  # noqa: E402


def stored_pages(socket: Path) -> int:
    from hicache.controller.client import AdminClient
    from hicache.controller.wire.protocol import Verb

    admin = AdminClient("ipc://" + str(socket), timeout_s=30.0)
    try:
        return int(admin.call(Verb.STATS)["entries"])
    finally:
        admin.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=992, help="prompt length (31 blocks of 32)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    workdir = Path(tempfile.mkdtemp(prefix="hvb", dir="/tmp"))
    from hicache.apps.engine.cluster import SidecarProcess

    sidecar = SidecarProcess(workdir).start()
    socket = sidecar.socket_path
    try:
        model = make_tiny_llama(workdir / "model")
        llm = build_llm(str(model), str(socket), {})
        one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
        rng = random.Random(0)

        def ttft(tokens: list[int]) -> tuple[float, int]:
            t0 = time.perf_counter()
            (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], one, use_tqdm=False)
            return time.perf_counter() - t0, out.num_cached_tokens

        ttft([rng.randrange(1, 500) for _ in range(args.tokens)])  # warm-up
        cold, hit, native = [], [], []
        blocks = args.tokens // 32
        for _ in range(args.prompts):
            tokens = [rng.randrange(1, 500) for _ in range(args.tokens)]
            before = stored_pages(socket)
            seconds, cached = ttft(tokens)
            assert cached == 0
            cold.append(seconds)
            end = time.monotonic() + 60
            while stored_pages(socket) < before + blocks:  # the store is asynchronous
                assert time.monotonic() < end, "the prompt's blocks were not stored"
                time.sleep(0.05)
            llm.reset_prefix_cache()
            seconds, cached = ttft(tokens)
            assert cached > 0, "no connector hit"
            hit.append(seconds)
            seconds, _ = ttft(tokens)
            native.append(seconds)
        c, h, n = (statistics.median(x) * 1000 for x in (cold, hit, native))
        print(f"vLLM {args.tokens}-token prompts on CPU (tiny Llama), median of {args.prompts}:")
        print(f"  cold prefill TTFT           {c:8.1f} ms")
        print(f"  hicache connector hit TTFT  {h:8.1f} ms   ({h / c:.2f} of cold)")
        print(f"  native prefix-cache hit     {n:8.1f} ms   ({n / c:.2f} of cold)")
    finally:
        sidecar.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
