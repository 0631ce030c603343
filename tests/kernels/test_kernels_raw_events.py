"""``RawEvents.order`` (kernels/copy_engine.py), with the CUDA runtime stood in for: a copy
stream is made to wait for its caller's stream by recording an event on the caller and
waiting on it from the copy stream, and the two steps of one call are never split by
another thread's (which would make a copy wait for the wrong caller's work)."""

from __future__ import annotations

import itertools
import threading
import time

import hicache.kernels.copy_engine as copy_engine
from hicache.kernels.copy_engine import RawEvents


class FakeRuntime:
    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._ids = itertools.count(100)

    def cudaEventCreateWithFlags(self, ref, flags):
        ref._obj.value = next(self._ids)
        return 0

    def cudaEventRecord(self, handle, stream):
        self.log.append(("record", handle, stream))
        time.sleep(0)  # let another thread in between the record and its wait, if it may
        return 0

    def cudaStreamWaitEvent(self, stream, handle, flags):
        self.log.append(("wait", stream, handle))
        return 0


def test_order_records_on_the_caller_then_waits_on_the_stream(monkeypatch):
    rt = FakeRuntime()
    monkeypatch.setattr(copy_engine, "_cudart", lambda: rt)
    events = RawEvents(2)
    events.order(1, stream=7, after=3)
    assert rt.log == [("record", events.handles[1], 3), ("wait", 7, events.handles[1])]


def test_order_from_many_threads_keeps_each_record_with_its_wait(monkeypatch):
    rt = FakeRuntime()
    monkeypatch.setattr(copy_engine, "_cudart", lambda: rt)
    events = RawEvents(1)

    def caller(k: int) -> None:
        for _ in range(200):
            events.order(0, stream=1000 + k, after=k)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(rt.log) == 2 * 4 * 200
    for rec, wait in zip(rt.log[::2], rt.log[1::2]):
        assert rec[0] == "record" and wait[0] == "wait"
        assert wait[1] == 1000 + rec[2]  # the stream waits for its own caller's record
