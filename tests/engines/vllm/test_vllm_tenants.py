"""vLLM requests' tenants in the sidecar: quotas and per-tenant metrics, on the real
vLLM CPU engine.

A request's ``cache_salt`` names its tenant to the sidecar (``tenant_label``: a digest,
never the salt). One instance serves a prompt of salt "gold" and then, one round each,
four prompts of salt "free", whose tenant has a host and a disk quota of two prompts'
pages. After vLLM's own prefix cache is emptied, gold's prompt hits every page from the
sidecar, free's newest prompt hits, and its oldest, evicted by its own quota on both
tiers, misses; the metrics name both tenants by their labels.
"""

from __future__ import annotations

import random
import urllib.request

import pytest
from conftest import Instance, sidecar_stats
from prometheus_client.parser import text_string_to_metric_families

from hicache.integrations.vllm_pages import tenant_label
from tests.support.sidecar import Sidecar, wait_for

PROMPT_TOKENS = 100  # three whole blocks of 32 tokens, and a tail
PAGES = PROMPT_TOKENS // 32
CACHED = PAGES * 32
# A page is one block of the tiny Llama: 2 layers, K and V, 32 tokens, 2 heads of 64 floats.
PAGE_BYTES = 2 * 2 * 32 * 2 * 64 * 4
GOLD_SALT, FREE_SALT = "gold-salt-7f3e", "free-salt-91ac"
FREE_QUOTA_PAGES = 2 * PAGES
FLOODS = 4


def salted(seed: int, salt: str) -> dict:
    rng = random.Random(seed)
    return {"tokens": [rng.randrange(1, 500) for _ in range(PROMPT_TOKENS)], "cache_salt": salt}


def test_tenant_label_is_a_digest_of_the_salt() -> None:
    assert tenant_label(None) is None and tenant_label("") is None  # no salt in vLLM's hashes
    assert tenant_label(GOLD_SALT) == tenant_label(GOLD_SALT) != tenant_label(FREE_SALT)
    assert tenant_label(GOLD_SALT).startswith("salt-") and GOLD_SALT not in tenant_label(GOLD_SALT)


@pytest.mark.timeout(1200)  # a vLLM start takes 1-2 minutes on a busy machine
def test_a_salts_quota_holds_and_the_other_salt_keeps_its_hits(tiny_model, sidecar_dir) -> None:
    gold, free = tenant_label(GOLD_SALT), tenant_label(FREE_SALT)
    quota = FREE_QUOTA_PAGES * PAGE_BYTES
    env = {"HICACHE_TENANT_QUOTAS": f"{free}:host={quota},{free}:disk={quota}"}
    sidecar = Sidecar(sidecar_dir, env=env, metrics=True).start()
    g = salted(0, GOLD_SALT)
    floods = [salted(1 + i, FREE_SALT) for i in range(FLOODS)]
    rounds = [[g], *([f] for f in floods), [g, floods[0], floods[-1]]]
    last = len(rounds) - 1
    instance = None
    try:
        instance = Instance(
            sidecar_dir, "A", tiny_model, rounds, sidecar.socket,
            pause_before=tuple(range(1, last + 1)), reset_before=(last,),
        )  # fmt: skip

        # Each round's pages are on disk before the next one comes: a page still being
        # written cannot be evicted, and the flood would then be refused, not evicted.
        def stored(tenant: str, pages: int) -> bool:
            stats = sidecar_stats(sidecar)
            return (
                stats.get(f"tenants.top.{tenant}.stored.host", 0) >= pages
                and stats["disk.pending_writes"] == 0
            )

        for r in range(1, last):
            instance.wait_paused(r)
            tenant, pages = (gold, PAGES) if r == 1 else (free, (r - 1) * PAGES)
            wait_for(
                lambda t=tenant, n=pages: stored(t, n), 120, f"round {r - 1}'s pages", every_s=0.1
            )
            instance.resume(r)
        instance.wait_paused(last)

        def settled() -> bool:
            stats = sidecar_stats(sidecar)
            return (
                stats["disk.pending_writes"] == 0
                and stats.get(f"tenants.top.{free}.disk_bytes") == quota
                and stats.get(f"tenants.top.{gold}.disk_bytes") == PAGES * PAGE_BYTES
            )

        wait_for(settled, 120, "the stores on disk", every_s=0.2)
        stats = sidecar_stats(sidecar)
        mine, theirs = f"tenants.top.{gold}.", f"tenants.top.{free}."
        assert stats[mine + "host_bytes"] == PAGES * PAGE_BYTES
        assert stats[mine + "evicted.host"] == stats[mine + "evicted.disk"] == 0
        assert stats[mine + "host_quota_bytes"] is None
        assert stats[theirs + "host_bytes"] == stats[theirs + "host_quota_bytes"] == quota
        # Free's two oldest prompts went, on host and disk, for its own quota.
        evicted = (FLOODS * PAGES) - FREE_QUOTA_PAGES
        assert stats[theirs + "quota_evicted.host"] == evicted
        assert stats[theirs + "quota_evicted.disk"] == evicted
        assert stats["tenants.tenants"] == 2

        instance.resume(last)
        served = instance.result()
        g_hit, oldest, newest = served[last]["results"]
        assert g_hit["num_cached_tokens"] == CACHED  # from the sidecar: vLLM's cache was reset
        assert g_hit["tokens"] == served[0]["results"][0]["tokens"]
        assert newest["num_cached_tokens"] == CACHED
        assert oldest["num_cached_tokens"] == 0

        text = urllib.request.urlopen(
            f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=10
        ).read().decode()  # fmt: skip
        samples = {f.name: f.samples for f in text_string_to_metric_families(text)}
        lookups = {
            (s.labels["tenant"], s.labels["result"]): s.value
            for s in samples["hicache_tenant_lookup_pages"]
        }
        assert lookups[gold, "host"] >= PAGES
        assert lookups[free, "miss"] >= PAGES
        held = {(s.labels["tenant"], s.labels["tier"]) for s in samples["hicache_tenant_bytes"]}
        assert {t for t, _ in held} >= {gold, free}
        assert GOLD_SALT not in text and FREE_SALT not in text
    finally:
        if instance is not None:
            instance.stop()
        sidecar.stop()
        sidecar.kill()
