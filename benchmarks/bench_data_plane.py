"""The whole data plane, path by path, against a memcpy of the same bytes in the same run.

    python benchmarks/bench_data_plane.py --device cpu|cuda [--sizes-mib 1,64,256,1024]
        [--repeat 5] [--reply-spin-s 0] [--paths blocks,pools] [--json OUT]

Each path moves ``size`` bytes between an engine's memory and the host pool of a real
``hicache serve`` (or of an in-process controller), and is printed as GB/s and as a
ratio to a memcpy of the same bytes between the same kinds of memory (host ↔ host on a
CPU; pinned host ↔ device on a GPU, each way):

* ``vllm_store`` / ``vllm_load``: an engine's own block tensors (vLLM's shape: one byte
  tensor per layer, a row per block, 16 layers × 64 KiB = a 1 MiB page per block) stored
  into host pages the sidecar hands out and loaded back from host pages, one copy each
  way (hicache/integrations/engine_blocks.py, what the vLLM worker runs);
* ``vllm_store_ahead``: the same store with its pages asked for a step ahead, as the
  vLLM worker does when vLLM announces a step's stores (``EngineBlocks.prebook``): the
  ``store_begin`` requests are sent, the step between emulated by waiting until their
  answers are in (not timed), then the store is timed from its start to its commit's
  answer;
* ``vllm_load_handed``: the same load as the worker makes it when vLLM's scheduler has
  pinned the pages and named their host pages (``EngineBlocks.load_handed``; the
  scheduler's pin, made in its own step, is not timed);
* ``vllm_store_and_load``: a store and a load at once as vLLM's worker makes them, each
  on a thread it keeps (the store's pages asked for a step ahead, the load handed pinned;
  GPU: against two concurrent memcpys, one each way; CPU: against two memcpys, one after
  the other); ``vllm_store_and_load_plain``: the plain store and load at once;
* ``backup``: the sidecar copies registered engine pools into host pages;
* ``backup_and_load``: such a backup and a load-back of other pages through the sidecar
  at once, from two threads of the engine (GPU: against two concurrent memcpys);
* ``sidecar_load``: a load-back through the sidecar of pages on host (the engine copies
  them from the shared host pages);
* ``in_process_load``: the same load-back by a :class:`LocalController` in this process;
* ``sidecar_load_runs`` / ``in_process_load_runs`` (GPU): both load-backs as 2-D copies
  over the runs of pages on the copy engines (``TransferEngine.load_runs``), not the kernel.

The timed figure of each is the median of ``--repeat`` runs after one warm-up. The
memcpy of each size is timed before and after the paths and the faster kept (on a CPU,
the faster of torch's ``copy_`` and numpy's single-threaded copy). Then, for one page
(the 1 MiB size): each path's time in ms beside the copy alone, a one-page lookup (a
round trip to the sidecar) and a ``store_begin`` alone of 1, 8 and 64 pages, and the
stages of one store and one load of each size (the mean of ``--repeat`` runs, and the
longest single call of each).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from hicache import CacheConfig, DevicePools, ModelLayout, PageKey, PageRef
from hicache.controller import ControllerConfig, LocalController
from hicache.controller.client import SidecarClientConfig, SidecarController
from hicache.controller.store.transfer_engine import TransferEngine
from hicache.integrations.engine_blocks import BlockSegment, EngineBlocks, HandedPages
from hicache.keys import page_hashes
from hicache.types import ComponentType

FULL = ComponentType.FULL
MIB = 1 << 20
LAYERS = 16
LAYER_BLOCK_BYTES = 64 << 10  # one layer's K and V of one 16-token block (8 heads, 128 dims, bf16)
PAGE_BYTES = LAYERS * LAYER_BLOCK_BYTES  # 1 MiB
TOKENS = 16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[int], object], repeat: int, device: torch.device) -> float:
    fn(-1)  # warm-up
    times = []
    for i in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn(i)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class StageClock:
    """Wall time of each stage of stores or loads: the client's calls (``begin_store``
    or ``send_begin_store`` and ``receive_begin_store``, ``commit_store``, ``send_pin``
    and ``receive_pin`` or ``pin``, ``prefetch``, ``unpin``), the copies' launches
    (``copy_start``) and the waits for them (``copy_wait``). Installed on one client and
    one engine's copies for the ``with`` block."""

    CALLS = (
        "begin_store",
        "send_begin_store",
        "receive_begin_store",
        "commit_store",
        "send_pin",
        "receive_pin",
        "pin",
        "prefetch",
        "unpin",
    )

    def __init__(self, client: SidecarController, engine: EngineBlocks) -> None:
        self.client, self.engine = client, engine
        self.ms: dict[str, float] = {}
        self.longest_ms: dict[str, float] = {}  # the longest single call of each stage

    def _timed(self, name: str, fn: Callable) -> Callable:
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                ms = (time.perf_counter() - t0) * 1e3
                self.ms[name] = self.ms.get(name, 0.0) + ms
                self.longest_ms[name] = max(self.longest_ms.get(name, 0.0), ms)

        return run

    def __enter__(self) -> StageClock:
        import hicache.integrations.engine_blocks as eb

        self._wait = eb.wait_all
        eb.wait_all = self._timed("copy_wait", eb.wait_all)
        for name in self.CALLS:
            setattr(self.client, name, self._timed(name, getattr(self.client, name)))
        self._copies = [c for c in self.engine._copies_now() if c is not None]
        for c in self._copies:
            c.start = self._timed("copy_start", c.start)
        return self

    def __exit__(self, *exc) -> None:
        import hicache.integrations.engine_blocks as eb

        eb.wait_all = self._wait
        for name in self.CALLS:
            del self.client.__dict__[name]
        for c in self._copies:
            del c.__dict__["start"]


#: which memcpy each path is compared with
FLOOR_OF = {
    "copy_alone_to_host": "to_host", "copy_alone_to_device": "to_device",
    "vllm_store": "to_host", "vllm_store_ahead": "to_host", "backup": "to_host",
    "vllm_load": "to_device",
    "vllm_load_handed": "to_device",
    "sidecar_load": "to_device", "in_process_load": "to_device",
    "sidecar_load_runs": "to_device", "in_process_load_runs": "to_device",
    "vllm_store_and_load": "both", "vllm_store_and_load_plain": "both",
    "backup_and_load": "both",
}  # fmt: skip


class Memcpy:
    """Copies of ``nbytes`` between the kinds of memory the paths move between, by kind
    (``to_host``, ``to_device``, ``both``): on a CPU, host to host by torch's ``copy_``
    and by numpy's single-threaded copy (whichever is faster is the memcpy; ``both``: two
    of them, one after the other); on a GPU, pinned host <-> device, and both ways at
    once on two streams."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if device.type == "cpu":
            a = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
            b = torch.empty_like(a).fill_(2)
            a_np, b_np = a.numpy(), b.numpy()
            host = [lambda: b.copy_(a), lambda: np.copyto(b_np, a_np)]
            twice = [
                lambda: (b.copy_(a), a.copy_(b)),
                lambda: (np.copyto(b_np, a_np), np.copyto(a_np, b_np)),
            ]
            self.kinds = {"to_host": host, "to_device": host, "both": twice}
            return
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory().fill_(1)
        host2 = torch.empty(nbytes, dtype=torch.uint8).pin_memory().fill_(1)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(2)
        dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(2)
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def both() -> None:
            with torch.cuda.stream(s1):
                host.copy_(dev, non_blocking=True)
            with torch.cuda.stream(s2):
                dev2.copy_(host2, non_blocking=True)

        self.kinds = {
            "to_host": [lambda: host.copy_(dev, non_blocking=True)],
            "to_device": [lambda: dev.copy_(host, non_blocking=True)],
            "both": [both],
        }


def _beside(
    fn: Callable[[int], object], path: str, memcpy: Memcpy, repeat: int, device: torch.device,
    prepare: Callable[[int], object] | None = None,
) -> tuple[float, float]:  # fmt: skip
    """The median seconds of ``fn`` over ``repeat`` runs after a warm-up, and of its
    memcpy (``FLOOR_OF[path]``; the fastest where there are several), each memcpy run
    right after a run of ``fn``: a host whose load changes during the benchmark moves
    both figures alike. ``prepare(i)``, where given, runs untimed before ``fn(i)``."""
    copies = memcpy.kinds[FLOOR_OF[path]]
    prepare = prepare or (lambda i: None)
    prepare(-1)
    fn(-1)
    for c in copies:
        c()
    times: list[list[float]] = [[] for _ in range(1 + len(copies))]
    for i in range(repeat):
        prepare(i)
        for k, run in enumerate([lambda i=i: fn(i), *copies]):
            _sync(device)
            t0 = time.perf_counter()
            run()
            _sync(device)
            times[k].append(time.perf_counter() - t0)
    medians = [statistics.median(t) for t in times]
    return medians[0], min(medians[1:])


#: size -> {"store"|"load": {stage: ms}}: a store's and a load's stages (StageClock)
STAGES: dict[int, dict[str, dict[str, float]]] = {}
#: (size, "store"|...) -> {stage: ms}: the longest single call of each stage
LONGEST: dict[tuple[int, str], dict[str, float]] = {}
#: pages -> (median, p90) ms of a ``store_begin`` alone (a round trip and its pages)
BEGIN_MS: dict[int, tuple[float, float]] = {}
#: a lookup of one page through the sidecar (a round trip), seconds
ROUND_TRIP_S: list[float] = []


class Sidecar:
    """A ``hicache serve`` without a disk tier, serving ``layout``."""

    def __init__(self, work: Path, layout: ModelLayout, page_size: int, host_bytes: int) -> None:
        self.socket = work / f"{layout.model_id}.sock"
        layout_file = work / f"{layout.model_id}.json"
        layout_file.write_text(json.dumps({**layout.to_dict(), "page_size": page_size}))
        ready = work / f"{layout.model_id}.ready"
        argv = [
            "--socket", str(self.socket), "--no-disk", "--metrics-port", "0",
            "--host-pool-bytes", str(host_bytes), "--layout-file", str(layout_file),
            "--ready-file", str(ready), "--log-level", "warning",
        ]  # fmt: skip
        cmd = [sys.executable, "-m", "hicache.controller.sidecar.process", *argv]
        if TRACE_DIR:  # the stages of its requests, written when it stops (sidecar_trace.py)
            trace = TRACE_DIR[0] / f"sidecar_{layout.model_id}.json"
            cmd = [sys.executable, "-c", (
                f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import sidecar_trace; sidecar_trace.install_server({str(trace)!r}); "
                "from hicache.controller.sidecar.process import main; "
                f"sys.exit(main({argv!r}))"
            )]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            cwd=work,  # not a checkout's root, whose hicache/ would shadow the installed one
        )
        while not ready.exists():
            if self.proc.poll() is not None:
                raise SystemExit("the sidecar did not start")
            time.sleep(0.05)

    @property
    def endpoint(self) -> str:
        return "ipc://" + str(self.socket)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


#: where ``--trace-dir`` puts the traces of both sides' request stages (empty: not traced)
TRACE_DIR: list[Path] = []
#: the clients' ``reply_spin_s`` (``--reply-spin-s``)
REPLY_SPIN_S: list[float] = [0.0]


def _client(endpoint: str, name: str) -> SidecarController:
    cfg = SidecarClientConfig(
        request_timeout_s=600.0, backup_timeout_s=600.0, reply_spin_s=REPLY_SPIN_S[0]
    )
    return SidecarController(endpoint, name, cfg)


def _handed(scheduler: SidecarController, hashes: list[bytes]) -> HandedPages:
    """vLLM's scheduler's pin of a load, naming the pages' host pages for the worker."""
    keys = [PageKey(FULL, h) for h in hashes]
    pin = scheduler.receive_pin(scheduler.send_pin(keys, 600.0, host_pages=True))
    assert pin is not None and min(pin.host_pages) >= 0, "the scheduler's pin failed"
    instance = scheduler.sidecar_instance(pin.generation)
    return HandedPages(pin.pin_id, instance, pin.deadline, tuple(pin.host_pages))


def engine_block_paths(
    work: Path, sizes: list[int], device: torch.device, repeat: int
) -> dict[int, dict[str, tuple[float, float]]]:
    """vLLM's paths: block tensors of the engine's own ↔ host pages, one copy each way."""
    half = PAGE_BYTES // 2
    layout = ModelLayout(("full",), num_kv_heads=1, head_dim=half // 4, dtype="float32",
                         model_id="bench-blocks")  # fmt: skip
    blocks = max(sizes) // PAGE_BYTES
    sidecar = Sidecar(work, layout, 1, (repeat + 4) * max(sizes) + 64 * MIB)
    try:
        layers = [
            torch.randint(0, 256, (2 * blocks, LAYER_BLOCK_BYTES), dtype=torch.uint8).to(device)
            for _ in range(LAYERS)
        ]
        k = LAYER_BLOCK_BYTES // 2
        segments = [BlockSegment(t, 0, k, i * k) for i, t in enumerate(layers)]
        segments += [BlockSegment(t, k, k, half + i * k) for i, t in enumerate(layers)]
        client = _client(sidecar.endpoint, "bench-blocks")
        client.attach(layout, 1)
        engine = EngineBlocks(client, [segments], device, FULL)
        assert engine.available, "the sidecar's host pages could not be mapped"
        engine.warm()  # as the vLLM worker does: no first copy compiles its kernel
        counter = iter(range(1 << 30))

        def refs(n: int, tag: int) -> list[PageRef]:
            hs = [hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest() for i in range(n)]
            return [PageRef(FULL, h, hs[i - 1] if i else b"\0" * 16, 0) for i, h in enumerate(hs)]

        out: dict[int, dict[str, tuple[float, float]]] = {}
        for size in sizes:
            n = size // PAGE_BYTES
            ids = list(range(n))

            def store(_: int, n=n, ids=ids) -> None:
                written, dropped = engine.store(refs(n, next(counter)), [0] * n, ids, 600.0)
                assert written == n and not dropped, (written, dropped)

            fixed = refs(n, next(counter))
            assert engine.store(fixed, [0] * n, ids, 600.0)[0] == n
            hashes = [r.page_hash for r in fixed]
            targets = [blocks + i for i in ids]

            def load(_: int, n=n, hashes=hashes, targets=targets) -> None:
                assert engine.load(hashes, [0] * n, targets, 600.0, 600.0)

            # A scheduler's pin per run of the handed load (and its warm-up, index -1).
            scheduler = _client(sidecar.endpoint, "bench-blocks-scheduler")
            scheduler.attach(layout, 1)
            handed_pins = [_handed(scheduler, hashes) for _ in range(3 * repeat + 3)]

            def load_handed(i: int, n=n, hashes=hashes, targets=targets, pins=handed_pins) -> None:
                handed = pins[i]
                assert engine.load_handed(hashes, [0] * n, targets, handed, 600.0, 600.0)

            ahead: dict[int, tuple] = {}  # run -> (refs, prebook): asked a step ahead

            def prebook(i: int, n=n, ahead=ahead) -> None:
                fresh = refs(n, next(counter))
                booked = engine.prebook(fresh, 600.0)
                assert booked is not None
                while not engine.prebook_answered(booked):  # the step between
                    time.sleep(50e-6)
                ahead[i] = (fresh, booked)

            def store_ahead(i: int, n=n, ids=ids, ahead=ahead) -> None:
                fresh, booked = ahead.pop(i)
                asked = engine.begins_on_path
                written, dropped = engine.store(fresh, [0] * n, ids, 600.0, prebook=booked)
                assert written == n and not dropped, (written, dropped)
                assert engine.begins_on_path == asked, "a prebooked store asked for its pages"

            both_engine = EngineBlocks(client, [segments], device, FULL)

            def store_and_load(
                i: int, n=n, ids=ids, both_engine=both_engine, ahead=ahead, handed=load_handed
            ) -> None:
                # as vLLM's worker makes them: on its store thread a store whose pages
                # were asked for a step ahead, on its load thread a load handed pinned
                fresh, booked = ahead.pop(i)
                _at_once(
                    lambda: both_engine.store(fresh, [0] * n, ids, 600.0, prebook=booked)[0] == n,
                    lambda: handed(2 * repeat + 2 + i) or True,
                )

            def store_and_load_plain(
                _: int, n=n, ids=ids, both_engine=both_engine, plain_load=load
            ) -> None:
                _at_once(
                    lambda: both_engine.store(refs(n, next(counter)), [0] * n, ids, 600.0)[0] == n,
                    lambda: plain_load(0) or True,
                )

            copy = engine._copies_now()[0]
            # Host pages the copy alone writes: the pool's last, which no store of this
            # size has been handed yet (pages are handed from the front).
            top = copy.pages.shape[0]
            scratch = list(range(top - n, top))

            def kernel_to_host(_: int, ids=ids, scratch=scratch, copy=copy) -> None:
                copy.to_host(ids, scratch)

            def kernel_to_device(_: int, ids=ids, scratch=scratch, copy=copy) -> None:
                copy.to_device(scratch, [blocks + i for i in ids])

            memcpy = Memcpy(size, device)
            stages = {}
            staged = (("store", store), ("load", load), ("load_handed", load_handed))
            for what, run in staged:
                _sync(device)
                with StageClock(client, engine) as clock:
                    t0 = time.perf_counter()
                    for i in range(repeat):
                        run(repeat + i)  # the handed load: pins of their own
                        _sync(device)
                    clock.ms["total"] = (time.perf_counter() - t0) * 1e3
                stages[what] = {k: v / repeat for k, v in clock.ms.items()}
                LONGEST[size, what] = clock.longest_ms
            STAGES[size] = stages
            runs = {
                "copy_alone_to_host": kernel_to_host,
                "copy_alone_to_device": kernel_to_device,
                "vllm_store": store,
                "vllm_store_ahead": store_ahead,
                "vllm_load": load,
                "vllm_load_handed": load_handed,
                "vllm_store_and_load": store_and_load,
                "vllm_store_and_load_plain": store_and_load_plain,
            }
            # run untimed before each timed run
            first = {"vllm_store_ahead": prebook, "vllm_store_and_load": prebook}
            out[size] = {
                k: _beside(f, k, memcpy, repeat, device, first.get(k)) for k, f in runs.items()
            }
            assert engine.handed_voided == 0, "a handed load was made again"
            scheduler.close()
            del memcpy
            for t in layers:  # the bytes that came back are the bytes stored
                assert torch.equal(t[targets], t[ids]), "a load did not restore the bytes"
        one = [refs(1, -1)[0].page_hash]
        ROUND_TRIP_S.append(
            _median_s(lambda _: client.lookup(one, [FULL]), max(repeat, 21), device)
        )
        for n in (1, 8, 64):  # the sidecar's answer alone, pages handed and given back
            times = []
            for _ in range(max(repeat, 21)):
                fresh = refs(n, next(counter))
                t0 = time.perf_counter()
                reservation = client.begin_store(fresh, 600.0)
                times.append((time.perf_counter() - t0) * 1e3)
                client.commit_store(reservation, False)
            times.sort()
            BEGIN_MS[n] = (statistics.median(times), times[len(times) * 9 // 10])
        client.close()
    finally:
        sidecar.stop()
    return out


def pool_paths(
    work: Path, sizes: list[int], device: torch.device, repeat: int
) -> dict[int, dict[str, tuple[float, float]]]:
    """Load-backs and backups of registered pools: through the sidecar and in-process."""
    layout = ModelLayout(("full",) * LAYERS, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                         model_id="bench-pools")  # fmt: skip
    page_bytes = layout.page_bytes(FULL, TOKENS)
    assert page_bytes == PAGE_BYTES
    pages = max(sizes) // page_bytes
    host_bytes = (repeat + 4) * max(sizes) + 64 * MIB
    cfg = CacheConfig(page_size=TOKENS, full_slots=2 * pages * TOKENS + TOKENS,
                      device=str(device), shared_memory=device.type == "cpu")  # fmt: skip
    pools = DevicePools.allocate(layout, cfg)
    pools.full.buffer.copy_(torch.randn(pools.full.buffer.shape, device=device))
    src = pools.alloc_kv_pages(pages)
    dst = pools.alloc_kv_pages(pages)
    fp = layout.fingerprint(TOKENS)
    counter = iter(range(1 << 30))

    def refs(slots: np.ndarray, n: int, tag: int) -> list[PageRef]:
        hs = page_hashes(list(range(tag << 24, (tag << 24) + n * TOKENS)), fp, TOKENS)
        return [PageRef(FULL, h, hs[i - 1] if i else b"\0" * 16, int(s))
                for i, (h, s) in enumerate(zip(hs, slots[:n]))]  # fmt: skip

    out: dict[int, dict[str, tuple[float, float]]] = {s: {} for s in sizes}
    sidecar = Sidecar(work, layout, TOKENS, host_bytes)
    try:
        client = _client(sidecar.endpoint, "bench-pools")
        client.register(layout, TOKENS, pools)
        for ctl, where in ((client, "sidecar"), (None, "in_process")):
            if ctl is None:
                ctl = LocalController(ControllerConfig(host_pool_bytes=host_bytes))
                ctl.register(layout, TOKENS, pools)
            for size in sizes:
                n = size // page_bytes
                memcpy = Memcpy(size, device)
                if where == "sidecar":
                    # Each run backs up new pages; their refs (hashes) are made untimed.
                    fresh: dict[str, list[PageRef]] = {}

                    def make(_: int, n=n, fresh=fresh) -> None:
                        fresh["refs"] = refs(src, n, next(counter))

                    out[size]["backup"] = _beside(
                        lambda _, ctl=ctl, fresh=fresh: ctl.backup(fresh["refs"]).wait(600),
                        "backup",
                        memcpy,
                        repeat,
                        device,
                        prepare=make,
                    )
                held = refs(src, n, next(counter))
                assert ctl.backup(held).wait(600)
                into = [PageRef(FULL, r.page_hash, r.parent_hash, int(d))
                        for r, d in zip(held, dst[:n])]  # fmt: skip
                pin = ctl.pin([r.key for r in into], 600.0)
                assert pin is not None
                for runs in (False, True) if device.type == "cuda" else (False,):
                    TransferEngine.load_runs = runs  # 2-D copies over runs of pages
                    name = f"{where}_load_runs" if runs else f"{where}_load"
                    pools.full.buffer[:, :, _slots(dst[:n])] = 0
                    out[size][name] = _beside(
                        lambda _, into=into, pin=pin, ctl=ctl: ctl.load(into, pin, 600.0),
                        name,
                        memcpy,
                        repeat,
                        device,
                    )
                    buf = pools.full.buffer  # the bytes loaded are the ones backed up
                    assert torch.equal(buf[:, :, _slots(src[:n])], buf[:, :, _slots(dst[:n])])
                TransferEngine.load_runs = False
                if where == "sidecar" and not TRACE_DIR:  # a backup and a load-back at once
                    out[size]["backup_and_load"] = _beside(
                        lambda _, into=into, pin=pin, ctl=ctl, fresh=fresh: _at_once(
                            lambda: ctl.backup(fresh["refs"]).wait(600),
                            lambda: ctl.load(into, pin, 600.0),
                        ),
                        "backup_and_load",
                        memcpy,
                        repeat,
                        device,
                        prepare=make,
                    )
                    assert torch.equal(buf[:, :, _slots(src[:n])], buf[:, :, _slots(dst[:n])])
                ctl.unpin(pin)
                del memcpy
            ctl.close()
    finally:
        sidecar.stop()
        pools.close()
    return out


#: a kept thread for the second of two calls at once (as an engine keeps its threads)
_SECOND = ThreadPoolExecutor(1, thread_name_prefix="bench-second")


def _at_once(first: Callable[[], object], second: Callable[[], object]) -> None:
    """``first`` on this thread and ``second`` on a kept one, at once; both must succeed."""
    other = _SECOND.submit(second)
    ok = first()
    assert other.result() and ok, "a call made at once failed"


def _slots(pages: np.ndarray) -> torch.Tensor:
    """The token slots of ``pages`` (of ``TOKENS`` tokens each), in order."""
    return torch.as_tensor((pages[:, None] * TOKENS + np.arange(TOKENS)).reshape(-1))


def check_segments(device: torch.device) -> None:
    """The segment kernel on ``device`` against the torch reference, aligned and not, both
    ways (a benchmark of wrong bytes measures nothing)."""
    from hicache.kernels import Segment, SegmentCopy

    g = torch.Generator().manual_seed(0)
    for unaligned in (False, True):
        layers = [torch.randint(0, 256, (32, 4096), dtype=torch.uint8, generator=g).to(device)
                  for _ in range(3)]  # fmt: skip
        cut = 2047 if unaligned else 2048
        segs = [Segment(layers[0], 0, cut, 0), Segment(layers[1], cut, 4096 - cut, cut),
                Segment(layers[2], 8, 4000, 4096)]  # fmt: skip
        rows = torch.zeros(16, 128 + 8192, dtype=torch.uint8)
        pages = rows.pin_memory() if device.type == "cuda" else rows
        want = torch.zeros_like(rows)
        blocks, dst = [3, 17, 30, 0], [9, 2, 15, 4]
        SegmentCopy(segs, pages, 128).to_host(blocks, dst)
        SegmentCopy(segs, want, 128, use_kernel=False).reference(blocks, dst, True)
        assert torch.equal(pages.cpu(), want), "the segment kernel wrote other bytes"
        before = [t.clone() for t in layers]
        for t in layers:
            t.zero_()
        SegmentCopy(segs, pages, 128).to_device(dst, blocks)
        for s in segs:
            i = next(n for n, t in enumerate(layers) if t is s.tensor)
            cols = slice(s.src_offset, s.src_offset + s.nbytes)
            assert torch.equal(s.tensor[blocks, cols], before[i][blocks, cols])
    print(f"segment kernel on {device}: the reference's bytes, aligned and not, both ways")


def _trace_report() -> dict[str, dict[str, float]]:
    """The median µs between consecutive stages of the traced backups and load-backs
    through the sidecar (both sides' events merged by time), printed and returned."""
    import sidecar_trace

    client = list(sidecar_trace.EVENTS)
    server = sidecar_trace.load_events(str(TRACE_DIR[0] / "sidecar_bench-pools.json"))
    out = {}
    for what, start, end in (("backup", "client_backup", "client_backup_end"),
                             ("load-back", "client_load", "client_load_end")):  # fmt: skip
        gaps = sidecar_trace.breakdown(client, server, start, end)
        out[what] = gaps
        print(f"traced {what} through the sidecar, µs between stages (medians):")
        for k, v in gaps.items():
            print(f"  {k:48} {v:9.1f}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes-mib", default=None, help="default 1,64,256 (cpu) or 1,64,256,1024")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", help="also write the figures here")
    p.add_argument(
        "--paths",
        default="blocks,pools",
        help="which paths: blocks (the vLLM and segment copies), pools (backup, load-backs)",
    )
    p.add_argument(
        "--reply-spin-s",
        type=float,
        default=0.0,
        help="the sidecar clients' reply_spin_s: poll for a critical call's reply without "
        "sleeping this long (spares a wake-up per round trip where a core is free)",
    )
    p.add_argument(
        "--trace-dir",
        default=None,
        help="trace the stages of each request on both sides of the socket "
        "(sidecar_trace.py) and print where a backup's and a load-back's time goes",
    )
    args = p.parse_args()
    REPLY_SPIN_S[0] = args.reply_spin_s
    if args.trace_dir:
        import sidecar_trace

        TRACE_DIR.append(Path(args.trace_dir).resolve())
        TRACE_DIR[0].mkdir(parents=True, exist_ok=True)
        sidecar_trace.install_client()
    device = torch.device(args.device)
    default = "1,64,256" if device.type == "cpu" else "1,64,256,1024"
    sizes = [int(s) * MIB for s in (args.sizes_mib or default).split(",")]
    check_segments(device)
    work = Path(tempfile.mkdtemp(prefix="hcdp", dir="/tmp"))
    try:
        wanted = set(args.paths.split(","))
        if not wanted or wanted - {"blocks", "pools"}:
            p.error("--paths takes blocks, pools or both")
        paths: dict[int, dict[str, tuple[float, float]]] = {s: {} for s in sizes}
        if "blocks" in wanted:
            paths = engine_block_paths(work, sizes, device, args.repeat)
        if "pools" in wanted:
            for size, figures in pool_paths(work, sizes, device, args.repeat).items():
                paths[size].update(figures)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"data plane on {name}: GB/s, and the ratio to a memcpy of the same bytes")
    print(f"  {'path':26} {'MiB':>6} {'GB/s':>8} {'memcpy GB/s':>12} {'ratio':>6}")
    one_page: dict[str, float] = {}
    for size in sizes:
        for path, (seconds, floor) in paths[size].items():
            # a store (or backup) and a load at once move the bytes twice
            moved = 2 * size if FLOOR_OF[path] == "both" else size
            gbps, mgbps, ratio = moved / seconds / 1e9, moved / floor / 1e9, floor / seconds
            rows.append({"path": path, "MiB": size // MIB, "GBps": gbps,
                         "memcpy_GBps": mgbps, "ratio": ratio})  # fmt: skip
            print(f"  {path:26} {size // MIB:6} {gbps:8.2f} {mgbps:12.2f} {ratio:6.2f}")
            if size == PAGE_BYTES:
                one_page[path] = seconds * 1e3
                one_page[f"memcpy_{FLOOR_OF[path]}"] = floor * 1e3
    if one_page:
        if ROUND_TRIP_S:  # timed with the block paths
            one_page["lookup_round_trip"] = ROUND_TRIP_S[0] * 1e3
        print("one page (1 MiB), ms, and over the copy alone the same way:")
        alone = {"to_host": "copy_alone_to_host", "to_device": "copy_alone_to_device"}
        for path, ms in one_page.items():
            kind = FLOOR_OF.get(path)
            over = ""
            if kind in alone and alone[kind] in one_page and not path.startswith("copy_alone"):
                over = f"  +{ms - one_page[alone[kind]]:.3f}"
            print(f"  {path:26} {ms:8.3f}{over}")
    for n, (med, p90) in BEGIN_MS.items():
        print(f"  store_begin of {n:3} pages alone: {med:.3f} ms median, {p90:.3f} p90")
    print("a vLLM store and a load, stage by stage (ms, the mean of --repeat, and in brackets")
    print("the longest single call; the stages of a chunked transfer overlap, so they may add")
    print("up to more than its total):")
    for size, stages in STAGES.items():
        for what, ms in stages.items():
            longest = LONGEST.get((size, what), {})
            parts = "  ".join(
                f"{k} {v:.3f}" + (f" ({longest[k]:.2f})" if k in longest else "")
                for k, v in sorted(ms.items(), key=lambda kv: -kv[1])
            )
            print(f"  {size // MIB:6} MiB {what:11}  {parts}")
    traced = _trace_report() if TRACE_DIR else {}
    if args.json:
        doc = {
            "traced_us": traced,
            "device": name,
            "reply_spin_s": args.reply_spin_s,
            "rows": rows,
            "stages": {str(k // MIB): v for k, v in STAGES.items()},
            "longest_call_ms": {f"{k // MIB}/{w}": v for (k, w), v in LONGEST.items()},
            "one_page_ms": one_page,
            "store_begin_ms": {str(n): v for n, v in BEGIN_MS.items()},
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
