"""An engine worker process for the sidecar tests, the other end of
``tests.support.sidecar.EngineProc``::

    python -m tests.support.engine_worker --endpoint ipc:///… --engine-id A

It builds a ``UnifiedRadixCache`` over shared-memory device pools with a
``SidecarController`` and answers one JSON command per line on stdin (see ``_serve_engine``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import numpy as np

from hicache import CacheConfig, DevicePools, UnifiedRadixCache
from hicache.controller.client.sidecar_client import SidecarClientConfig, SidecarController
from tests.support.cache import MarkerEngine, make_layout


def _serve_engine(endpoint: str, engine_id: str, mix: str, client_config: dict) -> None:
    layout = make_layout(mix)
    cfg = CacheConfig(
        page_size=4,
        sliding_window=8 if layout.has_swa else None,
        full_slots=1024,
        mamba_slots=32,
        shared_memory=True,
        prefetch_policy="wait_complete",  # a disk hit is loaded in the same request
    )
    pools = DevicePools.allocate(layout, cfg)
    ctl = SidecarController(endpoint, engine_id, SidecarClientConfig(**client_config))
    cache = UnifiedRadixCache(layout, cfg, pools, controller=ctl)
    engine = MarkerEngine(cache)

    def answer(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"ready": True, "available": ctl.available})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "exit":
                ctl.close()
                pools.close()
                answer({"bye": True})
                return
            tokens = np.asarray(cmd.get("tokens", []), dtype=np.int64)
            ns = cmd.get("namespace")
            if op == "run":  # compute and cache a whole request, wait for its backup
                engine.run(tokens, ns)
                cache.flush_backups(30.0)
                answer({"backup_done": cache.counters["backup_done"]})
            elif op == "evict_all":  # drop every cached prefix from the device tier
                r = cache.evict(full_tokens=cfg.full_slots)
                answer({"full_tokens": r.full_tokens})
            elif op == "match":
                m = cache.match_prefix(tokens, ns)
                answer(
                    {
                        "prefix_len": m.prefix_len,
                        "host_hit_len": m.host_hit_len,
                        "disk_hit_len": m.disk_hit_len,
                    }
                )
            elif op == "start":  # match + load back; verify_prefix checks every byte
                req = engine.start(tokens, ns)
                n = req.prefix_len
                cache.cache_finished_req(req)
                answer({"prefix_len": n, "loaded": cache.counters["loaded_tokens"]})
            elif op == "wait_available":
                end = time.monotonic() + cmd.get("timeout_s", 60.0)
                while not ctl.available and time.monotonic() < end:
                    time.sleep(0.02)
                answer({"available": ctl.available})
            elif op == "status":
                answer({"available": ctl.available, "counters": dict(ctl.counters)})
            else:
                answer({"error": f"unknown op {op}"})
        except Exception as exc:  # reported to the test, which fails with it
            answer({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--mix", default="full+swa+mamba")
    p.add_argument("--client-config", default="{}")
    a = p.parse_args()
    _serve_engine(a.endpoint, a.engine_id, a.mix, json.loads(a.client_config))
