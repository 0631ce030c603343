"""Where a process spends its wall time: every thread's Python stack sampled at an interval.

Used by the benchmarks to locate a one-time cost in a process they start (e.g. the first
load after a sidecar restart): run the process through this module,

    python benchmarks/stack_sampler.py OUT.json -m MODULE ARGS...

and every ``--interval-ms`` (default 2) the stacks of all its threads are recorded with the
wall-clock time; at exit (a normal return or ``sys.exit``, as a SIGTERM-stopped
``hicache serve`` does) they are written to OUT.json. :func:`summary` then says, for a
window of wall-clock time, how many milliseconds each function was on a thread's stack
(inclusive), per thread, leaving out threads that were only waiting. A frame in C (a CUDA
call, a read) is charged to the Python function that called it.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import sys
import threading
import time
from collections import Counter
from pathlib import Path

#: The innermost Python functions of a thread that is waiting, not working (a thread pool's
#: ``_worker`` or a writer's ``_run`` loop is innermost only while it waits for work).
IDLE = frozenset(
    {"wait", "select", "poll", "_poll", "sleep", "recv", "recv_multipart", "accept",
     "_wait_for_tstate_lock", "get", "_recv", "_serve_forever", "idle_wait",
     "_worker", "_run"}
)  # fmt: skip


def _on_cpu_ns(native_id: int | None) -> int:
    """Nanoseconds thread ``native_id`` of this process has run on a CPU (0 if unknown)."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


class Sampler:
    """Samples every thread's stack but its own every ``interval_s`` into memory."""

    def __init__(self, interval_s: float = 0.002, limit: int = 500_000) -> None:
        self.interval_s, self.limit = interval_s, limit
        self.samples: list[tuple[float, str, bool, list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        last: dict[int, int] = {}
        while not self._stop.wait(self.interval_s) and len(self.samples) < self.limit:
            now = time.time()
            threads = {t.ident: t for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                thread = threads.get(ident)
                if ident == me or thread is None:
                    continue
                cpu = _on_cpu_ns(thread.native_id)
                on_cpu = cpu - last.get(ident, cpu) > self.interval_s * 1e9 / 4
                last[ident] = cpu
                stack = []
                f = frame
                while f is not None:
                    code = f.f_code
                    stack.append(f"{Path(code.co_filename).name}:{code.co_name}")
                    f = f.f_back
                self.samples.append((now, thread.name, on_cpu, stack))

    def write(self, path: str | os.PathLike) -> None:
        data = {"interval_s": self.interval_s, "samples": self.samples}
        Path(path).write_text(json.dumps(data))


def summary(path: str | os.PathLike, t0: float, t1: float, top: int = 10) -> list[str]:
    """Lines saying where the sampled process's threads spent ``[t0, t1]`` (wall clock,
    ``time.time()``): per thread that was not only waiting, its milliseconds on a CPU and
    off it (a sample off the CPU whose innermost function is not a known wait: a blocking
    call such as a read or a device synchronisation), and the ``top`` functions by
    inclusive milliseconds of both."""
    data = json.loads(Path(path).read_text())
    ms = data["interval_s"] * 1e3
    per_thread: dict[str, Counter] = {}
    cpu: Counter = Counter()
    blocked: Counter = Counter()
    for ts, thread, on_cpu, stack in data["samples"]:
        if not t0 <= ts <= t1 or not stack:
            continue
        if not on_cpu and stack[0].split(":")[1] in IDLE:
            continue
        (cpu if on_cpu else blocked)[thread] += 1
        counts = per_thread.setdefault(thread, Counter())
        for fn in set(stack):
            counts[fn] += 1
    lines = [f"window {1e3 * (t1 - t0):.1f} ms, sampled every {ms:.1f} ms"]
    for thread in sorted(per_thread, key=lambda t: -(cpu[t] + blocked[t])):
        if cpu[thread] + blocked[thread] < 2:
            continue
        lines.append(
            f"  thread {thread}: {cpu[thread] * ms:.0f} ms on a CPU, "
            f"{blocked[thread] * ms:.0f} ms in a call off it"
        )
        for fn, c in per_thread[thread].most_common(top):
            lines.append(f"    {c * ms:8.0f} ms  {fn}")
    return lines


def main(argv: list[str]) -> None:
    """``OUT.json [--interval-ms N] -m MODULE ARGS...``: run MODULE as ``__main__`` with the
    sampler on, writing OUT.json at exit."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="where the samples are written at exit")
    p.add_argument("--interval-ms", type=float, default=2.0)
    p.add_argument("-m", dest="module", required=True, help="the module run as __main__")
    cut = argv.index("-m") + 2 if "-m" in argv else len(argv)
    args = p.parse_args(argv[:cut])  # what follows the module is its own
    sampler = Sampler(args.interval_ms / 1e3).start()

    def finish() -> None:
        sampler.stop()
        sampler.write(args.out)

    atexit.register(finish)
    sys.argv = [args.module, *argv[cut:]]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
