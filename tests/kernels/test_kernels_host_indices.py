"""The pinned index slots a segment copy's kernel reads (kernels/host_indices.py
``PairSlots``), with the CUDA calls stood in for: each launch's two index rows start 16
bytes aligned whatever their length (a compiled kernel assumes it), hold exactly the
indices given, every slot's first buffer is one allocation, and a slot is written again
only after the launch that read it last has ended."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
import torch

import hicache.kernels.copy_engine as copy_engine
import hicache.kernels.host_indices as host_indices
from hicache.kernels.host_indices import PairSlots


class FakeEvents:
    """RawEvents' record and synchronize, logged."""

    log: ClassVar[list[tuple[str, int]]] = []

    def __init__(self, count: int) -> None:
        self.count = count

    def record(self, index: int, stream: int) -> None:
        FakeEvents.log.append(("record", index))

    def synchronize(self, index: int) -> None:
        FakeEvents.log.append(("sync", index))


@pytest.fixture
def slots(monkeypatch):
    allocations = []

    def pinned(*shape):
        t = torch.zeros(*shape, dtype=torch.int64)
        allocations.append(shape)
        return t

    FakeEvents.log = []
    monkeypatch.setattr(host_indices, "_pinned", pinned)
    monkeypatch.setattr(copy_engine, "device_pointer", lambda addr: addr)
    monkeypatch.setattr(copy_engine, "RawEvents", FakeEvents)
    return PairSlots(count=4), allocations


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 1500, 5000])
def test_both_rows_start_aligned_and_hold_the_indices(slots, n):
    pair, allocations = slots
    rng = np.random.default_rng(n)
    a, b = rng.integers(0, 1 << 40, n), rng.integers(0, 1 << 40, n)
    with pair.pair(a, b, stream=7) as (a_addr, b_addr, tensors):
        assert a_addr % 16 == 0 and b_addr % 16 == 0
        ta, tb = tensors()
        assert ta.data_ptr() == a_addr and tb.data_ptr() == b_addr
        assert np.array_equal(ta.numpy(), a) and np.array_equal(tb.numpy(), b)
    assert allocations[0] == (4, 2048)  # every slot's first buffer at once
    assert len(allocations) == (1 if 2 * (n + 1) <= 2048 else 2)


def test_a_slot_is_written_again_only_after_its_last_launch_ended(slots):
    pair, allocations = slots
    for i in range(6):
        with pair.pair(np.array([i]), np.array([i]), stream=1):
            pass
    # slots 0..3 recorded once each; the fifth and sixth launches reuse slots 0 and 1,
    # each after waiting for the event of the launch that read it last
    assert FakeEvents.log == [
        ("record", 0), ("record", 1), ("record", 2), ("record", 3),
        ("sync", 0), ("record", 0), ("sync", 1), ("record", 1),
    ]  # fmt: skip
    assert len(allocations) == 1
