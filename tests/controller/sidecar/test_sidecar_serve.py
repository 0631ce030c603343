"""``hicache serve``: configuration sources and their precedence, the no-config default,
one-line logs, and a SIGTERM that drains queued backups into LMDB before exit."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import threading

import lmdb
import numpy as np
import pytest
import torch

from hicache import CacheConfig, DevicePools
from hicache.controller.client.sidecar_client import SidecarClientConfig, SidecarController
from hicache.controller.config import DiskWritePolicy
from hicache.controller.sidecar.config import BackupAck
from hicache.controller.sidecar.process import (
    EXIT_STOPPED,
    EXIT_WRITES_LOST,
    add_serve_arguments,
    load_settings,
    parse_size,
    run_serve,
)
from hicache.controller.store.local import LocalController
from hicache.controller.wire.protocol import default_runtime_dir
from hicache.controller_api import PageRef
from hicache.keys import namespace_hash, page_hashes
from hicache.types import ComponentType
from tests.support.cache import make_layout
from tests.support.controller import PAGE, Engine, controller_config, hybrid_layout
from tests.support.sidecar import PYTHON, START_TIMEOUT_S, free_port, short_tmpdir, wait_for

LOG_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: \S"
)


def test_defaults_need_no_config(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = load_settings(None, env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert s.sidecar.socket == tmp_path / "hicache" / "hicache.sock"
    assert str(s.controller.disk_path) == "hicache-data"
    assert s.sidecar.metrics_port == 9464 and s.sidecar.tcp_endpoint is None
    assert s.controller.host_pool_bytes == 1 << 30
    assert s.layout is None
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_runtime_dir().name == f"hicache-{os.getuid()}"


def test_flags_beat_environment_beat_file(tmp_path):
    cfg = tmp_path / "hicache.toml"
    cfg.write_text(
        "[sidecar]\nlease_s = 20.0\nmetrics_port = 1111\nlog_level = 'warning'\n"
        "[controller]\nhost_pool_bytes = '2GiB'\nreader_threads = 2\n"
        "disk_write_policy = 'write_back'\n"
        "[layout]\nlayer_kinds = ['full', 'full']\nnum_kv_heads = 2\nhead_dim = 8\n"
        "page_size = 16\n"
    )
    env = {"HICACHE_METRICS_PORT": "2222", "HICACHE_READER_THREADS": "3"}
    s = load_settings(cfg, env=env, overrides={"reader_threads": "5", "backup_ack": "host"})
    assert s.sidecar.lease_s == 20.0  # file
    assert s.sidecar.metrics_port == 2222  # environment over file
    assert s.controller.reader_threads == 5  # flag over environment
    assert s.controller.host_pool_bytes == 2 << 30
    assert s.controller.disk_write_policy is DiskWritePolicy.WRITE_BACK
    assert s.sidecar.backup_ack is BackupAck.HOST
    assert s.layout is not None and s.layout[1] == 16 and s.layout[0].head_dim == 8


def test_sizes_take_units():
    assert parse_size("4GiB", "x") == 4 << 30
    assert parse_size("1.5MB", "x") == 1_500_000
    assert parse_size(123, "x") == 123


def test_serve_exits_2_on_a_bad_config(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--no-disk", "--backup-ack", "disk"])
    assert run_serve(args) == 2
    assert "backup_ack='disk' needs a disk tier" in capsys.readouterr().err


@dataclasses.dataclass
class _Drain:
    """What a default ``hicache serve`` did with backups still queued for disk at SIGTERM."""

    exit_code: int
    acknowledged: int  # pages the sidecar acknowledged (on host, queued for disk)
    stored: int  # pages in LMDB once it exited
    log: list[str]
    socket_left: bool


def _backup_then_sigterm(extra_env: dict[str, str]) -> _Drain:
    """Start ``hicache serve`` with no flags and no config file, back up 40 pages, stop it."""
    work = short_tmpdir()
    env = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(work / "xdg"),
        "HICACHE_METRICS_PORT": "0",
        # A writer that gathers for a minute (until SIGTERM): the backups stay queued.
        "HICACHE_WRITER_FLUSH_INTERVAL_S": "60",
        "HICACHE_WRITER_BATCH_PAGES": "4096",
        "PYTHONUNBUFFERED": "1",
        **extra_env,
    }
    (work / "xdg").mkdir(mode=0o700)
    socket = work / "xdg" / "hicache" / "hicache.sock"
    proc = subprocess.Popen(
        [PYTHON, "-m", "hicache.controller.sidecar.process"],  # no flags, no config file
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    layout = make_layout("full")
    pools = DevicePools.allocate(
        layout, CacheConfig(page_size=4, full_slots=256, shared_memory=True)
    )
    try:
        wait_for(lambda: socket.exists() or proc.poll() is not None, START_TIMEOUT_S, "socket")
        assert proc.poll() is None, proc.stdout.read()
        assert socket.stat().st_mode & 0o777 == 0o600
        client = SidecarController(
            "ipc://" + str(socket), "drain-test", SidecarClientConfig(connect_timeout_s=30)
        )
        client.register(layout, 4, pools)
        assert client.available
        fp = layout.fingerprint(4)
        n = 0
        for i in range(20):  # acknowledged on host; the disk writes are queued behind
            hashes = page_hashes(np.arange(8) + 100 * i, fp, 4)
            parents = [namespace_hash(fp, None), *hashes[:-1]]
            pages = pools.alloc_kv_pages(2)
            slots = torch.from_numpy(pools.full.pages_to_slots(pages))
            pools.full.buffer[:, :, slots] = float(i)
            refs = [
                PageRef(ComponentType.FULL, h, p, int(d)) for h, p, d in zip(hashes, parents, pages)
            ]
            assert client.backup(refs).wait(30)
            n += len(refs)
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(120)
        client.close()
        env_db = lmdb.open(str(work / "hicache-data"), readonly=True, lock=False)
        stored = env_db.stat()["entries"]
        env_db.close()
        return _Drain(
            exit_code=exit_code,
            acknowledged=n,
            stored=stored,
            log=proc.stdout.read().splitlines(),
            socket_left=socket.exists(),
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        pools.close()
        shutil.rmtree(work, ignore_errors=True)


def test_default_start_serves_privately_and_sigterm_drains_backups_to_lmdb():
    run = _backup_then_sigterm({"HICACHE_METRICS_PORT": str(free_port())})
    assert run.exit_code == EXIT_STOPPED
    assert run.log and all(LOG_LINE.match(line) for line in run.log), "\n".join(run.log)
    assert any("INFO hicache.sidecar: stopped" in line for line in run.log)
    queued = [re.search(r"draining: (\d+) disk writes queued", line) for line in run.log]
    assert [int(m.group(1)) for m in queued if m] == [run.acknowledged]  # all still queued
    assert not run.socket_left  # removed on a clean exit
    assert run.stored == run.acknowledged  # every acknowledged page was committed


def test_sigterm_exits_3_and_says_so_when_queued_disk_writes_are_lost():
    run = _backup_then_sigterm({"HICACHE_FAULTS": json.dumps({"disk_write": 1})})
    assert run.stored == 0  # the final batch, every queued page, failed
    assert run.exit_code == EXIT_WRITES_LOST, "\n".join(run.log)
    lost = f"ERROR hicache.sidecar: {run.acknowledged} acknowledged pages did not reach disk"
    assert any(lost in line for line in run.log), "\n".join(run.log)
    assert any("INFO hicache.sidecar: stopped" in line for line in run.log)


def test_close_counts_the_pages_still_queued_when_the_writer_does_not_drain(monkeypatch, tmp_path):
    layout = hybrid_layout()
    engine = Engine(layout)
    ctl = LocalController(controller_config(tmp_path, close_timeout_s=0.2))
    ctl.register(layout, PAGE, engine.pools)
    writer = ctl.store._disk.lmdb.writer
    stalled = threading.Event()
    commit = writer._commit

    def stalled_commit(*args, **kwargs):  # a disk slower than close_timeout_s
        stalled.wait(30)
        return commit(*args, **kwargs)

    monkeypatch.setattr(writer, "_commit", stalled_commit)
    chain = engine.write_chain(range(4 * PAGE))
    assert ctl.backup(chain.refs()).wait(10.0)  # acknowledged on host
    try:
        assert ctl.close() == len(chain.refs())
        assert ctl.close() == 0  # a second close does nothing
    finally:
        stalled.set()
    writer._thread.join(30)


class _CollectorStub:
    """Stands in for the ``gc`` module inside the server: counts freezes, so that the test
    process's own collector is left alone."""

    def __init__(self) -> None:
        self.freezes = 0

    def collect(self, generation: int = 2) -> int:
        return 0

    def freeze(self) -> None:
        self.freezes += 1

    def get_freeze_count(self) -> int:
        return self.freezes


@pytest.mark.parametrize("own_process", [True, False])
def test_the_sidecar_freezes_its_index_once_built_and_again_when_it_has_grown(
    monkeypatch, tmp_path, own_process
):
    from hicache.controller.config import ControllerConfig
    from hicache.controller.sidecar import server as server_mod
    from hicache.controller.sidecar.config import SidecarConfig
    from hicache.controller.sidecar.server import SidecarServer
    from hicache.controller.store.page_index import DiskState

    stub = _CollectorStub()
    monkeypatch.setattr(server_mod, "gc", stub)
    monkeypatch.setattr(server_mod, "_REFREEZE_MIN_ENTRIES", 10)
    ctl = LocalController(ControllerConfig(host_pool_bytes=1 << 20), make_layout("full"), 4)
    srv = SidecarServer(
        ctl, SidecarConfig(socket_path=tmp_path / "s.sock"), own_process=own_process
    )
    index = ctl.store._index

    def grow(n: int) -> None:
        for _ in range(n):
            e = index.create(ComponentType.FULL, os.urandom(16), b"\0" * 16)
            index.set_disk(e, DiskState.READY, 100)

    try:
        srv.freeze_long_lived()  # what serve does once the tiers are built
        grow(9)
        srv._refreeze_if_grown()  # less than the minimum growth: nothing
        assert stub.freezes == (1 if own_process else 0)
        grow(1)
        srv._refreeze_if_grown()
        assert stub.freezes == (2 if own_process else 0)
        assert srv.frozen_at_entries == (10 if own_process else -1)
        index.check_invariants()
    finally:
        ctl.close()


def test_bind_starts_every_worker_thread_with_its_socket_before_any_request(tmp_path):
    """A sidecar is ready with its threads running: every worker of the pool and the lane's
    thread have started and opened their sockets to the I/O loop at bind, so the first
    requests after a (re)start pay for neither."""
    from hicache.controller.config import ControllerConfig
    from hicache.controller.sidecar.config import SidecarConfig
    from hicache.controller.sidecar.server import SidecarServer

    ctl = LocalController(ControllerConfig(host_pool_bytes=1 << 20), make_layout("full"), 4)
    config = SidecarConfig(socket_path=tmp_path / "s.sock", worker_threads=3)
    srv = SidecarServer(ctl, config)
    try:
        before = set(threading.enumerate())  # other tests' threads, if any are left
        srv.bind()
        workers = [t for t in set(threading.enumerate()) - before
                   if t.name.startswith("hicache-sidecar-worker")]  # fmt: skip
        assert len(workers) == 3 and all(t.is_alive() for t in workers)
        assert len(srv._push_sockets) == 3 + 1  # the workers' and the lane's
        ctl.check_invariants()
    finally:
        srv.request_stop()
        srv.serve()  # stops at once: nothing in flight
        ctl.close()
