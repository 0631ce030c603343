"""The sidecar on a GPU: CUDA IPC registration, backup and load-back, and refusals.

Run from the repository root on a CUDA machine (hicache need not be installed; it needs
torch, numpy, pyzmq, msgpack, lmdb, xxhash and prometheus-client):

    python3 benchmarks/gpu_sidecar_check.py [--json OUT.json] [--pages N]

It starts a real sidecar process, then:

1. an engine process allocates hybrid (full + SWA + Mamba) device pools on cuda:0,
   registers them through CUDA IPC handles, writes random KV and states, backs a prefix
   up through the sidecar, loads it back into another slot range and compares the bytes;
2. registrations that must be refused, each with its error: the handles of an engine
   process that has exited (stale), handles with corrupted bytes, pools on a GPU that the
   sidecar does not see (a second sidecar started without that GPU), and a forged GPU
   UUID;
3. load-back throughput of ``--pages`` pages through the sidecar against the in-process
   controller copying the same pages in this process (MB/s, same run).

Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = 16


def import_hicache() -> None:
    """Make ``hicache``, ``hicache.controller`` and ``hicache.kernels`` importable from the
    repository when the package is not installed."""
    try:
        import hicache.controller.sidecar.process

        return
    except ModuleNotFoundError:
        pass
    sys.path.insert(0, str(ROOT))
    import hicache

    if str(ROOT) not in hicache.__path__:
        hicache.__path__.append(str(ROOT))


def layout():
    from hicache import ModelLayout

    return ModelLayout(
        ("full", "swa", "mamba", "full"),
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        conv_dim=256,
        conv_kernel=4,
        ssm_state_shape=(8, 64),
        state_dtype="float32",
        model_id="gpu-sidecar-check",
    )


def make_pools(device: str, pages: int):
    from hicache import CacheConfig, DevicePools

    cfg = CacheConfig(
        page_size=PAGE,
        sliding_window=4 * PAGE,
        full_slots=(3 * pages + 8) * PAGE,
        mamba_slots=3 * pages + 4,
        device=device,
    )
    return DevicePools.allocate(layout(), cfg)


def chain_refs(pools, pages: int, seed: int) -> tuple[list, dict]:
    """Fresh device pages (and a state slot per page) filled with random bytes; the page
    references of the chain and the places used."""
    import numpy as np
    import torch

    from hicache.controller_api import PageRef
    from hicache.keys import namespace_hash, page_hashes
    from hicache.types import ComponentType

    fp = pools.layout.fingerprint(PAGE)
    hashes = page_hashes(np.arange(pages * PAGE) + seed * 1_000_000, fp, PAGE)
    parents = [namespace_hash(fp, None), *hashes[:-1]]
    full = pools.alloc_kv_pages(pages)
    swa = pools.full_to_swa[full]
    states = [pools.mamba.alloc_state() for _ in range(pages)]
    g = torch.Generator(device=pools.full.buffer.device).manual_seed(seed)
    for buf in (pools.full.buffer, pools.swa.buffer, pools.mamba.conv, pools.mamba.ssm):
        buf.copy_(torch.randn(buf.shape, generator=g, device=buf.device).to(buf.dtype))
    refs = []
    for i, (h, p) in enumerate(zip(hashes, parents)):
        refs += [
            PageRef(ComponentType.FULL, h, p, int(full[i])),
            PageRef(ComponentType.SWA, h, p, int(swa[i])),
            PageRef(ComponentType.MAMBA, h, p, states[i]),
        ]
    return refs, {"full": full, "swa": swa, "mamba": states}


def retarget(pools, refs: list, pages: int) -> tuple[list, dict]:
    """The same pages, to be loaded into a fresh slot range."""
    from dataclasses import replace

    from hicache.types import ComponentType

    full = pools.alloc_kv_pages(pages)
    swa = pools.full_to_swa[full]
    states = [pools.mamba.alloc_state() for _ in range(pages)]
    place = {ComponentType.FULL: full, ComponentType.SWA: swa, ComponentType.MAMBA: states}
    out = [replace(r, device_index=int(place[r.component][i // 3])) for i, r in enumerate(refs)]
    return out, {"full": full, "swa": swa, "mamba": states}


def same_bytes(pools, a: dict, b: dict) -> dict[str, bool]:
    import torch

    def kv(buf, pages_a, pages_b):
        sa = torch.from_numpy(pools.full.pages_to_slots(pages_a)).to(buf.device)
        sb = torch.from_numpy(pools.full.pages_to_slots(pages_b)).to(buf.device)
        x, y = buf[:, :, sa], buf[:, :, sb]
        return torch.equal(x.view(torch.int16), y.view(torch.int16))

    ia = torch.tensor(a["mamba"], device=pools.mamba.conv.device)
    ib = torch.tensor(b["mamba"], device=pools.mamba.conv.device)
    return {
        "full": kv(pools.full.buffer, a["full"], b["full"]),
        "swa": kv(pools.swa.buffer, a["swa"], b["swa"]),
        "mamba_conv": torch.equal(pools.mamba.conv[:, ia], pools.mamba.conv[:, ib]),
        "mamba_ssm": torch.equal(pools.mamba.ssm[:, ia], pools.mamba.ssm[:, ib]),
    }


# -- roles (subprocesses) -----------------------------------------------------------------


def role_sidecar(argv: list[str]) -> int:
    import_hicache()
    from hicache.controller.sidecar.process import main

    return main(argv)


def role_engine(args: argparse.Namespace) -> int:
    """Register cuda pools, back a prefix up, load it into other slots; JSON to --out."""
    import_hicache()
    import torch

    from hicache.controller.client.device_share import export_pools
    from hicache.controller.client.sidecar_client import SidecarClientConfig, SidecarController

    torch.cuda.set_device(args.device)
    pools = make_pools(args.device, args.pages)
    if args.export_only:  # hand the handles out, then exit: they go stale
        desc = export_pools(pools)
        pathlib.Path(args.out).write_text(json.dumps(_hexify(desc)))
        return 0
    result: dict[str, Any] = {}
    client = SidecarController(
        args.endpoint, "gpu-engine", SidecarClientConfig(connect_timeout_s=60)
    )
    client.register(pools.layout, PAGE, pools)
    result["registered"] = client.available
    refs, src = chain_refs(pools, args.pages, seed=1)
    event = torch.cuda.Event()
    event.record()
    result["backup"] = bool(client.backup(refs, event).wait(120))
    dst_refs, dst = retarget(pools, refs, args.pages)
    pin = client.pin([r.key for r in dst_refs], 120)
    result["pinned"] = pin is not None
    result["load"] = bool(pin is not None and client.load(dst_refs, pin, 60))
    torch.cuda.synchronize()
    result["equal"] = same_bytes(pools, src, dst)
    # copied here, from the sidecar's shared host pages (controller/client/host_share.py)
    result["engine_copied"] = client.counters["load_engine_copied"]
    # the same pages copied by the sidecar, for a client that maps nothing
    plain = SidecarController(
        args.endpoint,
        "gpu-engine-sidecar-copies",
        SidecarClientConfig(connect_timeout_s=60, engine_copies=False),
    )
    plain.register(pools.layout, PAGE, pools)
    refs2, dst2 = retarget(pools, refs, args.pages)
    pin2 = plain.pin([r.key for r in refs2], 120)
    result["sidecar_copied_load"] = bool(pin2 is not None and plain.load(refs2, pin2, 60))
    torch.cuda.synchronize()
    result["sidecar_copied_equal"] = same_bytes(pools, src, dst2)
    result["sidecar_copied_by_engine"] = plain.counters["load_engine_copied"]
    if pin2 is not None:
        plain.unpin(pin2)
    plain.close()
    # Throughput: the same load, repeated, timed from this process.
    seconds = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        client.load(dst_refs, pin, 60)
        seconds.append(time.perf_counter() - t0)
    if pin is not None:
        client.unpin(pin)
    nbytes = sum(pools.layout.page_bytes(r.component, PAGE) for r in refs)
    result["load_bytes"] = nbytes
    result["load_seconds"] = sorted(seconds)[len(seconds) // 2] if seconds else None
    client.close()
    pathlib.Path(args.out).write_text(json.dumps(result))
    return 0


def _hexify(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return {"__hex__": obj.hex()}
    if isinstance(obj, dict):
        return {k: _hexify(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_hexify(v) for v in obj]
    return obj


def _unhex(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__hex__"}:
            return bytes.fromhex(obj["__hex__"])
        return {k: _unhex(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unhex(v) for v in obj]
    return obj


# -- the driver ---------------------------------------------------------------------------


class Sidecar:
    def __init__(self, workdir: pathlib.Path, name: str, env: dict[str, str] | None = None):
        self.dir = workdir / name
        self.dir.mkdir(parents=True)
        self.socket = self.dir / "s.sock"
        ready = self.dir / "ready.json"
        cmd = [
            sys.executable,
            __file__,
            "sidecar",
            "--socket",
            str(self.socket),
            "--disk-path",
            str(self.dir / "lmdb"),
            "--metrics-port",
            "0",
            "--host-pool-bytes",
            "512MiB",
            "--ready-file",
            str(ready),
        ]
        self.log = open(self.dir / "sidecar.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, env={**os.environ, **(env or {})}, stdout=self.log, stderr=self.log
        )
        end = time.monotonic() + 180
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"sidecar did not start:\n{self.log_text()}")
            time.sleep(0.1)

    @property
    def endpoint(self) -> str:
        return "ipc://" + str(self.socket)

    def log_text(self) -> str:
        return (self.dir / "sidecar.log").read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def register_raw(endpoint: str, desc: dict) -> str | None:
    """Handshake and register ``desc`` on a fresh connection; the refusal, or None."""
    from hicache.controller.client.channel import Channel, RemoteError, SidecarClientConfig
    from hicache.controller.wire.protocol import Role, Verb

    lay = layout()
    ch = Channel(endpoint, SidecarClientConfig())
    ch.reset()
    try:
        ch.call(
            Verb.HELLO,
            {
                "role": Role.ENGINE.value,
                "engine_id": f"raw-{time.monotonic_ns()}",
                "pid": os.getpid(),
                "fingerprint": lay.fingerprint(PAGE),
                "layout": lay.to_dict(),
                "page_size": PAGE,
            },
            60,
            connect_wait_s=60,
        )
        ch.call(Verb.REGISTER, {"page_size": PAGE, **desc}, 120)
        return None
    except RemoteError as exc:
        return f"{exc.code}: {exc.message}"
    finally:
        ch.close()


def run_checks(pages: int = 64, repeat: int = 5) -> list[dict[str, Any]]:
    """Every check; one row each: name, ok, detail."""
    import_hicache()
    import torch

    from hicache.controller.client.device_share import export_pools

    rows: list[dict[str, Any]] = []
    work = pathlib.Path(tempfile.mkdtemp(prefix="hcgpu", dir="/tmp"))
    sidecar = Sidecar(work, "main")
    others: list[Sidecar] = []
    try:
        # 1. a live engine process: register, backup, load into other slots.
        out = work / "engine.json"
        r = subprocess.run(
            [sys.executable, __file__, "engine", "--endpoint", sidecar.endpoint, "--out",
             str(out), "--device", "cuda:0", "--pages", str(pages), "--repeat", str(repeat)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if r.returncode != 0 or not out.exists():
            rows.append({"name": "engine round trip", "ok": False, "detail": r.stderr[-3000:]})
        else:
            res = json.loads(out.read_text())
            ok = res["registered"] and res["backup"] and res["load"] and all(res["equal"].values())
            ok = ok and res["engine_copied"] >= 1 and res["sidecar_copied_by_engine"] == 0
            ok = ok and res["sidecar_copied_load"] and all(res["sidecar_copied_equal"].values())
            rows.append(
                {
                    "name": "IPC register + backup + load (engine and sidecar copies), bytes equal",
                    "ok": ok,
                    "detail": res,
                }
            )

        # 2a. stale handles: exported by a process that has exited.
        stale = work / "stale.json"
        subprocess.run(
            [sys.executable, __file__, "engine", "--endpoint", sidecar.endpoint, "--out",
             str(stale), "--device", "cuda:0", "--pages", "4", "--export-only"],
            check=True, timeout=300,
        )  # fmt: skip
        err = register_raw(sidecar.endpoint, _unhex(json.loads(stale.read_text())))
        rows.append(_refusal("stale handle (exited engine)", err, "stale"))

        # 2b. corrupted handle bytes, from this (live) process.
        pools = make_pools("cuda:0", 4)
        desc = export_pools(pools)
        bad = json.loads(json.dumps(_hexify(desc)))
        for b in bad["buffers"].values():
            b["handle"] = {"__hex__": os.urandom(len(bytes.fromhex(b["handle"]["__hex__"]))).hex()}
        err = register_raw(sidecar.endpoint, _unhex(bad))
        rows.append(_refusal("corrupted handle bytes", err, "registration_refused"))

        # 2c. a forged GPU UUID.
        forged = _unhex(json.loads(json.dumps(_hexify(desc))))
        for b in forged["buffers"].values():
            b["device_uuid"] = "GPU-00000000-0000-0000-0000-000000000000"
        err = register_raw(sidecar.endpoint, forged)
        rows.append(_refusal("forged GPU UUID", err, "not one this sidecar sees"))

        # 2e. a storage that claims more bytes than its allocation holds (the driver's
        # extent check): a view past the end could reach another engine's memory.
        oversized = _unhex(json.loads(json.dumps(_hexify(desc))))
        first = next(iter(oversized["buffers"].values()))
        first["storage_bytes"] += 1 << 40
        err = register_raw(sidecar.endpoint, oversized)
        rows.append(_refusal("storage larger than its allocation", err, "allocation holds"))

        # 2d. pools on a GPU the sidecar does not see.
        if torch.cuda.device_count() >= 2:
            blind = Sidecar(work, "gpu0-only", {"CUDA_VISIBLE_DEVICES": "0"})
            others.append(blind)
            p1 = make_pools("cuda:1", 4)
            err = register_raw(blind.endpoint, export_pools(p1))
            rows.append(_refusal("engine on GPU 1, sidecar sees GPU 0 only", err, "not one"))
        else:
            blind = Sidecar(work, "no-gpu", {"CUDA_VISIBLE_DEVICES": ""})
            others.append(blind)
            err = register_raw(blind.endpoint, desc)
            rows.append(_refusal("engine's GPU invisible to the sidecar", err, "not visible"))

        # 3. the sidecar still serves after the refusals.
        err = register_raw(sidecar.endpoint, desc)
        rows.append({"name": "valid registration after refusals", "ok": err is None, "detail": err})

        # 4. load-back MB/s: through the sidecar (engine process) vs in-process.
        if rows[0]["ok"]:
            res = rows[0]["detail"]
            rows.append(_bench_row(res, pages, repeat))
    finally:
        for s in [sidecar, *others]:
            s.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _refusal(name: str, err: str | None, words: str) -> dict[str, Any]:
    ok = err is not None and words in err
    return {"name": f"refused: {name}", "ok": ok, "detail": err}


def _bench_row(res: dict, pages: int, repeat: int) -> dict[str, Any]:
    """In-process LocalController load of the same pages, against the sidecar figure."""
    import torch

    from hicache.controller.config import ControllerConfig
    from hicache.controller.store.local import LocalController

    pools = make_pools("cuda:0", pages)
    ctl = LocalController(ControllerConfig(host_pool_bytes=512 << 20, disk_path=None))
    ctl.register(pools.layout, PAGE, pools)
    refs, _ = chain_refs(pools, pages, seed=2)
    assert ctl.backup(refs).wait(120)
    dst_refs, _ = retarget(pools, refs, pages)
    pin = ctl.pin([r.key for r in dst_refs], 120)
    seconds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ctl.load(dst_refs, pin, 60)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    ctl.unpin(pin)
    ctl.close()
    local_s = sorted(seconds)[len(seconds) // 2]
    mb = res["load_bytes"] / 1e6
    side = mb / res["load_seconds"]
    local = mb / local_s
    return {
        "name": "load-back MB/s (sidecar vs in-process)",
        "ok": True,
        "detail": {
            "bytes": res["load_bytes"],
            "sidecar_MBps": round(side, 1),
            "in_process_MBps": round(local, 1),
            "ratio": round(side / local, 3),
        },
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "sidecar":
        return role_sidecar(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("role", nargs="?", choices=["engine"])
    p.add_argument("--endpoint")
    p.add_argument("--out")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--export-only", action="store_true")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.role == "engine":
        return role_engine(args)
    rows = run_checks(args.pages, args.repeat)
    for row in rows:
        print(f"{'PASS' if row['ok'] else 'FAIL'}  {row['name']}: {row['detail']}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2, default=str))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
