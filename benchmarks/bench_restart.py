"""Loads from the disk tier after a sidecar restart, against a raw read of the same bytes.

    python benchmarks/bench_restart.py [--device cpu|cuda] [--sizes-kib 32,256,1024,8192]
        [--total-mib 128] [--repeat 3] [--json OUT] [--sample-stacks] [--compare-ref REV]
        [--readahead] [--host-copy] [--no-engine-reads] [--both] [--pause-s 0.05]

For each page size, a real ``hicache serve`` (a subprocess with its own LMDB directory
under a temporary directory) is filled by an engine — pools registered through the public
:class:`SidecarController`, shared-memory tensors on a CPU, CUDA tensors on a GPU — whose
backups are written through to disk; the sidecar is stopped (SIGTERM: every queued write
committed) and started again on the same LMDB (its warm start off: ``prewarm_bytes=0``,
so that every load below reads disk; on a CPU ``disk_load_direct`` is left on, its
default, pages read straight into the engine's slots, unless ``--host-copy``; a GPU's loads
go through host pages either way), and the same engine, never restarted, loads the whole
prefix back (pin, load, unpin) once its client has reconnected by itself. On a CPU the
engine reads those pages itself from the sidecar's LMDB file, straight into its slots
(``engine_disk_reads``, controller/client/disk_share.py; pages of 64 KiB or more,
``engine_split_read_bytes``, half of them, the sidecar reading the other half at the same
time), unless ``--no-engine-reads`` (the sidecar reads them all, as above); ``--both`` runs
each page size both ways, one after the other, each row saying who read the pages
(``engine``: all or part of them).
Timed, each as GB/s:

* ``first_warm``: the first load after a restart, the OS page cache of the LMDB file left
  as it was (what the sidecar's own one-time costs add); the median over ``--repeat``
  restarts, as ``steady`` is over as many loads;
* ``first_cold``: the first load after a second restart, the LMDB file's cached pages
  dropped first (``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs no privilege; the
  bytes still cached afterwards are printed when ``fincore`` is there);
* ``steady``: the median of 3 × ``--repeat`` later loads, each of pages held only on disk
  (the host tier cleared with the admin ``clear`` verb before each), one right after
  the other;
* ``after_idle``: as ``steady``, but each load after the lead-in a first load has: the
  engine idle for ``--pause-s`` (0.05 s), then a lookup. A load after the processes sat
  idle costs more whether or not the sidecar restarted (on the 2-core development box
  a 64 MiB load of 256 KiB pages took ~13 ms after a 0.1 s pause against ~10.6 back to
  back): this is the steady load a first load is compared with; 3 × ``--repeat`` of them;
* ``again``: the median of ``--repeat`` loads right after the steady ones, the host tier
  left as they left it: what the next load of the same pages gets (read straight into the
  slots, they stayed on disk only and are read from disk again; read into host pages, as
  with ``--host-copy`` or on a GPU, they are on host);
* ``raw_warm`` / ``raw_cold``: one thread reading as many bytes of the LMDB file (its
  first ``total`` bytes, in reads of one page) into one buffer touched beforehand, with
  the page cache warm, and after the same drop.

* ``box idle``: the same pause's cost to the machine alone, no cache in it: one thread
  copying and hashing as many bytes in 256 KiB pieces (a disk load's reads' work), the
  median after a ``--pause-s`` sleep over the median back to back (on the 2-core
  development box 1.04-1.42 over five runs: a small virtual machine's CPU runs slower for
  a while after sitting idle, which every first load pays).

Printed ratios: ``first_warm / after_idle`` (seconds: what a restart adds, the goal is
at most 1.2; ``first/busy``: over ``steady`` instead), ``steady ÷ raw_warm`` and
``first_cold ÷ raw_cold`` (throughput: how close a load through the sidecar comes to the
file system). Every load's bytes are checked against the
engine's originals: a benchmark of wrong bytes measures nothing.

``--compare-ref REV``: each page size is run twice back to back, first with the sidecar
of git revision REV (its library imported as ``hicache_ref``), then with this one's, the
same engine code and the same box; each row says whose sidecar it was.

``--sample-stacks``: the restarted sidecar runs under ``benchmarks/stack_sampler.py`` and
the engine samples its own threads too; printed for the first load after the first restart
and for the next steady load, where each process's busy threads spent that time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_tree import import_revision  # beside this script
from stack_sampler import Sampler, summary

from hicache import CacheConfig, DevicePools, ModelLayout, PageRef
from hicache.controller.client import SidecarClientConfig, SidecarController
from hicache.controller.client.admin import AdminClient
from hicache.controller_api import LoadResult, Presence
from hicache.keys import page_hashes
from hicache.types import ComponentType

FULL = ComponentType.FULL
SAMPLER = Path(__file__).resolve().parent / "stack_sampler.py"
READAHEAD = False  # --readahead
HOST_COPY = False  # --host-copy
ENGINE_READS = True  # not --no-engine-reads
PAUSE_S = 0.05  # --pause-s
SETTINGS: list[str] = []  # --set KEY=VALUE: passed to every sidecar this run starts
SIDECAR = "hicache.controller.sidecar.process"
KIB, MIB = 1 << 10, 1 << 20


def layout_for(page_bytes: int) -> ModelLayout:
    """One full-attention layer whose one-token page is ``page_bytes`` (K and V, fp32)."""
    return ModelLayout(("full",), num_kv_heads=1, head_dim=page_bytes // 8, dtype="float32",
                       model_id=f"bench-restart-{page_bytes}")  # fmt: skip


class Sidecar:
    """``hicache serve`` on ``disk`` for ``layout`` (page size 1 token), started and stopped."""

    def __init__(self, work: Path, layout: ModelLayout, host_bytes: int, disk: Path) -> None:
        self.work, self.disk = work, disk
        self.stacks: Path | None = None  # set: the next start runs under the stack sampler
        self.socket = work / "restart.sock"
        self.layout_file = work / "layout.json"
        self.layout_file.write_text(json.dumps({**layout.to_dict(), "page_size": 1}))
        self.host_bytes = host_bytes
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self.module, self.env = SIDECAR, None  # (--compare-ref: the revision's, its path)

    def start(self) -> float:
        """Start it; the seconds until its ready file appeared."""
        ready = self.work / "ready.json"
        ready.unlink(missing_ok=True)
        t0 = time.perf_counter()
        sampler = [] if self.stacks is None else [str(SAMPLER), str(self.stacks)]
        self.proc = subprocess.Popen(
            [
                sys.executable, *sampler, "-m", self.module,
                "--socket", str(self.socket), "--disk-path", str(self.disk),
                "--disk-budget-bytes", str(4 * self.host_bytes), "--metrics-port", "0",
                "--host-pool-bytes", str(self.host_bytes), "--layout-file", str(self.layout_file),
                "--ready-file", str(ready), "--log-level", "warning",
                # The disk path is what is timed: no warm start reading pages back to host,
                # nor (unless --readahead) into the OS cache.
                "--set", "prewarm_bytes=0",
                *([] if READAHEAD or self.env is not None else ["--set", "prewarm_disk_bytes=0"]),
                # Pages read straight into the engine's slots (disk_load_direct, on by
                # default) unless --host-copy: read into host pages first, kept there. A
                # revision (--compare-ref) runs with its own default.
                *(["--set", "disk_load_direct=false"] if HOST_COPY and self.env is None else []),
                *(a for kv in SETTINGS for a in ("--set", kv)),
            ],
            cwd=self.work,  # not a checkout's root, whose hicache/ would shadow the installed one
            env=self.env,
        )  # fmt: skip
        while not ready.exists():
            if self.proc.poll() is not None:
                raise SystemExit("the sidecar did not start")
            time.sleep(0.01)
        self.info = json.loads(ready.read_text())
        return time.perf_counter() - t0

    @property
    def endpoint(self) -> str:
        return "ipc://" + str(self.socket)

    def admin(self) -> AdminClient:
        return AdminClient(self.endpoint, token_file=self.info["admin_token_file"], timeout_s=60)

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(300) == 0, "the sidecar did not stop cleanly"
        self.proc = None


def lmdb_files(disk: Path) -> list[Path]:
    return sorted(p for p in disk.iterdir() if p.suffix == ".mdb")


def drop_page_cache(disk: Path) -> str:
    """Drop the cached pages of the LMDB files (nobody maps them now); how it was done and,
    with ``fincore``, the bytes still cached."""
    for path in lmdb_files(disk):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    how = "posix_fadvise(DONTNEED) on " + ", ".join(p.name for p in lmdb_files(disk))
    if shutil.which("fincore"):
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", str(disk / "data.mdb")],
            capture_output=True,
            text=True,
        )
        if out.returncode == 0 and out.stdout.strip():
            how += f"; {int(out.stdout.split()[0]) / MIB:.1f} MiB of data.mdb still cached"
    return how


def raw_read_s(path: Path, total: int, chunk: int) -> float:
    """One thread reading the first ``total`` bytes of ``path`` in reads of ``chunk`` into
    one buffer."""
    buf = np.ones(total, np.uint8)  # touched first, as the host pool's pages are
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        off = 0
        while off < total:
            n = os.preadv(fd, [view[off : off + chunk]], off)
            if n <= 0:
                raise SystemExit(f"{path} is shorter than {total} bytes")
            off += n
        return time.perf_counter() - t0
    finally:
        os.close(fd)


class Engine:
    """An engine's pools and client; ``src`` holds the prefix, loads go into ``dst``."""

    def __init__(self, layout: ModelLayout, pages: int, device: torch.device, endpoint: str):
        cfg = CacheConfig(page_size=1, full_slots=2 * pages + 1, device=str(device),
                          shared_memory=device.type == "cpu")  # fmt: skip
        self.pools = DevicePools.allocate(layout, cfg)
        buf = self.pools.full.buffer
        buf.copy_(torch.randint(-(1 << 20), 1 << 20, buf.shape, dtype=torch.int32).view(buf.dtype))
        self.src = self.pools.alloc_kv_pages(pages)
        self.dst = self.pools.alloc_kv_pages(pages)
        self.device = device
        self.window = (0.0, 0.0)  # the last load's start and end, wall clock
        hs = page_hashes(list(range(pages)), layout.fingerprint(1), 1)
        self.hashes = hs
        self.refs_src = [PageRef(FULL, h, hs[i - 1] if i else b"\0" * 16, int(s))
                         for i, (h, s) in enumerate(zip(hs, self.src))]  # fmt: skip
        self.refs_dst = [PageRef(FULL, r.page_hash, r.parent_hash, int(d))
                         for r, d in zip(self.refs_src, self.dst)]  # fmt: skip
        client_cfg = SidecarClientConfig(request_timeout_s=600.0, backup_timeout_s=600.0,
                                         reconnect_interval_s=0.05,
                                         engine_disk_reads=ENGINE_READS)  # fmt: skip
        self.client = SidecarController(endpoint, "bench-restart", client_cfg)
        self.client.register(layout, 1, self.pools)

    def fill(self) -> None:
        assert self.client.backup(self.refs_src).wait(600), "the backup failed"

    def wait_connected(self, timeout_s: float = 120.0) -> float:
        """Wait until the client reconnected to a restarted sidecar and sees the prefix on
        disk; the seconds it took."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            if self.client.available:
                pres = self.client.lookup(self.hashes[-1:], [FULL]).presence[FULL]
                if pres[0] != Presence.ABSENT:
                    return time.perf_counter() - t0
            time.sleep(0.01)
        raise SystemExit("the engine did not reconnect to the restarted sidecar")

    def load_s(self) -> float:
        """Pin and load the whole prefix into ``dst``; its seconds. The bytes are checked."""
        buf = self.pools.full.buffer
        if self.device.type == "cuda":
            buf[:, :, torch.as_tensor(self.dst, device=buf.device)] = 0
            torch.cuda.synchronize(self.device)
        else:
            # Through NumPy, on this thread: torch's CPU ops hand large work to its OpenMP
            # threads, which then spin on both cores of a small machine for a while and
            # hold up the messages of the load timed next (a first pin 1.2 -> 4.4 ms).
            buf.view(torch.uint8).numpy()[:, :, self.dst] = 0
        t0, self.window = time.perf_counter(), (time.time(), 0.0)
        pin = self.client.pin([r.key for r in self.refs_dst], 600.0)
        assert pin is not None, "the prefix is not held"
        res = self.client.load(self.refs_dst, pin, 600.0)
        self.client.unpin(pin)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        self.window = (self.window[0], time.time())  # wall clock, for the stack samples
        assert res is LoadResult.LOADED, res
        if self.device.type == "cuda":
            src = torch.as_tensor(self.src, device=buf.device)
            dst = torch.as_tensor(self.dst, device=buf.device)
            bits = buf.view(torch.int32)  # bit patterns: NaNs compare unequal as floats
            same = torch.equal(bits[:, :, src], bits[:, :, dst])
        else:  # NumPy again (see above), bit patterns
            raw = buf.view(torch.uint8).numpy()
            same = np.array_equal(raw[:, :, self.src], raw[:, :, self.dst])
        assert same, "a load did not restore the bytes"
        return seconds

    def close(self) -> None:
        self.client.close()
        self.pools.close()


def box_idle_cost(total: int, samples: int) -> float:
    """What sitting idle for ``--pause-s`` costs this machine, not the cache: one thread
    copying and hashing ``total`` bytes in 256 KiB pieces (the work of a disk load's
    reads, with no other process or thread), the median after a pause over the median
    back to back."""
    import xxhash

    piece = 256 * KIB
    src = np.frombuffer(os.urandom(total), np.uint8)
    dst = np.empty_like(src)

    def once() -> float:
        t0 = time.perf_counter()
        for lo in range(0, total, piece):
            np.copyto(dst[lo : lo + piece], src[lo : lo + piece])
            xxhash.xxh3_64_intdigest(dst[lo : lo + piece])
        return time.perf_counter() - t0

    once()
    busy = statistics.median(once() for _ in range(samples))
    idle = []
    for _ in range(samples):
        time.sleep(PAUSE_S)
        idle.append(once())
    return statistics.median(idle) / busy


def run_size(
    work: Path,
    page_bytes: int,
    total: int,
    device: torch.device,
    repeat: int,
    sample: bool,
    ref: Path | None = None,
) -> dict:
    """One page size's figures; ``ref``: with the sidecar of the revision imported there."""
    pages = total // page_bytes
    total = pages * page_bytes
    layout = layout_for(page_bytes)
    disk = work / "lmdb"
    sidecar = Sidecar(work, layout, total + total // 8 + 16 * MIB, disk)
    out: dict = {"page_KiB": page_bytes // KIB, "pages": pages, "MiB": total / MIB}
    if ref is not None:
        sidecar.module = SIDECAR.replace("hicache.", "hicache_ref.", 1)
        sidecar.env = {**os.environ, "PYTHONPATH": str(ref)}
    sidecar.start()
    engine = Engine(layout, pages, device, sidecar.endpoint)
    try:
        engine.fill()
        sidecar.stop()
        here = None
        if sample:
            sidecar.stacks = work / "sidecar_stacks.json"
            here = Sampler().start()
        out["ready_s"] = sidecar.start()
        out["reconnect_s"] = engine.wait_connected()
        firsts = [engine.load_s()]
        windows = {"first load after the restart": engine.window}
        if sample:  # a second load of the same sidecar's life, from disk again
            admin = sidecar.admin()
            admin.clear(("host",), all_namespaces=True)
            admin.close()
            out["second_warm_s"] = engine.load_s()
            windows["the next load, from disk again"] = engine.window
        sidecar.stop()
        if here is not None:
            here.stop()
            here.write(work / "engine_stacks.json")
            for what, (a, b) in windows.items():
                for proc in ("sidecar", "engine"):
                    print(f"{page_bytes // KIB} KiB pages, {what}, {proc}:")
                    print("\n".join(summary(work / f"{proc}_stacks.json", a, b)))
            sidecar.stacks = None
        for _ in range(repeat - 1):  # more restarts, a first load after each
            sidecar.start()
            engine.wait_connected()
            firsts.append(engine.load_s())
            sidecar.stop()
        out["first_warm_all_s"] = firsts
        out["first_warm_s"] = statistics.median(firsts)
        # The engine's map of the LMDB file closed (the sidecar is stopped; its client
        # would close it when it noticed): a mapped page stays cached through the drop.
        engine.client.end_disk_reads()
        out["drop"] = drop_page_cache(disk)
        out["raw_cold_s"] = raw_read_s(disk / "data.mdb", total, page_bytes)
        drop_page_cache(disk)
        sidecar.start()
        engine.wait_connected()
        out["first_cold_s"] = engine.load_s()
        steady, idle = [], []
        admin = sidecar.admin()
        # Three times as many steady and after-idle loads as restarts (each a fraction
        # of a second): the ratios' denominators are then the steadier medians.
        for _ in range(3 * repeat):
            admin.clear(("host",), all_namespaces=True)
            steady.append(engine.load_s())
        again = [engine.load_s() for _ in range(repeat)]  # the host tier left as it is
        for _ in range(3 * repeat):  # the lead-in of a first load: idle, then a lookup
            admin.clear(("host",), all_namespaces=True)
            time.sleep(PAUSE_S)
            engine.wait_connected()
            idle.append(engine.load_s())
        out["after_idle_s"] = statistics.median(idle)
        out["box_idle_cost"] = box_idle_cost(total, 3 * repeat)
        admin.close()
        out["steady_s"] = statistics.median(steady)
        out["again_s"] = statistics.median(again)
        out["raw_warm_s"] = min(raw_read_s(disk / "data.mdb", total, page_bytes) for _ in range(3))
    finally:
        out["engine_read_loads"] = engine.client.counters["load_engine_read"]
        out["engine_read_fell_back"] = engine.client.counters["load_engine_read_fell_back"]
        engine.close()
        if sidecar.proc is not None:
            sidecar.stop()
        shutil.rmtree(disk, ignore_errors=True)
    for k in ("first_warm", "first_cold", "steady", "after_idle", "again", "raw_warm",
              "raw_cold"):  # fmt: skip
        out[f"{k}_GBps"] = total / out[f"{k}_s"] / 1e9
    out["first_warm_over_after_idle"] = out["first_warm_s"] / out["after_idle_s"]
    out["first_warm_over_steady"] = out["first_warm_s"] / out["steady_s"]
    out["steady_x_raw_warm"] = out["raw_warm_s"] / out["steady_s"]
    out["first_cold_x_raw_cold"] = out["raw_cold_s"] / out["first_cold_s"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes-kib", default="32,256,1024,8192")
    p.add_argument("--total-mib", type=int, default=128, help="bytes loaded per page size")
    p.add_argument(
        "--repeat", type=int, default=3, help="first loads (a restart each) and steady loads"
    )
    p.add_argument("--json", help="also write the figures here")
    p.add_argument(
        "--pause-s",
        type=float,
        default=0.05,
        help="the idle time before each after_idle load (then a lookup, as a first load "
        "has after the reconnect)",
    )
    p.add_argument(
        "--readahead",
        action="store_true",
        help="leave the warm start's OS readahead on (prewarm_disk_bytes): the first loads "
        "after a restart then find the hottest pages in the OS cache",
    )
    p.add_argument(
        "--host-copy",
        action="store_true",
        help="loads read pages into host pages first and keep them there (disk_load_direct "
        "off); without it they are read straight into the engine's slots (the default)",
    )
    p.add_argument(
        "--no-engine-reads",
        action="store_true",
        help="the sidecar reads the pages only on disk (engine_disk_reads off); without it "
        "a CPU engine reads them itself from the sidecar's LMDB file",
    )
    p.add_argument(
        "--both", action="store_true", help="each page size with and without engine reads"
    )
    p.add_argument("--sample-stacks", action="store_true",
                   help="where the sidecar's and the engine's time goes in the first load "
                   "after a restart and in the next (benchmarks/stack_sampler.py)")  # fmt: skip
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a sidecar setting for every sidecar started (e.g. reader_threads=1)",
    )
    p.add_argument("--compare-ref", metavar="REV",
                   help="also run each size with the sidecar of this git revision")  # fmt: skip
    args = p.parse_args()
    global READAHEAD, HOST_COPY, ENGINE_READS, PAUSE_S
    READAHEAD, HOST_COPY, ENGINE_READS = args.readahead, args.host_copy, not args.no_engine_reads
    PAUSE_S = args.pause_s
    SETTINGS[:] = args.set
    logging.getLogger("hicache.sidecar.client").setLevel(logging.ERROR)  # the restarts
    device = torch.device(args.device)
    sizes = [int(s) * KIB for s in args.sizes_kib.split(",")]
    work = Path(tempfile.mkdtemp(prefix="hcrs", dir="/tmp"))
    rows = []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    try:
        direct = device.type == "cpu" and not HOST_COPY
        how = "read straight into the engine's slots" if direct else "read into host pages"
        if direct and not args.both:
            how += ", by the engine" if ENGINE_READS else ", by the sidecar"
        print(f"restart and disk loads on {name} ({args.total_mib} MiB per page size, {how}): GB/s")
        head = ("page KiB", "first warm", "first cold", "steady", "after idle", "again",
                "raw warm", "raw cold", "first/idle", "first/busy", "steady×raw",
                "cold×raw", "box idle")  # fmt: skip
        print("  " + " ".join(f"{h:>12}" for h in head))
        ref = None
        if args.compare_ref:
            ref = work / "ref"
            import_revision(args.compare_ref, ref)
        runs = [(args.compare_ref, ref), ("this", None)] if ref else [(None, None)]
        ways = [True, False] if args.both else [ENGINE_READS]
        for size, (code, at), way in ((s, r, w) for s in sizes for r in runs for w in ways):
            ENGINE_READS = way
            r = run_size(
                work, size, args.total_mib * MIB, device, args.repeat, args.sample_stacks, at
            )
            r["sidecar"], r["engine_reads"] = code, way
            rows.append(r)
            kib = r["page_KiB"] if code is None else f"{r['page_KiB']} {code[:7]}"
            if args.both:  # who read the pages (the engine only those under 64 KiB)
                kib = f"{kib} {'engine' if r['engine_read_loads'] else 'sidecar'}"
            cells = [kib, r["first_warm_GBps"], r["first_cold_GBps"], r["steady_GBps"],
                     r["after_idle_GBps"], r["again_GBps"], r["raw_warm_GBps"],
                     r["raw_cold_GBps"], r["first_warm_over_after_idle"],
                     r["first_warm_over_steady"],
                     r["steady_x_raw_warm"], r["first_cold_x_raw_cold"],
                     r["box_idle_cost"]]  # fmt: skip
            print(
                "  " + " ".join(f"{c:12.2f}" if isinstance(c, float) else f"{c:>12}" for c in cells)
            )
        print(f"page cache dropped with {rows[0]['drop'] if rows else '-'}")
        print("ready after restart (s): " + ", ".join(f"{r['ready_s']:.2f}" for r in rows))
        print("engine reconnected (s): " + ", ".join(f"{r['reconnect_s']:.2f}" for r in rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
