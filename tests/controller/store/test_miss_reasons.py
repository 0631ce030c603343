"""Why lookups and load-backs fall short, one reason per test, each produced for real:
a chain never stored, a host eviction under pressure, a disk eviction, an admin clear, a
corrupted LMDB value, a failed disk write, a load past its deadline, a load after its
pin expired, a prompt stored under another namespace, one stored under another layout.
Each reads the count (``miss_reasons``, the metric ``hicache_miss_reasons_total``) and
the page-by-page ``explain``."""

from __future__ import annotations

import time

import pytest

from hicache.controller.store.faults import FaultPlan
from hicache.controller.store.local import LocalController
from hicache.controller.store.miss_ops import ExplainHead
from hicache.controller.store.miss_reasons import MissReason
from hicache.controller.store.page_codec import HEADER_BYTES
from hicache.controller_api import LoadResult
from hicache.keys import namespace_hash, token_bytes
from hicache.types import Tier
from tests.support.controller import (
    ALL,
    FULL,
    PAGE,
    Engine,
    controller_config,
    hybrid_layout,
    registered_controller,
)


def _misses(ctl: LocalController) -> dict[tuple[str, str, str], float]:
    out = {}
    for reason, tiers in ctl.stats().get("miss_reasons", {}).items():
        for tier, comps in tiers.items():
            for comp, n in comps.items():
                out[reason, tier, comp] = n
    return out


def _stored(ctl: LocalController, chain, components=ALL) -> None:
    assert ctl.backup(chain.refs(components)).wait(5.0)
    assert ctl.flush(10.0)


def _load_full(ctl: LocalController, engine, chain, ttl_s=30.0, timeout_s=10.0, wait_s=0.0):
    """Pin the chain's FULL pages into fresh device pages and load them (``wait_s``
    between the pin and the load); the load's result."""
    refs = engine.place(chain.hashes, chain.parents).refs([FULL])
    pin = ctl.pin([r.key for r in refs], ttl_s)
    assert pin is not None
    time.sleep(wait_s)
    try:
        return ctl.load(refs, pin, timeout_s)
    finally:
        ctl.unpin(pin)


def _first_full_miss(ctl: LocalController, chain) -> dict:
    """Look the chain up (counted) and explain it: the first absent FULL run's reason."""
    ctl.lookup(chain.hashes, ALL)
    runs = ctl.store.explain(chain.hashes, ALL)
    return next(r["why"]["full"] for r in runs if "full" in r["why"])


def test_a_chain_never_stored_misses_as_never_stored(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(3 * PAGE))
    res = ctl.lookup(chain.hashes, ALL)
    assert res.leading(FULL) == 0
    assert _misses(ctl)[("never_stored", "none", "full")] == 1
    why = ctl.store.explain(chain.hashes, ALL)
    assert why == [
        {
            "first": 0,
            "last": 2,
            "where": {"full": "absent", "swa": "absent", "mamba": "absent"},
            "why": {
                c: {"reason": "never_stored", "tier": "none", "age_s": None}
                for c in ("full", "swa", "mamba")
            },
        }
    ]
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_page_evicted_from_host_under_pressure_misses_as_evicted_host(tmp_path):
    layout = hybrid_layout()
    engine = Engine(layout)
    ctl = LocalController(controller_config(tmp_path, disk_path=None, host_pool_bytes=24_000))
    ctl.register(layout, PAGE, engine.pools)
    cap = ctl.stats()["host"]["capacity_pages"]["full"]
    old = engine.write_chain(range(2 * PAGE))
    _stored(ctl, old, [FULL])
    new = engine.write_chain(range(1000, 1000 + cap * PAGE))
    _stored(ctl, new, [FULL])  # fills the host tier: the old chain is evicted for room
    assert ctl.stats()["evictions"]["host"]["full"] >= 2
    ctl.lookup(old.hashes, [FULL])
    why = ctl.store.explain(old.hashes, [FULL])[0]["why"]["full"]
    assert why["age_s"] >= 0
    assert _misses(ctl)[("evicted", "host", "full")] == 1
    ctl.check_invariants()
    ctl.close()


def test_a_page_evicted_from_disk_misses_as_evicted_disk(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(3 * PAGE))
    _stored(ctl, chain)
    ctl.store.evict(Tier.HOST, 1 << 30)  # host first: the pages stay on disk
    assert ctl.lookup(chain.hashes, [FULL]).leading(FULL) == 3
    assert ctl.store.evict(Tier.DISK, 1 << 30)["pages"] > 0
    why = _first_full_miss(ctl, chain)
    assert (why["reason"], why["tier"]) == ("evicted", "disk")
    assert _misses(ctl)[("evicted", "disk", "full")] == 1
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_cleared_page_misses_as_cleared(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(2 * PAGE))
    _stored(ctl, chain)
    ctl.store.clear([Tier.HOST, Tier.DISK])
    why = _first_full_miss(ctl, chain)
    assert (why["reason"], why["tier"]) == ("cleared", "disk")
    ctl.check_invariants(deep=True)
    ctl.close()


@pytest.mark.parametrize("direct", [True, False])  # read into the slots, or into host pages
def test_a_corrupted_value_fails_its_load_and_then_misses_as_checksum(tmp_path, direct):
    _, engine, ctl = registered_controller(tmp_path, disk_load_direct=direct)
    chain = engine.write_chain(range(3 * PAGE))
    _stored(ctl, chain)
    ctl.store.evict(Tier.HOST, 1 << 30)
    bad = chain.refs([FULL])[1].key.storage_key()
    with ctl.store._disk.lmdb.env.begin(write=True) as txn:
        value = bytearray(txn.get(bad))
        value[HEADER_BYTES + 3] ^= 0x10  # one bit of the payload: the checksum fails
        txn.put(bad, bytes(value))
    assert _load_full(ctl, engine, chain) is LoadResult.FAILED
    assert _misses(ctl)[("checksum", "disk", "full")] == 1  # the load
    runs = ctl.store.explain(chain.hashes, [FULL])
    # The good pages read by the load: on disk only (read into the slots) or on host as
    # well; the bad page between them dropped.
    kept = "disk" if direct else "host"
    assert [(r["first"], r["last"], r["where"]["full"]) for r in runs] == [
        (0, 0, kept),
        (1, 1, "absent"),
        (2, 2, kept),
    ]
    assert runs[1]["why"]["full"]["reason"] == "checksum"
    ctl.lookup(chain.hashes, [FULL])
    assert _misses(ctl)[("checksum", "disk", "full")] == 2  # and the lookup after it
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_failed_disk_write_then_a_host_eviction_misses_as_write_failed(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    ctl.faults = FaultPlan(disk_write=1)
    chain = engine.write_chain(range(2 * PAGE))
    _stored(ctl, chain)
    assert ctl.stats()["failures"]["disk_write_error"] > 0
    ctl.store.evict(Tier.HOST, 1 << 30)
    why = _first_full_miss(ctl, chain)
    assert (why["reason"], why["tier"]) == ("write_failed", "disk")
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_load_whose_disk_reads_outlast_its_deadline_counts_deadline(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(2 * PAGE))
    _stored(ctl, chain)
    ctl.store.evict(Tier.HOST, 1 << 30)
    ctl.faults = FaultPlan(disk_read_delay_s=0.5)
    ctl.lookup(chain.hashes, [FULL])
    assert _load_full(ctl, engine, chain, timeout_s=0.05) is LoadResult.FAILED
    assert _misses(ctl)[("deadline", "disk", "full")] == 1
    recent = ctl.store.recent_lookups("local", 1)
    assert recent[0].load_failures == [(MissReason.DEADLINE, Tier.DISK)]
    ctl.flush(10.0)
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_load_after_its_pin_expired_counts_pin_expired(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(2 * PAGE))
    _stored(ctl, chain)
    # The pin's TTL is over before the load comes.
    assert _load_full(ctl, engine, chain, ttl_s=0.05, wait_s=0.2) is LoadResult.FAILED
    assert _misses(ctl)[("pin_expired", "host", "full")] == 1
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_prompt_stored_under_another_namespace_is_explained_as_namespace(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    tokens = list(range(3 * PAGE))
    _stored(ctl, engine.write_chain(tokens, extra_key="tenant-a"))
    other = engine.write_chain(tokens, extra_key="tenant-b")
    head = ExplainHead(
        namespace_hash(engine.fingerprint, "tenant-b"), token_bytes(tokens[:PAGE]), PAGE
    )
    runs = ctl.store.explain(other.hashes, [FULL], head)
    assert [(r["first"], r["last"]) for r in runs] == [(0, 2)]
    assert runs[0]["why"]["full"] == {"reason": "namespace", "tier": "host", "age_s": None}
    # Under its own namespace the same prompt is cached; hashes alone cannot tell.
    assert ctl.store.explain(other.hashes, [FULL])[0]["why"]["full"]["reason"] == "never_stored"
    ctl.check_invariants(deep=True)
    ctl.close()


def test_a_prompt_stored_under_another_layout_is_explained_as_layout(tmp_path):
    tokens = list(range(3 * PAGE))
    layout_a, engine_a, ctl = registered_controller(tmp_path)
    _stored(ctl, engine_a.write_chain(tokens))
    ctl.close()
    layout_b = hybrid_layout(head_dim=16)  # the same model family, other heads: a new layout
    engine_b = Engine(layout_b)
    ctl = LocalController(controller_config(tmp_path))
    ctl.register(layout_b, PAGE, engine_b.pools)
    chain = engine_b.write_chain(tokens)
    head = ExplainHead(namespace_hash(engine_b.fingerprint, None), token_bytes(tokens[:PAGE]), PAGE)
    runs = ctl.store.explain(chain.hashes, [FULL], head)
    assert runs[0]["why"]["full"]["reason"] == "layout"
    assert runs[0]["why"]["full"]["tier"] == "disk"
    ctl.check_invariants(deep=True)
    ctl.close()


def test_the_counting_hook_counts_a_rule_that_declines_a_hit(tmp_path):
    """``slower_than_recompute`` is the cost rule's to decide: it counts through this."""
    _, _, ctl = registered_controller(tmp_path)
    ctl.store.count_miss(MissReason.SLOWER_THAN_RECOMPUTE, Tier.DISK, FULL, 4)
    assert _misses(ctl)[("slower_than_recompute", "disk", "full")] == 4
    ctl.check_invariants()
    ctl.close()


def test_a_lookup_that_hits_every_page_counts_no_reason(tmp_path):
    _, engine, ctl = registered_controller(tmp_path)
    chain = engine.write_chain(range(3 * PAGE))
    _stored(ctl, chain)
    ctl.lookup(chain.hashes, ALL)
    assert _misses(ctl) == {}
    assert ctl.store.recent_lookups("local", 5)[0].reasons == {}
    ctl.check_invariants(deep=True)
    ctl.close()
