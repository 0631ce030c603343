"""SGLang's copy path over the shared staging area (hicache/integrations/sglang_transfers.py),
against a stand-in sidecar: a set given up on keeps its staging pages from newer calls until
it ends, and a set and a get in flight at once do not wait on each other."""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from hicache import ComponentType, ModelLayout, Presence
from hicache.controller.client import StagingArea
from hicache.integrations.sglang_pages import PageHasher
from hicache.integrations.sglang_transfers import SidecarPages
from tests.support.sidecar import wait_for

FULL = ComponentType.FULL
PAGE = 2
LAYOUT = ModelLayout(("full",), num_kv_heads=1, head_dim=4, dtype="float16", model_id="t")
PAGE_BYTES = 2 * PAGE * 4 * 2  # K and V, one layer, one head of 4 float16


class Handle:
    """A transfer that ends when the test says, successfully or not."""

    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.ended = threading.Event()

    def done(self) -> bool:
        return self.ended.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.ended.wait(timeout_s) and self.ok


class GivenUp(Handle):
    """A backup the client stopped waiting for (its deadline passed) that runs on."""

    def wait(self, timeout_s: float | None = None) -> bool:
        return False


class Loaded:
    pending = None

    def __bool__(self) -> bool:
        return True


class StandInSidecar:
    """Answers every lookup as held and every load as done; backs up with the handles the
    test queues (an ended one when none is queued)."""

    available = True

    def __init__(self) -> None:
        self.handles: list[Handle] = []
        self.backed_up: list[list[int]] = []  # the staging pages each backup named

    def backup(self, refs):
        self.backed_up.append([r.device_index for r in refs])
        if self.handles:
            return self.handles.pop(0)
        handle = Handle()
        handle.ended.set()
        return handle

    def lookup(self, hashes, components):
        return SimpleNamespace(presence={c: [Presence.HOST] * len(hashes) for c in components})

    def pin(self, keys, ttl_s):
        return object()

    def load(self, refs, pin, timeout_s):
        return Loaded()

    def unpin(self, pin) -> None:
        pass


@pytest.fixture
def copy_path():
    staging = StagingArea(LAYOUT, PAGE, pages=4)
    sidecar = StandInSidecar()
    options = {"hicache_staging_pages": 2, "hicache_load_timeout_s": 1.0}
    pages = SidecarPages(sidecar, PageHasher(LAYOUT, PAGE), staging, PAGE, options, Counter())
    yield pages, sidecar, staging
    staging.close()


def data_pages(n: int, fill: int) -> list[torch.Tensor]:
    return [torch.full((PAGE_BYTES,), fill + i, dtype=torch.uint8) for i in range(n)]


def test_a_set_given_up_on_keeps_its_pages_from_newer_calls_until_it_ends(copy_path):
    pages, sidecar, staging = copy_path
    late = GivenUp()
    sidecar.handles.append(late)
    assert pages.store(FULL, ["a", "b"], data_pages(2, 1), None) == [False, False]
    given_up = set(sidecar.backed_up[0])

    assert pages.store(FULL, ["c", "d"], data_pages(2, 5), None) == [True, True]

    assert given_up.isdisjoint(sidecar.backed_up[1])
    assert staging.held_pages == 2 and pages.counters["set_failed"] == 2
    staging.check_invariants()
    late.ended.set()
    staging.alloc(FULL, 0)  # an allocation releases what has ended
    assert staging.held_pages == 0 and staging.available(FULL) == 4
    staging.check_invariants()


def test_a_set_in_flight_does_not_hold_up_a_get(copy_path):
    pages, sidecar, staging = copy_path
    slow = Handle()
    sidecar.handles.append(slow)
    setter = threading.Thread(target=pages.store, args=(FULL, ["a", "b"], data_pages(2, 1), None))
    setter.start()
    wait_for(lambda: sidecar.backed_up, 10, "the set's backup sent")

    got: dict[int, torch.Tensor] = {}
    assert pages.fetch(FULL, ["x", "y"], got.__setitem__) == [True, True]

    assert sorted(got) == [0, 1] and setter.is_alive()
    slow.ended.set()
    setter.join(10)
    assert pages.counters["set_pages"] == 2 and pages.counters["get_pages"] == 2
    assert staging.available(FULL) == 4
    staging.check_invariants()
