"""A store's host pages asked for a step ahead (hicache/integrations/vllm_store_ahead.py),
as vLLM's connector drives the worker: a store announced and never submitted has its
pages given back a step after it was due, and at shutdown; no more than
``store_ahead_jobs`` are asked for at once; the rest store as before."""

from __future__ import annotations

import dataclasses

from conftest import sidecar_stats
from test_vllm_hybrid import (
    FULL_G,
    MAMBA_G,
    SWA_G,
    finish,
    hybrid,  # noqa: F401 (the fixture)
    request,
    store_job,
)

from tests.support.sidecar import wait_for

BLOCKS = {FULL_G: [1, 2, 3, 4, 5], SWA_G: [0, 0, 8, 9, 10], MAMBA_G: [0, 0, 0, 14, 0]}
PAGES = 9  # the blocks above that exist


def _host_pages(sidecar) -> int:
    return sidecar_stats(sidecar)["host.used_pages.full"]


def _job(manager, name: str, first_token: int):
    return store_job(manager, request(name, list(range(first_token, first_token + 160))), BLOCKS)


def test_a_store_announced_and_never_submitted_is_given_back_a_step_later(hybrid) -> None:  # noqa: F811
    _, manager, worker, _, sidecar = hybrid
    src, out, _ = _job(manager, "dropped", 1)
    worker.store_ahead([(7, src, out.store_spec)])  # step 1 announces job 7
    wait_for(lambda: _host_pages(sidecar) == PAGES, 30, "its pages handed out")
    worker.store_ahead([])  # step 2: job 7 was due at its start, and not submitted
    assert worker.counters["store_prebook_unused"] == 0  # not given back yet: it may come
    worker.store_ahead([])  # step 3: it will not
    wait_for(lambda: worker.counters["store_prebook_unused"] == 1, 30, "the give-back")
    assert worker.counters["store_prebook_unused_pages"] == PAGES
    assert _host_pages(sidecar) == 0  # back at once, not at the reservation's deadline
    # The job submitted after all stores as without a prebook, every page written.
    assert worker.submit_store(7, src, out.store_spec)
    assert finish(worker, 7).success
    assert worker.counters["store_pages"] == PAGES
    assert worker.counters["store_begins_on_path"] == 1
    assert _host_pages(sidecar) == PAGES


def test_the_stores_announced_are_given_back_at_shutdown(hybrid) -> None:  # noqa: F811
    _, manager, worker, _, sidecar = hybrid
    src, out, _ = _job(manager, "at-shutdown", 1)
    worker.store_ahead([(8, src, out.store_spec)])
    wait_for(lambda: _host_pages(sidecar) == PAGES, 30, "its pages handed out")
    worker.shutdown()
    assert worker.counters["store_prebook_unused"] == 1
    assert _host_pages(sidecar) == 0


def test_no_more_than_store_ahead_jobs_are_asked_for_at_once(hybrid) -> None:  # noqa: F811
    _, manager, worker, _, sidecar = hybrid
    worker.config = dataclasses.replace(worker.config, store_ahead_jobs=1)
    jobs = [(10 + i, *_job(manager, f"bounded-{i}", 1 + 1000 * i)[:2]) for i in range(2)]
    worker.store_ahead([(j, src, out.store_spec) for j, src, out in jobs])
    for job_id, src, out in jobs:
        assert worker.submit_store(job_id, src, out.store_spec)
        assert finish(worker, job_id).success
    counters = worker.counters
    assert counters["store_prebook_skipped"] == 1
    assert counters["store_prebooked_pages"] == PAGES and counters["store_begins_on_path"] == 1
    assert counters["store_pages"] == 2 * PAGES and _host_pages(sidecar) == 2 * PAGES
