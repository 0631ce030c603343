"""An engine's own stores through a real ``hicache serve``: the engine writes the host pages
the sidecar handed it through its own mapping of the shared pool, and only a commit makes
them visible; an engine killed with ``kill -9`` mid-store leaves no visible page and no
page lost once its lease lapses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hicache.controller.client import AdminClient, SidecarController
from hicache.controller.wire.protocol import Verb
from hicache.keys import page_hashes
from hicache.types import ComponentType
from tests.support.cache import make_layout
from tests.support.sidecar import Sidecar, layout_file, short_tmpdir, wait_for

PAGE = 4
FULL = ComponentType.FULL

# The engine: attach, map the host pages, take pages for a prefix, write a marker into
# each, then commit (or wait to be killed before committing).
ENGINE = r"""
import json, sys, time
import numpy as np, torch
from hicache import PageRef
from hicache.controller.client import SidecarController
from hicache.keys import namespace_hash, page_hashes
from tests.support.cache import make_layout

endpoint, mode, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
layout = make_layout("full")
client = SidecarController(endpoint, engine_id=f"writer-{mode}")
client.attach(layout, 4)
host = client.map_host_pages(torch.device("cpu"))
fp = layout.fingerprint(4)
hashes = page_hashes(list(range(seed, seed + 16)), fp, 4)
parents = [namespace_hash(fp, None), *hashes[:-1]]
refs = [PageRef(layout.components[0], h, p, 0) for h, p in zip(hashes, parents)]
store = client.begin_store(refs, 60.0)
rows = host.pages[layout.components[0]]
nbytes = layout.page_bytes(layout.components[0], 4)
for i, page in enumerate(store.pages.tolist()):
    if page >= 0:
        rows[page, host.payload_offset : host.payload_offset + nbytes] = seed + i
print(json.dumps({"pages": store.pages.tolist()}), flush=True)
if mode == "commit":
    print(json.dumps({"committed": client.commit_store(store, True)}), flush=True)
    client.close()
else:
    time.sleep(600)
"""


def _engine(sidecar: Sidecar, mode: str, seed: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", ENGINE, sidecar.endpoint, mode, str(seed)],
        stdout=subprocess.PIPE,
        text=True,
    )


def _hashes(seed: int) -> list[bytes]:
    layout = make_layout("full")
    return page_hashes(list(range(seed, seed + 16)), layout.fingerprint(PAGE), PAGE)


def _counters(admin: AdminClient) -> dict:
    return admin.call(Verb.STATS)


@pytest.fixture
def sidecar():
    work = short_tmpdir()
    args = ["--layout-file", str(layout_file(work, "full", PAGE)), "--lease-s", "2"]
    args += ["--set", "heartbeat_interval_s=0.5"]
    with Sidecar(work, args) as s:
        yield s


def test_a_committed_store_is_visible_with_the_bytes_the_engine_wrote(sidecar):
    proc = _engine(sidecar, "commit", 100)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    lines = [json.loads(line) for line in out.splitlines()]
    assert min(lines[0]["pages"]) >= 0 and lines[1]["committed"] == 4

    reader = SidecarController(sidecar.endpoint, engine_id="reader")
    layout = make_layout("full")
    reader.attach(layout, PAGE)
    try:
        import torch

        host = reader.map_host_pages(torch.device("cpu"))
        hashes = _hashes(100)
        assert reader.lookup(hashes, [FULL]).presence[FULL].tolist() == [1] * 4  # on host
        pin = reader.pin(_keys(hashes), 30.0)
        assert pin is not None and min(pin.host_pages) >= 0
        nbytes = layout.page_bytes(FULL, PAGE)
        rows = host.pages[FULL].numpy()
        for i, page in enumerate(pin.host_pages):
            payload = rows[page, host.payload_offset : host.payload_offset + nbytes]
            assert (payload == 100 + i).all()
        reader.unpin(pin)
    finally:
        reader.close()


def _keys(hashes: list[bytes]):
    from hicache import PageKey

    return [PageKey(FULL, h) for h in hashes]


def test_an_engine_killed_mid_store_leaves_no_page_and_loses_none(sidecar):
    admin = sidecar.admin()
    try:
        used_before = _counters(admin)["host"]["used_pages"]["full"]
        proc = _engine(sidecar, "hold", 200)
        first = json.loads(proc.stdout.readline())
        assert min(first["pages"]) >= 0  # pages handed out and written, not committed
        proc.kill()  # kill -9 before the commit
        proc.wait(30)

        hashes = _hashes(200)
        probe = SidecarController(sidecar.endpoint, engine_id="probe")
        probe.attach(make_layout("full"), PAGE)
        try:
            assert probe.lookup(hashes, [FULL]).presence[FULL].tolist() == [0] * 4
        finally:
            probe.close()

        def reclaimed() -> bool:  # the lease lapses, the reservation is aborted
            return _counters(admin)["host"]["used_pages"]["full"] == used_before

        wait_for(reclaimed, 30.0, "the killed engine's pages to come back")
        aborted = _counters(admin)["engine_stores"]["pages_aborted"]
        assert aborted == 4
    finally:
        admin.close()
