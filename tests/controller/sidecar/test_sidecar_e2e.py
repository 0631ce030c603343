"""End to end: a real sidecar process and two engine processes with shared-memory pools.

Engine A computes a prefix, backs it up and evicts it from its device tier; engine B
(another process, its own pools) hits it on host and loads it back bit for bit. After a
sidecar restart both engines reconnect on their own (handshake and registration again)
and hit the prefix on disk.
"""

from __future__ import annotations

import re

from tests.support.sidecar import EngineProc, Sidecar, layout_file, wait_for

PAGE = 4
PREFIX_PAGES = 10
TOKENS = list(range(1000, 1000 + PREFIX_PAGES * PAGE + 3))  # ten pages and a tail
PREFIX = PREFIX_PAGES * PAGE
FAST_CLIENT = {"reconnect_interval_s": 0.2, "request_timeout_s": 2.0}


def _engines(sidecar: Sidecar, *ids: str) -> list[EngineProc]:
    """Engine processes started while the sidecar starts (they connect once it serves)."""
    procs = [EngineProc(sidecar.endpoint, i, **FAST_CLIENT) for i in ids]
    sidecar.wait_ready()
    for p in procs:
        p.receive()
        assert p.call("wait_available", timeout_s=60)["available"], p.stderr()
    return procs


def test_engine_b_loads_engine_a_prefix_from_host_then_from_disk_after_restart(workdir):
    sidecar = Sidecar(
        workdir,
        args=[
            "--layout-file",
            str(layout_file(workdir)),
            "--set",
            "heartbeat_interval_s=0.3",
            # Every page of a backup is a part of its own: the parts path end to end.
            "--set",
            "backup_chunk_bytes=1",
            "--lease-s",
            "10",
        ],
    )
    with sidecar.launch():
        a, b = _engines(sidecar, "engine-A", "engine-B")
        try:
            # A computes and backs up the prefix, then loses it from its device tier.
            assert a.call("run", tokens=TOKENS)["backup_done"] >= 1
            assert a.call("evict_all")["full_tokens"] >= PREFIX
            assert a.call("match", tokens=TOKENS) == {
                "prefix_len": 0,
                "host_hit_len": PREFIX,
                "disk_hit_len": 0,
            }

            # B never computed it: it finds it on host and loads it back. ``start``
            # verifies every K/V byte, the SWA window and the Mamba state.
            assert b.call("match", tokens=TOKENS)["host_hit_len"] == PREFIX
            assert b.call("start", tokens=TOKENS)["prefix_len"] == PREFIX

            # The sidecar restarts (a clean stop drains queued writes to LMDB).
            assert sidecar.stop() == 0
            sidecar.start()
            for e in (a, b):
                assert e.call("wait_available", timeout_s=60)["available"], e.stderr()

            # Both re-registered; neither has the prefix on device; it is on disk.
            assert b.call("evict_all")["full_tokens"] >= PREFIX
            for e in (a, b):
                m = e.call("match", tokens=TOKENS)
                assert m == {"prefix_len": 0, "host_hit_len": 0, "disk_hit_len": PREFIX}, m
            assert a.call("start", tokens=TOKENS)["prefix_len"] == PREFIX
            assert b.call("start", tokens=TOKENS)["prefix_len"] == PREFIX
            log = sidecar.log_text()
            assert log.count("engine engine-A registered cpu pools") == 2
            assert log.count("engine engine-B registered cpu pools") == 2
            # Each start rebuilt the index and then left it out of garbage collection.
            assert log.count("long-lived objects left out of garbage collection") == 2
        finally:
            for e in (a, b):
                e.close()


def _shm_maps(pid: int) -> set[str]:
    """The shared-memory files mapped into process ``pid``."""
    with open(f"/proc/{pid}/maps") as maps:  # a path may end in " (deleted)"
        return set(re.findall(r"/dev/shm/\S+", maps.read()))


def test_sidecar_unmaps_an_engines_memory_once_the_engine_leaves(workdir):
    """The sidecar maps an engine's pools to copy into and out of them; the copies it
    prepared for that engine must not keep them mapped after the engine is gone."""
    sidecar = Sidecar(workdir, args=["--layout-file", str(layout_file(workdir))])
    with sidecar.launch():
        sidecar.wait_ready()
        before = _shm_maps(sidecar.proc.pid)
        (a,) = _engines(sidecar, "engine-A")
        try:
            # A backup and a load-back: the sidecar copied both ways with A's pools.
            assert a.call("run", tokens=TOKENS)["backup_done"] >= 1
            assert a.call("evict_all")["full_tokens"] >= PREFIX
            assert a.call("start", tokens=TOKENS)["prefix_len"] == PREFIX
            mapped = _shm_maps(sidecar.proc.pid) - before
            assert mapped, "the engine's pools should be mapped into the sidecar"
        finally:
            a.close()
        wait_for(
            lambda: not (_shm_maps(sidecar.proc.pid) & mapped),
            30,
            "the sidecar to unmap the engine's pools",
        )
        assert "left: said bye" in sidecar.log_text()


def _restartable(workdir, *args: str) -> Sidecar:
    """A sidecar whose engines notice a restart quickly (heartbeats every 0.3 s)."""
    layout = ["--layout-file", str(layout_file(workdir))]
    return Sidecar(workdir, args=[*layout, "--set", "heartbeat_interval_s=0.3", *args])


def _prefix_off_device(engine: EngineProc) -> None:
    """The engine computes the prefix, backs it up, and drops it from its device tier."""
    assert engine.call("run", tokens=TOKENS)["backup_done"] >= 1
    assert engine.call("evict_all")["full_tokens"] >= PREFIX


def _registered_again(sidecar: Sidecar, engine: EngineProc, engine_id: str) -> None:
    """Wait until ``engine_id`` registered with the restarted sidecar (its second start)
    and its client serves again."""
    wait_for(
        lambda: sidecar.log_text().count(f"engine {engine_id} registered cpu pools") == 2,
        60,
        "the engine to register with the restarted sidecar",
    )
    assert engine.call("wait_available", timeout_s=60)["available"], engine.stderr()


def test_an_engine_loads_exactly_from_a_sidecar_restarted_after_a_kill_9(workdir):
    """The sidecar is killed (no drain) and started again on the same LMDB; the engine,
    never restarted, notices by itself (heartbeats), reconnects and registers again, and
    its next load of the prefix — now only on disk — is exact (every byte checked)."""
    # --backup-ack disk: acknowledged means committed, so a kill -9 loses none of it
    sidecar = _restartable(workdir, "--backup-ack", "disk")
    with sidecar.launch():
        (a,) = _engines(sidecar, "engine-A")
        try:
            _prefix_off_device(a)
            sidecar.kill()
            sidecar.start()
            _registered_again(sidecar, a, "engine-A")
            m = a.call("match", tokens=TOKENS)
            assert m == {"prefix_len": 0, "host_hit_len": 0, "disk_hit_len": PREFIX}, m
            assert a.call("start", tokens=TOKENS)["prefix_len"] == PREFIX
            assert a.call("status")["counters"]["connected"] == 2
        finally:
            a.close()


def test_a_restarted_sidecar_prewarms_the_prefix_and_hicachectl_shows_it(workdir, capsys):
    """After a restart the sidecar reads the pages used last back to host while serving:
    the engine's prefix, on disk only before, is a host hit once the prewarm is done, and
    ``hicachectl status`` reports the prewarm."""
    from hicache.controller.admin import cli as admin_cli
    from hicache.controller.wire.protocol import Verb

    sidecar = _restartable(workdir, "--set", "prewarm_bytes=4MiB")
    with sidecar.launch():
        (a,) = _engines(sidecar, "engine-A")
        try:
            _prefix_off_device(a)
            assert sidecar.stop() == 0
            sidecar.start()
            admin = sidecar.admin()
            try:

                def prewarm() -> dict:
                    return admin.call(Verb.STATUS)["disk"]["prewarm"]

                wait_for(lambda: prewarm()["state"] == "done", 60, "the prewarm")
                assert prewarm()["pages_read"] == prewarm()["target_pages"] > 0
            finally:
                admin.close()
            _registered_again(sidecar, a, "engine-A")
            m = a.call("match", tokens=TOKENS)
            assert m == {"prefix_len": 0, "host_hit_len": PREFIX, "disk_hit_len": 0}, m
            assert a.call("start", tokens=TOKENS)["prefix_len"] == PREFIX
            capsys.readouterr()
            assert admin_cli.main(["--socket", str(sidecar.socket), "status"]) == 0
            assert "prewarm:   done" in capsys.readouterr().out
        finally:
            a.close()
