"""A real sidecar with ``disk_load_direct``: after a restart, an engine process (shared
memory pools) loads a prefix held only on disk straight into its slots, every K/V byte,
SWA window and Mamba state exact, and the pages stay on disk (the next match finds them
there, not on host); what the reads kept of the engine's pools lets go of them when the
engine leaves."""

from __future__ import annotations

from pathlib import Path

from tests.support.sidecar import EngineProc, Sidecar, layout_file, wait_for

PAGE = 4
PREFIX = 10 * PAGE
TOKENS = list(range(2000, 2000 + PREFIX + 3))


def _mapped_shm(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text().split()
    return {word for word in maps if word.startswith("/dev/shm/")}


def test_a_restarted_sidecar_loads_disk_pages_straight_into_the_engine(workdir):
    args = ["--layout-file", str(layout_file(workdir)), "--set", "disk_load_direct=true"]
    sidecar = Sidecar(workdir, args=args)
    with sidecar.launch():
        engine = EngineProc(
            sidecar.endpoint, "engine-D", reconnect_interval_s=0.2, request_timeout_s=2.0
        )
        sidecar.wait_ready()
        engine.receive()
        try:
            assert engine.call("wait_available", timeout_s=60)["available"], engine.stderr()
            assert engine.call("run", tokens=TOKENS)["backup_done"] >= 1
            assert engine.call("evict_all")["full_tokens"] >= PREFIX
            assert engine.call("match", tokens=TOKENS)["host_hit_len"] == PREFIX
            assert sidecar.stop() == 0  # queued writes drained to LMDB
            sidecar.start()
            on_disk = {"prefix_len": 0, "host_hit_len": 0, "disk_hit_len": PREFIX}
            # The engine reconnects by itself (its requests fail until then).
            wait_for(lambda: engine.call("match", tokens=TOKENS) == on_disk, 60, "a disk hit")
            for _ in range(2):  # ``start`` checks every byte it loaded
                assert engine.call("start", tokens=TOKENS)["prefix_len"] == PREFIX
                assert engine.call("evict_all")["full_tokens"] >= PREFIX
                assert engine.call("match", tokens=TOKENS) == on_disk  # not on host
            mapped = _mapped_shm(sidecar.proc.pid)
            assert mapped, "the engine's pools are mapped into the sidecar"
        finally:
            engine.close()
        pid = sidecar.proc.pid
        wait_for(lambda: not _mapped_shm(pid) & mapped, 30, "the engine's pools unmapped")
