"""Crashes: ``kill -9`` of the sidecar while backups stream into LMDB, and of an engine in
the middle of a load.

With ``backup_ack = "disk"`` an acknowledged backup means committed to LMDB: after every
restart each acknowledged page must be there and load back with exactly its bytes.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from hicache import CacheConfig, DevicePools
from hicache.controller.client.sidecar_client import SidecarClientConfig, SidecarController
from hicache.controller.wire.protocol import Verb
from hicache.controller_api import PageRef, Presence
from hicache.keys import namespace_hash, page_hashes
from hicache.types import ComponentType
from tests.support.cache import make_layout
from tests.support.sidecar import EngineProc, Sidecar, layout_file, short_tmpdir, wait_for

MIX = "full"
PAGE = 4
CHAIN_PAGES = 6
FULL = ComponentType.FULL


class Streamer:
    """Backs up chain after chain through the sidecar, remembering the acknowledged ones.

    Chain ``i`` has its own tokens, and its device bytes are a function of ``i``, so any
    acknowledged chain can be checked later without keeping its bytes.
    """

    def __init__(self, endpoint: str) -> None:
        self.layout = make_layout(MIX)
        cfg = CacheConfig(page_size=PAGE, full_slots=64 * PAGE, shared_memory=True)
        self.pools = DevicePools.allocate(self.layout, cfg)
        self.fp = self.layout.fingerprint(PAGE)
        self.client = SidecarController(
            endpoint,
            "streamer",
            SidecarClientConfig(
                reconnect_interval_s=0.2, request_timeout_s=5.0, lookup_timeout_s=10.0
            ),
        )
        self.client.register(self.layout, PAGE, self.pools)
        self.src = self.pools.alloc_kv_pages(CHAIN_PAGES)
        self.dst = self.pools.alloc_kv_pages(CHAIN_PAGES)
        self.acked: list[int] = []
        self.attempts = 0
        # Backups stop being started past this many acknowledgements, so the data stays
        # well inside the disk budget: a page the tier evicted for room is not "lost".
        self.limit = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def chain(self, i: int, pages: np.ndarray) -> list[PageRef]:
        tokens = np.arange(CHAIN_PAGES * PAGE) + i * 100_000
        hashes = page_hashes(tokens, self.fp, PAGE)
        parents = [namespace_hash(self.fp, None), *hashes[:-1]]
        return [PageRef(FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, pages)]

    def expected(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        shape = self.pools.full.buffer[:, :, : CHAIN_PAGES * PAGE].shape
        return torch.randn(shape, generator=g)

    def _slots(self, pages: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.pools.full.pages_to_slots(pages))

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            if len(self.acked) >= self.limit:
                time.sleep(0.01)
                continue
            i += 1
            self.pools.full.buffer[:, :, self._slots(self.src)] = self.expected(i)
            self.attempts += 1
            if self.client.backup(self.chain(i, self.src)).wait(30):
                self.acked.append(i)
            elif not self.client.available:
                time.sleep(0.05)  # the sidecar is down: wait for the reconnect

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def verify(self, i: int) -> None:
        """Chain ``i`` is held and loads back with exactly its bytes."""
        refs = self.chain(i, self.dst)
        hashes = [r.page_hash for r in refs]
        pres = self.client.lookup(hashes, [FULL]).presence[FULL]
        assert (pres != Presence.ABSENT).all(), f"acknowledged chain {i} lost: {pres}"
        self.pools.full.buffer[:, :, self._slots(self.dst)] = float("nan")
        pin = self.client.pin([r.key for r in refs], 60)
        assert pin is not None, f"chain {i}: pin failed"
        try:
            assert self.client.load(refs, pin, 30), f"chain {i}: load failed"
        finally:
            self.client.unpin(pin)
        got = self.pools.full.buffer[:, :, self._slots(self.dst)]
        assert torch.equal(got, self.expected(i)), f"chain {i}: loaded bytes differ"

    def close(self) -> None:
        self.client.close()
        self.pools.close()


def _kill_cycles(cycles: int) -> None:
    work = short_tmpdir()
    sidecar = Sidecar(
        work,
        args=[
            "--layout-file",
            str(layout_file(work, MIX, PAGE)),
            "--backup-ack",
            "disk",
            "--set",
            "disk_sync=true",
        ],
    )
    sidecar.start()
    streamer = Streamer(sidecar.endpoint)
    streamer.start()
    rng = np.random.default_rng(7)
    checked = 0
    try:
        for cycle in range(cycles):
            floor = len(streamer.acked) + int(rng.integers(2, 8))
            streamer.limit = floor + 50  # still streaming when the kill comes
            wait_for(lambda f=floor: len(streamer.acked) >= f, 120, f"backups (cycle {cycle})")
            connects = streamer.client.counters["connected"]
            sidecar.kill()  # mid-stream: a backup is almost always in flight here
            acked = list(streamer.acked)
            sidecar.start()
            wait_for(
                lambda c=connects: (
                    streamer.client.counters["connected"] > c and streamer.client.available
                ),
                120,
                "the client to reconnect",
            )
            # Every chain acknowledged since the last check, and a sample of older ones.
            fresh = acked[checked:]
            older = acked[:checked]
            sample = rng.choice(older, size=min(20, len(older)), replace=False) if older else []
            for i in [*fresh, *sample]:
                streamer.verify(int(i))
            checked = len(acked)
        assert "Traceback" not in sidecar.log_text()
    finally:
        streamer.stop()
        streamer.close()
        sidecar.kill()
        shutil.rmtree(work, ignore_errors=True)


def test_kill_9_while_backups_stream_keeps_every_acknowledged_page():
    _kill_cycles(3)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_kill_9_soak():
    _kill_cycles(25)


def test_engine_killed_mid_load_loses_its_pins_within_the_lease():
    work = short_tmpdir()
    lease_s = 2.0
    read_delay_s = 0.5  # per disk read; a load of this prefix takes a few seconds
    sidecar = Sidecar(
        work,
        args=[
            "--layout-file",
            str(layout_file(work, "full+swa+mamba", PAGE)),
            "--lease-s",
            str(lease_s),
            "--set",
            "heartbeat_interval_s=0.25",
            "--backup-ack",
            "disk",
        ],
        env={"HICACHE_FAULTS": json.dumps({"disk_read_delay_s": read_delay_s})},
    )
    tokens = list(range(500, 500 + 8 * PAGE))
    with sidecar.launch():
        # The sidecar reads the disk pages (its reads slowed), not the engine itself.
        engine = EngineProc(
            sidecar.endpoint, "doomed", reconnect_interval_s=0.2, engine_disk_reads=False
        )
        try:
            sidecar.wait_ready()
            admin = sidecar.admin()
            engine.receive()
            assert engine.call("wait_available", timeout_s=60)["available"], engine.stderr()
            engine.call("run", tokens=tokens)
            engine.call("evict_all")
            # Only disk holds the prefix now, so the load reads slowly (injected delay).
            assert admin.call(Verb.CLEAR, {"tiers": ["host"], "all_namespaces": True})["host_pages"]
            assert engine.call("match", tokens=tokens)["disk_hit_len"] == len(tokens)
            engine.send("start", tokens=tokens)

            def loading() -> bool:
                rows = admin.call(Verb.ENGINES)["engines"]
                busy = any(r["engine_id"] == "doomed" and r["inflight"] for r in rows)
                return busy and admin.call(Verb.STATS)["pins_active"] > 0

            wait_for(loading, 60, "the engine's load to be in flight")
            engine.kill()
            killed = time.monotonic()
        finally:
            engine.kill()

        def released() -> bool:
            s = admin.call(Verb.STATS)
            rows = admin.call(Verb.ENGINES)["engines"]
            return s["pins_active"] == 0 and not any(r["engine_id"] == "doomed" for r in rows)

        wait_for(released, 60, "the dead engine's pins to be released")
        # The load in flight ends first (its timeout caps it), then the lease runs out.
        load_timeout_s = CacheConfig().load_timeout_s
        assert time.monotonic() - killed < load_timeout_s + lease_s + 5
        assert "doomed (pid" in sidecar.log_text() and "lease expired" in sidecar.log_text()
        # Its pages are evictable again: clearing the tiers drops every one of them (the
        # pages its load read went straight into its CPU slots: they are on disk only).
        res = admin.call(Verb.CLEAR, {"tiers": ["host", "disk"], "all_namespaces": True})
        assert res["disk_pages"] > 0 and res["kept_pages"] == 0, res
        admin.close()
    shutil.rmtree(work, ignore_errors=True)
