"""Pages only on disk that an engine process reads itself from the sidecar's LMDB file
(controller/client/disk_share.py): the sidecar serves in this process (its controller's
counters and invariants at hand), the engine is another process (CPU shared-memory pools).
The bytes are exact and the pages stay on disk only; the unpin books the read at the
sidecar; a value corrupt or missing makes the load go through the sidecar, which never
serves the bad page and drops it; ``engine_disk_reads = False`` leaves the reads to the
sidecar."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hicache.controller.config import ControllerConfig
from hicache.controller.store.local import LocalController
from hicache.controller.store.page_codec import HEADER_BYTES, decode_header
from hicache.types import ComponentType, Tier
from tests.support.sidecar import EngineProc, ServerThread, wait_for

PAGE = 4
PREFIX = 8 * PAGE
TOKENS = list(range(3000, 3000 + PREFIX + 3))
FULL = ComponentType.FULL
ON_DISK = {"prefix_len": 0, "host_hit_len": 0, "disk_hit_len": PREFIX}


class Sidecar:
    """A sidecar of this process (LMDB disk tier, shared host pages)."""

    def __init__(self, workdir, **options) -> None:
        cfg = ControllerConfig(
            host_pool_bytes=4 << 20,
            disk_path=workdir / "lmdb",
            disk_budget_bytes=32 << 20,
            host_shared=True,
        )
        self.controller = LocalController(cfg)
        self.socket = workdir / "s.sock"
        self.served = ServerThread(self.controller, self.socket, **options)

    @property
    def endpoint(self) -> str:
        return "ipc://" + str(self.socket)

    def counter(self, *key: str) -> float:
        return self.controller.counters._values.get(key, 0)

    def to_disk_only(self) -> None:
        """Every page of the host tier written to disk, then dropped from host."""
        assert self.controller.flush(30)
        for comp in ComponentType:
            self.controller.store.evict(Tier.HOST, 1 << 30, comp)

    def lmdb_env(self):
        return self.controller.store._disk.lmdb.env

    def stored_keys(self) -> list[bytes]:
        with self.lmdb_env().begin() as txn:
            return [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)]

    def stop(self) -> None:
        self.served.stop()
        self.controller.close()


def _engine(side: Sidecar, mix: str = "full", **config) -> EngineProc:
    engine = EngineProc(side.endpoint, "engine-R", mix=mix, request_timeout_s=10.0, **config)
    engine.receive()
    assert engine.call("wait_available", timeout_s=60)["available"], engine.stderr()
    return engine


def _stored_on_disk_only(side: Sidecar, engine: EngineProc) -> None:
    assert engine.call("run", tokens=TOKENS)["backup_done"] >= 1
    assert engine.call("evict_all")["full_tokens"] >= PREFIX
    side.to_disk_only()
    assert engine.call("match", tokens=TOKENS) == ON_DISK


@pytest.mark.parametrize("mix", ["full", "full+swa+mamba"])
def test_the_engine_reads_pages_only_on_disk_itself(workdir, mix):
    side = Sidecar(workdir)
    engine = _engine(side, mix)
    try:
        _stored_on_disk_only(side, engine)
        for n in (1, 2):  # ``start`` checks every byte it loaded
            assert engine.call("start", tokens=TOKENS)["prefix_len"] == PREFIX
            counters = engine.call("status")["counters"]
            assert counters.get("load_engine_read") == n, counters
            assert not counters.get("load_engine_read_fell_back"), counters
            # The unpin told the sidecar, which booked the read and kept the pages.
            wait_for(lambda: side.counter("load", "engine_read") == n, 10, "the unpin")  # noqa: B023
            assert engine.call("evict_all")["full_tokens"] >= PREFIX
            assert engine.call("match", tokens=TOKENS) == ON_DISK  # still on disk only
        assert side.counter("load", "ok") == 0, "no load went through the sidecar"
        pages = side.counter("transfer", "disk_to_device", "pages")
        assert pages >= 2 * PREFIX // PAGE
        assert side.counter("transfer", "disk_to_device", "bytes") > 0
        assert side.controller.store._disk.read_cost().seconds_per_byte is not None
        side.controller.check_invariants()
    finally:
        engine.close()
        side.stop()


def _chain(side: Sidecar) -> list[bytes]:
    """The stored keys in prefix order (each value's header names its parent)."""
    with side.lmdb_env().begin(buffers=True) as txn:
        parents = {bytes(k): decode_header(v).parent_hash for k, v in txn.cursor().iternext()}
    by_parent = {p: k for k, p in parents.items()}
    key = next(k for k, p in parents.items() if p + k[-1:] not in parents)  # the first
    chain = [key]
    while key[:-1] in by_parent:
        key = by_parent[key[:-1]]
        chain.append(key)
    return chain


@pytest.mark.parametrize("damage", [None, "theirs", "ours"])
def test_large_pages_are_read_part_here_part_by_the_sidecar(workdir, damage):
    """With ``engine_split_read_bytes`` at or under the page size, a load of pages only on
    disk goes part to the sidecar (the first 40 %) and is read part here, side by side:
    the bytes exact, each part booked once (the unpin books only the pages the sidecar's
    load did not claim), the sidecar's part read on one thread, the pages still on disk
    only. A bad value fails the sidecar's
    part (and is dropped); one in this engine's part makes the sidecar load that part too
    (which fails it and drops the value): the load falls short, no wrong byte served."""
    side = Sidecar(workdir)
    engine = _engine(side, engine_split_read_bytes=1)
    disk, serial = side.controller.store._disk, []
    direct = disk.read_direct_locked
    disk.read_direct_locked = lambda pages, sink, s=False: (
        serial.append(s) or direct(pages, sink, s)
    )
    try:
        _stored_on_disk_only(side, engine)
        pages = PREFIX // PAGE
        chain = _chain(side)
        assert len(chain) == pages
        if damage:
            _flip_a_payload_bit(side, chain[0] if damage == "theirs" else chain[-1])
        prefix = engine.call("start", tokens=TOKENS)["prefix_len"]  # checks every byte
        counters = engine.call("status")["counters"]
        assert counters.get("load_split") == 1, counters
        if damage:
            assert prefix < PREFIX
            fell_back = counters.get("load_engine_read_fell_back")
            assert fell_back == (1 if damage == "ours" else None), counters
            assert side.counter("failures", "checksum") == 1
            assert side.counter("load", "engine_read") == 0
        else:
            assert prefix == PREFIX
            assert counters.get("load_engine_read") == 1, counters
            wait_for(lambda: side.counter("load", "engine_read") == 1, 10, "the unpin")
            # The sidecar's part (its load) and this engine's (the unpin): every page once.
            assert side.counter("load", "ok") == 1
            assert serial == [True], "the sidecar read its part on its serial reader"
            assert side.counter("transfer", "disk_to_device", "pages") == pages
            assert engine.call("evict_all")["full_tokens"] >= PREFIX
            assert engine.call("match", tokens=TOKENS) == ON_DISK
        side.controller.check_invariants()
    finally:
        engine.close()
        side.stop()


def _flip_a_payload_bit(side: Sidecar, skey: bytes) -> None:
    """Flip one bit of ``skey``'s stored payload inside data.mdb (the file, under LMDB)."""
    with side.lmdb_env().begin(buffers=True) as txn:
        head = bytes(txn.get(skey)[: HEADER_BYTES + 32])
    path = side.controller.store._disk.lmdb.path / "data.mdb"
    data = path.read_bytes()
    at = data.find(head)
    assert at >= 0 and data.find(head, at + 1) < 0
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, at + HEADER_BYTES + 5)
        os.pwrite(fd, bytes([byte[0] ^ 0x10]), at + HEADER_BYTES + 5)
    finally:
        os.close(fd)


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_bad_value_makes_the_sidecar_load_and_drop_it(workdir, damage):
    side = Sidecar(workdir)
    engine = _engine(side)
    try:
        _stored_on_disk_only(side, engine)
        keys = side.stored_keys()
        assert len(keys) == PREFIX // PAGE
        last = keys[-1] if damage == "missing" else keys[0]
        if damage == "corrupt":
            _flip_a_payload_bit(side, last)
        else:  # gone from LMDB behind the index's back
            with side.lmdb_env().begin(write=True) as txn:
                assert txn.delete(last)
        # ``start`` checks every byte it has: what it loaded and what it recomputed.
        assert engine.call("start", tokens=TOKENS)["prefix_len"] < PREFIX
        counters = engine.call("status")["counters"]
        assert counters.get("load_engine_read_fell_back") == 1, counters
        assert not counters.get("load_engine_read"), counters
        failure = "checksum" if damage == "corrupt" else "disk_missing"
        assert side.counter("failures", failure) == 1, side.controller.counters._values
        assert side.counter("load", "engine_read") == 0
        assert side.controller.flush(30)
        assert last not in side.stored_keys(), "the bad value was dropped"
        side.controller.check_invariants()
    finally:
        engine.close()
        side.stop()


def test_without_engine_disk_reads_the_sidecar_reads(workdir):
    side = Sidecar(workdir)
    engine = _engine(side, engine_disk_reads=False)
    try:
        _stored_on_disk_only(side, engine)
        assert engine.call("start", tokens=TOKENS)["prefix_len"] == PREFIX
        counters = engine.call("status")["counters"]
        assert not counters.get("load_engine_read"), counters
        assert side.counter("load", "engine_read") == 0
        assert side.counter("transfer", "disk_to_device", "pages") >= PREFIX // PAGE
        side.controller.check_invariants()
    finally:
        engine.close()
        side.stop()


def test_the_sidecar_frees_the_reader_slot_of_a_killed_engine(workdir):
    side = Sidecar(workdir)
    engine = _engine(side)
    # A process killed in the middle of a read transaction, as an engine reading disk
    # pages may be: its slot in lock.mdb stays behind, holding back the reuse of pages.
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(side.controller.store._disk.lmdb.path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout.readline().strip() == "reading"
        reader.kill()
        reader.wait(30)
        pid = str(reader.pid)
        assert pid in side.lmdb_env().readers().split(), "the dead reader's slot is left"
        engine.close()  # an engine's session ends: the sidecar frees what the dead held
        wait_for(lambda: pid not in side.lmdb_env().readers().split(), 30, "the slot freed")
        side.controller.check_invariants()
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(30)
        engine.close()
        side.stop()


READER = """
import sys, time, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=True, create=False)
txn = env.begin()
print("reading", flush=True)
time.sleep(120)
"""


def _restarted(side: Sidecar, workdir, engine: EngineProc) -> Sidecar:
    """``side`` stopped and a new sidecar started on the same LMDB directory and socket;
    the engine, never restarted, reconnected to it."""
    side.stop()
    wait_for(lambda: not engine.call("status")["available"], 30, "the engine to notice")
    side = Sidecar(workdir)
    wait_for(lambda: engine.call("wait_available", timeout_s=1)["available"], 60, "reconnect")
    return side


@pytest.mark.parametrize("same_file", [True, False])
def test_the_engine_keeps_its_map_of_the_disk_tier_over_a_sidecar_restart(workdir, same_file):
    """A restarted sidecar on the same LMDB file: the engine reads its disk pages through
    the map it had (no fresh map to fault in), exactly. A new file in the same directory
    (another inode: the old one deleted under the kept map) is mapped afresh: the kept
    map, of the old file, never serves a byte."""
    side = Sidecar(workdir)
    engine = _engine(side)
    try:
        _stored_on_disk_only(side, engine)
        assert engine.call("start", tokens=TOKENS)["prefix_len"] == PREFIX  # the map in use
        assert engine.call("evict_all")["full_tokens"] >= PREFIX
        if same_file:
            side = _restarted(side, workdir, engine)
        else:
            side.stop()
            wait_for(lambda: not engine.call("status")["available"], 30, "the engine to notice")
            lmdb_dir = workdir / "lmdb"
            for f in lmdb_dir.iterdir():
                f.unlink()
            side = Sidecar(workdir)  # an empty tier: the pages are stored again below
            wait_for(lambda: engine.call("wait_available", timeout_s=1)["available"], 60, "up")
            assert engine.call("match", tokens=TOKENS)["prefix_len"] == 0
            engine.call("run", tokens=TOKENS)  # prefilled again: nothing cached anywhere
            assert engine.call("evict_all")["full_tokens"] >= PREFIX
            side.to_disk_only()
        assert engine.call("match", tokens=TOKENS) == ON_DISK
        assert engine.call("start", tokens=TOKENS)["prefix_len"] == PREFIX  # every byte checked
        counters = engine.call("status")["counters"]
        assert counters.get("disk_map_kept") == (1 if same_file else None), counters
        assert counters.get("load_engine_read") == 2, counters
        assert not counters.get("load_engine_read_fell_back"), counters
        side.controller.check_invariants()
    finally:
        engine.close()
        side.stop()


def test_the_sidecar_s_part_of_a_parted_load_follows_what_the_loads_showed():
    """Where the engine waited for the sidecar's answer, the part moves towards the one
    that would have ended both together; where it did not, a little more goes to the
    sidecar; it stays within its limits, and a keep hands it to the next session."""
    from hicache.controller.client.disk_share import SHARE_LIMITS, SIDECAR_SHARE, DiskShare

    share = DiskShare(None, b"", {}, {})
    assert share.sidecar_share == SIDECAR_SHARE
    # 40 pages there, 60 here in 10 ms, then 10 ms more waited: the sidecar read 40 in
    # 20 ms (2/ms) against 6/ms here, so a quarter would have ended both together.
    for _ in range(40):
        share.observe(40, 60, 10e-3, 10e-3)
    assert abs(share.sidecar_share - 0.25) < 0.01
    for _ in range(3):  # answers there when this engine ended: more for the sidecar
        before = share.sidecar_share
        share.observe(25, 75, 10e-3, 0.0)
        assert share.sidecar_share > before
    for _ in range(100):
        share.observe(25, 75, 10e-3, 0.0)
    assert share.sidecar_share == SHARE_LIMITS[1]
    for _ in range(100):  # a sidecar that never keeps up: never all the engine's
        share.observe(10, 90, 1e-3, 1.0)
    assert share.sidecar_share == SHARE_LIMITS[0]
    share.observe(0, 90, 1e-3, 1.0)  # nothing to learn from
    assert share.sidecar_share == SHARE_LIMITS[0]

    class Env:
        closed = False

        def close(self):
            self.closed = True

    env = Env()
    mapped = DiskShare(env, b"", {}, {}, identity=(1, 2))
    mapped.sidecar_share = 0.3
    kept = mapped.keep()
    assert kept is not None and kept.sidecar_share == 0.3
    assert not mapped.read([]), "a kept map reads nothing through the share it left"
    kept.close()
    assert env.closed


def test_a_read_here_gives_its_core_away_after_each_mib_and_checks_every_byte(monkeypatch):
    """While the engine reads, a thread of the sidecar's that the kernel queued on its
    core waits for this thread's time slice (channel.yield_cpu): the read gives the core
    away after each MiB it has read, and still copies and checks every page."""
    import contextlib

    import numpy as np

    from hicache.controller.client import disk_share
    from hicache.controller.client.disk_share import YIELD_EVERY_BYTES, DiskShare
    from hicache.controller.store.load_reads import SlotGeometry
    from hicache.controller.store.page_codec import encode_value

    nbytes, pages = 512 << 10, 5  # 2.5 MiB: a yield after pages 2 and 4
    assert YIELD_EVERY_BYTES == 1 << 20
    digest, rng = b"d" * 16, np.random.default_rng(7)
    payloads = [rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes() for _ in range(pages)]
    tag = bytes((int(FULL),))
    values = {
        bytes([i]) * 16 + tag: encode_value(FULL, digest, b"\0" * 16, payloads[i])
        for i in range(pages)
    }

    class Txn:
        def get(self, key):
            return values.get(key)

    class Env:
        def begin(self, buffers=False):
            return contextlib.nullcontext(Txn())

    slots = bytearray(pages * nbytes)
    geometry = {FULL: SlotGeometry([(memoryview(slots), 0, nbytes, nbytes, 0)], [])}
    share = DiskShare(Env(), digest, geometry, {FULL: nbytes})
    yields: list[int] = []

    def read_so_far() -> int:
        return sum(slots[i * nbytes : (i + 1) * nbytes] == payloads[i] for i in range(pages))

    monkeypatch.setattr(disk_share, "yield_cpu", lambda: yields.append(read_so_far()))
    # Each page into its own slot, checked there.
    assert share.read([(FULL, bytes([i]) * 16, i) for i in range(pages)])
    assert yields == [2, 4]  # after each MiB read, not per page nor only at the end
    assert all(slots[i * nbytes : (i + 1) * nbytes] == payloads[i] for i in range(pages))
    bad = bytearray(values[bytes([3]) * 16 + tag])
    bad[-1] ^= 1  # one payload bit
    values[bytes([3]) * 16 + tag] = bytes(bad)
    assert not share.read([(FULL, bytes([i]) * 16, i) for i in range(pages)])  # checked


def test_a_sidecar_opening_frees_reader_slots_of_processes_gone(workdir):
    """A process killed in a read transaction while another (an engine keeping its map
    over the restart) holds the environment open: lock.mdb's table survives, the dead
    slot with it, and the sidecar that opens next frees it."""
    side = Sidecar(workdir)
    engine = _engine(side)  # the tiers open with the first registration
    path = str(side.controller.store._disk.lmdb.path)
    engine.close()
    side.stop()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, path], stdout=subprocess.PIPE,
                              stdin=subprocess.PIPE, text=True)  # fmt: skip
    reader = subprocess.Popen([sys.executable, "-c", READER, path], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "open"
        assert reader.stdout.readline().strip() == "reading"
        reader.kill()
        reader.wait(30)
        side = Sidecar(workdir)  # the table kept (the holder), the dead slot in it
        engine = _engine(side)  # the tier opens: the slot freed then, not at a session end
        assert str(reader.pid) not in side.lmdb_env().readers().split()
        side.controller.check_invariants()
        engine.close()
        side.stop()
    finally:
        for proc in (reader, holder):
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


HOLDER = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=True, create=False)
print("open", flush=True)
sys.stdin.read()
"""


def test_a_kept_map_is_closed_when_no_session_takes_it_over_in_time(workdir):
    """A sidecar away longer than a restart takes: the map kept for it is closed (its
    file, perhaps deleted meanwhile, no longer held mapped here); a fresh one is kept."""
    import time

    from hicache.controller.client import SidecarController
    from hicache.controller.client.disk_share import DiskShare
    from hicache.controller.client.engine_copies import KEPT_DISK_MAP_S

    class Env:
        closed = False

        def close(self):
            self.closed = True

    ctl = SidecarController("ipc://" + str(workdir / "nobody.sock"), "engine-K")
    try:
        for age, closed in ((1.0, False), (KEPT_DISK_MAP_S + 1.0, True)):
            env = Env()
            ctl._kept_disk = DiskShare(env, b"", {}, {}, identity=(1, 2))
            ctl._kept_disk_at = time.monotonic() - age
            ctl._expire_kept_disk(time.monotonic())
            assert env.closed is closed
            assert (ctl._kept_disk is None) is closed
    finally:
        ctl.close()
