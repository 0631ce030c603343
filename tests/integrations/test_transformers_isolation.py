"""Never another model's or tenant's bytes, with real transformers models (tiny nemotron_h
configs, random weights, fp32).

Two models that differ only in hidden size (64 vs 48: the same head dim, KV heads and
Mamba state shapes, so the same shapes on every tier) or only in their weights (another
seed) share one LMDB directory, one remote store (in-process, and a cluster of
redis-server processes behind one `hicache serve`) and one sidecar, and never hit each
other's pages; two tenants sending the same prompt never hit each other's pages, on the
device, the host or the disk. A build the sidecar refuses leaves nothing in /dev/shm.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hicache import pools  # noqa: E402
from hicache.config import PrefetchPolicy  # noqa: E402
from hicache.controller.client.channel import SidecarClientConfig  # noqa: E402
from hicache.controller.client.sidecar_client import SidecarController  # noqa: E402
from hicache.controller.config import ControllerConfig, RemoteWritePolicy  # noqa: E402
from hicache.controller.store.local import LocalController  # noqa: E402
from hicache.controller.tiers.remote_store import MemoryStore  # noqa: E402
from hicache.controller.wire.protocol import Verb  # noqa: E402
from hicache.controller_api import ControllerError  # noqa: E402
from hicache.integrations.transformers import (  # noqa: E402
    PrefixCachedLM,
    probe_layout,
    request_namespace,
)
from hicache.integrations.transformers_models import tiny_config  # noqa: E402
from tests.support.cluster import LocalCluster  # noqa: E402
from tests.support.sidecar import Sidecar, short_tmpdir, wait_for  # noqa: E402

PS = 4
CHUNK = 8
PROMPT = [(7 * i) % 85 + 3 for i in range(24)]
MORE = [11, 12, 13, 14, 15]
FAST = SidecarClientConfig(request_timeout_s=10.0, lookup_timeout_s=10.0, connect_timeout_s=30.0)

# (hidden size, weight seed) of the model every pair starts from, and of its twin that
# differs in one of them.
BASE = (64, 0)
TWINS = {"hidden size": (48, 0), "weights": (64, 1)}

_MODELS: dict[tuple[int, int], torch.nn.Module] = {}


def nemotron(hidden: int, seed: int) -> torch.nn.Module:
    if (hidden, seed) not in _MODELS:
        torch.manual_seed(seed)
        cfg = tiny_config("nemotron_h", hidden_size=hidden)
        _MODELS[hidden, seed] = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    return _MODELS[hidden, seed]


def build(model, controller=None, **config) -> PrefixCachedLM:
    return PrefixCachedLM.build(
        model, page_size=PS, full_slots=PS * 32, mamba_slots=8, chunk_tokens=CHUNK,
        controller=controller, **config,
    )  # fmt: skip


def ctl_config(disk: Path | None, **config) -> ControllerConfig:
    return ControllerConfig(
        host_pool_bytes=4 << 20, disk_path=disk, disk_budget_bytes=32 << 20, **config
    )


def cache_prompt(lm: PrefixCachedLM, controller: LocalController) -> None:
    """Compute and cache PROMPT, every page of it on the host, disk and remote tiers."""
    lm.generate(PROMPT, 1)
    lm.cache.check_invariants()
    lm.cache.flush_backups()
    assert controller.flush(30.0)


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


# -- identity --------------------------------------------------------------------------


def test_the_model_id_names_name_config_and_weights():
    fingerprint = {
        key: probe_layout(nemotron(*key)).layout.fingerprint(PS) for key in (BASE, *TWINS.values())
    }
    assert len(set(fingerprint.values())) == 3, "hidden size and weights both count"
    torch.manual_seed(BASE[1])  # the same model built again: the same identity
    again = transformers.AutoModelForCausalLM.from_config(tiny_config("nemotron_h", hidden_size=64))
    assert probe_layout(again).layout.fingerprint(PS) == fingerprint[BASE]
    layout = probe_layout(nemotron(*BASE), model_id="adapter-7").layout
    assert layout.fingerprint(PS) != fingerprint[BASE]
    assert layout.model_id.startswith("hf:nemotron_h|config=")
    assert layout.model_id.endswith("|id=adapter-7")


def test_config_fields_that_change_nothing_computed_leave_the_id_alone():
    model = nemotron(*BASE)
    before = probe_layout(model).layout.model_id
    model.config.output_hidden_states = True
    try:
        assert probe_layout(model).layout.model_id == before
    finally:
        model.config.output_hidden_states = False


# -- two models, one LMDB directory and one remote store -------------------------------


@pytest.mark.parametrize("differs_in", sorted(TWINS))
def test_models_differing_only_in_one_thing_share_no_page_in_process(differs_in, tmp_path):
    disk, remote = tmp_path / "lmdb", MemoryStore()
    first, twin = nemotron(*BASE), nemotron(*TWINS[differs_in])

    ctrl = LocalController(ctl_config(disk), remote_store=remote)
    try:
        cache_prompt(build(first, ctrl), ctrl)
        with pytest.raises(ControllerError, match="run one controller per layout"):
            build(twin, ctrl)  # the host tier of a controller holding the first model's
    finally:
        ctrl.close()

    # After a restart, the twin over the same LMDB directory and remote store, then over
    # the remote store alone (writing only pages that served it: none of its own there),
    # then the first model over the remote store alone, which hits its pages there.
    for model, tiers_disk in ((twin, disk), (twin, None), (first, None)):
        hits = len(PROMPT) if model is first else 0
        ctrl = LocalController(
            ctl_config(tiers_disk, remote_write_policy=RemoteWritePolicy.SELECTIVE),
            remote_store=remote,
        )
        try:
            lm = build(model, ctrl, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
            r = lm.generate(PROMPT + MORE, 2)
            assert r.hit_tokens == hits, (differs_in, model is first, tiers_disk)
            assert r.computed_tokens == len(PROMPT + MORE) + 1 - hits
            lm.cache.check_invariants()
            if tiers_disk is not None:
                assert ctrl.stats()["disk"]["foreign_pages"] > 0, "the first model's pages"
        finally:
            ctrl.close()


# -- two models, one sidecar process ---------------------------------------------------


def test_models_differing_only_in_hidden_size_share_no_page_through_one_sidecar():
    """The sidecar serves the first model's layout and refuses the twin, leaving nothing
    in /dev/shm; after a restart the twin comes first and the first model's pages on
    disk are never served to it."""
    workdir = short_tmpdir()
    first, twin = nemotron(*BASE), nemotron(*TWINS["hidden size"])
    try:
        with Sidecar(workdir) as sidecar:
            client = SidecarController(sidecar.endpoint, "first", FAST)
            with build(first, client, shared_memory=True) as lm:
                segments = {t["shm_name"] for t in lm.cache.pools.shared_tensors().values()}
                lm.generate(PROMPT, 1)
                lm.cache.flush_backups()
                before = shm_entries()
                for attempt in range(3):
                    client = SidecarController(sidecar.endpoint, f"twin-{attempt}", FAST)
                    try:
                        with pytest.raises(ControllerError, match="one sidecar per layout"):
                            build(twin, client, shared_memory=True)
                    finally:
                        client.close()
                assert shm_entries() == before, "a refused build left its pools in /dev/shm"
                r = lm.generate(PROMPT + MORE, 2)
                assert r.device_hit_tokens == len(PROMPT)
                lm.cache.check_invariants()
            assert not shm_entries() & segments, "close() frees the pools' shared memory"
        with Sidecar(workdir) as sidecar:
            client = SidecarController(sidecar.endpoint, "twin", FAST)
            with build(twin, client, shared_memory=True,
                       prefetch_policy=PrefetchPolicy.WAIT_COMPLETE) as lm:  # fmt: skip
                r = lm.generate(PROMPT + MORE, 2)
                assert (r.hit_tokens, r.computed_tokens) == (0, len(PROMPT + MORE) + 1)
                lm.cache.check_invariants()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A Valkey/Redis Cluster of redis-server processes (skips without redis-server)."""
    c = LocalCluster(tmp_path_factory.mktemp("cluster"), masters=3).start()
    yield c
    c.stop()


def _settled(sidecar: Sidecar) -> None:
    """Wait until the sidecar's disk writes and cluster writes are done."""
    admin = sidecar.admin()
    try:

        def done() -> bool:
            s = admin.call(Verb.STATS)
            return (
                s["disk"].get("pending_writes", 0) == 0
                and s["remote_tier"]["write_queue_pages"] == 0
            )

        wait_for(done, 60, "disk and cluster writes")
    finally:
        admin.close()


@pytest.mark.parametrize("differs_in", sorted(TWINS))
def test_models_differing_only_in_one_thing_share_no_page_through_a_sidecar_and_a_cluster(
    differs_in, cluster
):
    """One `hicache serve` with a host tier, an LMDB directory and a cluster of
    redis-server processes: the first model's pages reach all three; the twin is refused
    by that sidecar (host), then, first after a restart over the same LMDB directory and
    cluster, hits nothing of them (disk, cluster). The first model, over the cluster
    alone, hits its own pages there: they were in reach."""
    workdir = short_tmpdir()
    first, twin = nemotron(*BASE), nemotron(*TWINS[differs_in])
    prefix = "iso" + differs_in.split()[0]
    remote = ["--remote-url", cluster.url, "--set", f"remote_key_prefix={prefix}"]
    wait = PrefetchPolicy.WAIT_COMPLETE
    try:
        with Sidecar(workdir, args=remote) as sidecar:
            with build(first, SidecarController(sidecar.endpoint, "first", FAST),
                       shared_memory=True) as lm:  # fmt: skip
                lm.generate(PROMPT, 1)
                lm.cache.flush_backups()
                client = SidecarController(sidecar.endpoint, "twin", FAST)
                try:
                    with pytest.raises(ControllerError, match="one sidecar per layout"):
                        build(twin, client, shared_memory=True)
                finally:
                    client.close()
                assert lm.generate(PROMPT + MORE, 1).device_hit_tokens == len(PROMPT)
            _settled(sidecar)
        with Sidecar(workdir, args=remote) as sidecar:  # the twin first: its layout
            client = SidecarController(sidecar.endpoint, "twin", FAST)
            with build(twin, client, shared_memory=True, prefetch_policy=wait) as lm:
                r = lm.generate(PROMPT + MORE, 2)
                assert (r.hit_tokens, r.computed_tokens) == (0, len(PROMPT + MORE) + 1)
                lm.cache.check_invariants()
            admin = sidecar.admin()
            try:
                stats = admin.call(Verb.STATS)
            finally:
                admin.close()
            assert stats["disk"]["foreign_pages"] > 0, "the first model's pages, not served"
            assert stats["transfer"].get("remote_to_host", {}).get("pages", 0) == 0
        with Sidecar(workdir, args=[*remote, "--no-disk"]) as sidecar:  # the cluster alone
            client = SidecarController(sidecar.endpoint, "first", FAST)
            with build(first, client, shared_memory=True, prefetch_policy=wait) as lm:
                r = lm.generate(PROMPT + MORE, 2)
                assert r.hit_tokens >= len(PROMPT), "the first model's pages are there"
                lm.cache.check_invariants()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_pools_that_do_not_all_fit_free_the_ones_made(monkeypatch):
    """The Mamba pool is made last: when it fails, the KV pool's segment goes too."""

    def no_room(*args, **kwargs):
        raise MemoryError("no room for the Mamba pool")

    monkeypatch.setattr(pools, "MambaPool", no_room)
    before = shm_entries()
    with pytest.raises(MemoryError):
        build(nemotron(*BASE), shared_memory=True)
    assert shm_entries() == before


# -- tenants -----------------------------------------------------------------------------


def test_two_tenants_sending_one_prompt_never_share_a_page(tmp_path):
    """Tenant a caches a prompt; the same prompt from another tenant (one that has not
    sent it before: b, c, d) misses on the device, on the host, and on the disk after a
    restart, while tenant a hits on each."""
    disk = tmp_path / "lmdb"
    model = nemotron(*BASE)

    def check(lm: PrefixCachedLM, other: str, tier: str) -> None:
        assert lm.generate(PROMPT + MORE, 1, tenant=other).hit_tokens == 0, tier
        lm.cache.check_invariants()
        a = lm.generate(PROMPT + MORE, 1, tenant="a")
        assert getattr(a, f"{tier}_hit_tokens") >= len(PROMPT), tier
        lm.cache.check_invariants()

    ctrl = LocalController(ctl_config(disk))
    try:
        lm = build(model, ctrl)
        lm.generate(PROMPT, 1, tenant="a")
        check(lm, "b", "device")
        lm.cache.flush_backups()
        assert ctrl.flush(30.0)
        lm.cache.evict(full_tokens=10**6)
        check(lm, "c", "host")
        lm.cache.flush_backups()
        assert ctrl.flush(30.0)
    finally:
        ctrl.close()
    ctrl = LocalController(ctl_config(disk))
    try:
        lm = build(model, ctrl, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
        check(lm, "d", "disk")
        assert lm.generate(PROMPT + MORE, 1).hit_tokens == 0  # no tenant: a namespace too
        lm.cache.check_invariants()
    finally:
        ctrl.close()


def test_the_request_namespace_is_one_to_one():
    names = {
        request_namespace(None, None),
        request_namespace("lora-1", None),
        request_namespace(None, "a"),
        request_namespace("lora-1", "a"),
        request_namespace(None, "lora-1"),
        request_namespace("x", "a"),
    }
    assert len(names) == 6
    with pytest.raises(ValueError, match="tenant="):
        request_namespace("tenant:a", None)
    with pytest.raises(ValueError, match="NUL"):
        request_namespace(None, "a\0b")
