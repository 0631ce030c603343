"""Two nodes, one cluster: two ``hicache serve`` processes, each with its own host and
disk tiers, configured only by ``HICACHE_REMOTE_URL``. The reference engine on node A
computes a chat's prompts; the reference engine on node B, whose own tiers are empty,
loads them from the remote tier, and every generated token's logits are bit-identical
to a cache-off run."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from hicache import CacheConfig, DevicePools, UnifiedRadixCache
from hicache.apps.engine import HybridModel, generate, tiny_hybrid
from hicache.apps.engine.cluster import SidecarProcess
from hicache.apps.engine.scheduler import GenerationRequest, Scheduler, SchedulerConfig
from hicache.config import PrefetchPolicy
from hicache.controller.client.sidecar_client import SidecarClientConfig, SidecarController

KINDS = ("full", "swa", "mamba", "full")
PAGE = 16
WINDOW = 24
SYSTEM = [(7 * i + 3) % 256 for i in range(4 * PAGE)]  # a shared system prompt of four pages

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Node:
    """A sidecar process and an engine (model, pools, cache, scheduler) using it."""

    def __init__(self, workdir, name: str) -> None:
        self.sidecar = SidecarProcess(workdir / name).start()
        spec = tiny_hybrid(KINDS, page_size=PAGE, sliding_window=WINDOW)
        self.model = HybridModel(spec.layout, spec.model_config)
        config = CacheConfig(
            page_size=PAGE, sliding_window=WINDOW, full_slots=1024, mamba_slots=16,
            shared_memory=True, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
        )  # fmt: skip
        self.pools = DevicePools.allocate(spec.layout, config)
        client = SidecarClientConfig(lookup_timeout_s=5.0, request_timeout_s=30.0)
        self.controller = SidecarController(self.sidecar.endpoint, engine_id=name, config=client)
        self.cache = UnifiedRadixCache(spec.layout, config, self.pools, self.controller)
        sched = SchedulerConfig(prefill_chunk_tokens=PAGE, check_invariants=True)
        self.scheduler = Scheduler(self.model, self.cache, sched)

    def close(self) -> None:
        self.controller.close()
        self.pools.close()
        self.sidecar.stop()


def reference_logits(model: HybridModel, request: GenerationRequest) -> torch.Tensor:
    spec = tiny_hybrid(KINDS, page_size=PAGE, sliding_window=WINDOW)
    pools = DevicePools.allocate(spec.layout, CacheConfig(page_size=PAGE, sliding_window=WINDOW))
    return generate(model, pools, request.prompt_ids, request.max_new_tokens,
                    prefill_chunk_tokens=3 * PAGE).logits  # fmt: skip


def test_node_b_hits_what_node_a_computed_with_identical_logits(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("HICACHE_REMOTE_URL", cluster.url)
    # What is served is asserted, not how fast: a late node must not turn hits into misses.
    monkeypatch.setenv("HICACHE_REMOTE_LOOKUP_TIMEOUT_S", "2.0")
    requests = [
        GenerationRequest.of(f"r{i}", SYSTEM + [(40 * i + j) % 256 for j in range(2 * PAGE)], 3)
        for i in range(3)
    ]
    a = Node(tmp_path, "a")
    try:
        results_a = a.scheduler.run(requests)
        a.cache.flush_backups()
        # Node A's sidecar writes to the cluster behind its host tier: wait for the queue.
        deadline = time.monotonic() + 30
        while True:
            remote = a.controller.stats()["remote_tier"]
            if (
                remote["write_queue_pages"] == 0
                and cluster.keys_per_master()
                and all(cluster.keys_per_master().values())
            ):
                break
            assert time.monotonic() < deadline, remote
            time.sleep(0.1)
        time.sleep(0.3)  # a batch taken off the queue may still be in flight
    finally:
        a.close()
    b = Node(tmp_path, "b")
    try:
        results_b = b.scheduler.run(requests)
        assert sum(r.remote_hit_tokens for r in results_b) >= len(SYSTEM)
        assert sum(r.load_back_failures for r in results_b) == 0
        for request, ra, rb in zip(requests, results_a, results_b, strict=True):
            want = reference_logits(b.model, request)
            assert torch.equal(ra.logits, want), f"{request.rid}: node A's logits differ"
            assert torch.equal(rb.logits, want), f"{request.rid}: node B's logits differ"
        b.cache.flush_backups()
        b.cache.check_invariants()
        stats = b.controller.stats()
        assert stats["remote"]["fills"]["ok"] > 0
        assert stats["transfer"]["remote_to_host"]["pages"] > 0
        # hicachectl shows the tier and the cluster's health.
        ctl = [sys.executable, "-m", "hicache.controller.admin.cli", "--socket",
               str(b.sidecar.socket_path)]  # fmt: skip
        shown = subprocess.run([*ctl, "status"], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "remote:    breaker closed, 3/3 masters up, 16384/16384 slots" in shown.stdout
        as_json = subprocess.run(
            [*ctl, "status", "--json"], capture_output=True, text=True, timeout=60
        )
        doc = json.loads(as_json.stdout)
        assert sum(n["keys"] for n in doc["remote"]["nodes"]) == sum(
            cluster.keys_per_master().values()
        )
    finally:
        b.close()
