"""hicache.integrations.router against two real sidecars ("two nodes"): the router keeps
each node's residency from its KV events and sends a prompt to the node that resumes more
of it — by every component's rule, not by the longest run of KV pages."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hicache.controller.wire.protocol import Verb
from hicache.integrations.router import NodeEndpoints, PrefixRouter
from hicache.keys import page_hashes
from hicache.types import Tier
from tests.controller.sidecar.test_kv_events import MIX, PAGE, events_args
from tests.support.cache import make_layout
from tests.support.sidecar import EngineProc, Sidecar, short_tmpdir, wait_for

WINDOW = 8  # the test engine's sliding window, tokens
PROMPT = list(range(1000, 1048))  # 12 pages


@pytest.fixture
def nodes():
    started = []
    try:
        for name in ("a", "b"):
            workdir = short_tmpdir("rt" + name)
            sc = Sidecar(workdir, events_args(workdir)).start()
            engine = EngineProc(sc.endpoint, name, MIX)
            started.append((sc, engine))
            engine.receive()
        yield started
    finally:
        for sc, engine in started:
            engine.close()
            sc.stop()


def test_the_node_with_the_state_at_the_deeper_point_wins_over_more_kv_pages(nodes):
    (a, engine_a), (b, engine_b) = nodes
    layout = make_layout(MIX)
    router = PrefixRouter(
        {
            "a": NodeEndpoints(a.info["kv_events"], a.info["kv_events_replay"]),
            "b": NodeEndpoints(b.info["kv_events"], b.info["kv_events_replay"]),
        },
        components=layout.components,
        page_size=PAGE,
        sliding_window=WINDOW,
    )
    try:
        time.sleep(0.2)  # the subscriptions reach the sidecars
        # Node a computed the first 8 pages (Mamba state at page 8's end); node b a longer
        # request of the same prompt, 12 pages, whose only state is at page 12's end.
        engine_a.call("run", tokens=PROMPT[:32])
        engine_b.call("run", tokens=PROMPT)
        prompt = PROMPT[:40]  # 10 pages: b holds all 10 KV pages, a only 8
        hashes = page_hashes(np.array(prompt), layout.fingerprint(PAGE), PAGE)

        def settled():
            router.poll(50)
            s = router.score(hashes)
            return s["a"].resumable["disk"] == 8 and s["b"].kv_pages["disk"] == 10 and s

        scores = wait_for(settled, 30, "both nodes' events")
        assert scores["b"].kv_pages["host"] == 10 > scores["a"].kv_pages["host"] == 8
        assert scores["b"].resumable["host"] == 0  # no state at or before page 10's end
        assert router.best(hashes, Tier.HOST) == ("a", 8)
        assert router.best(hashes, Tier.DISK) == ("a", 8)
        # The whole prompt: b resumes it all, from its state at page 12.
        full = page_hashes(np.array(PROMPT), layout.fingerprint(PAGE), PAGE)
        assert router.best(full) == ("b", 12)

        # The router's rule is the sidecar's own: each node's score verb agrees.
        for name, sc in (("a", a), ("b", b)):
            admin = sc.admin()
            own = admin.call(Verb.SCORE, {"tokens": prompt, "sliding_window": WINDOW})
            admin.close()
            assert own["resumable"]["disk"] == scores[name].resumable["disk"]
            assert own["kv_pages"]["disk"] == scores[name].kv_pages["disk"]
    finally:
        router.close()


def test_a_late_router_catches_up_from_the_replay_endpoint(nodes):
    (a, engine_a), _ = nodes
    layout = make_layout(MIX)
    engine_a.call("run", tokens=PROMPT[:32])
    hashes = page_hashes(np.array(PROMPT[:32]), layout.fingerprint(PAGE), PAGE)
    time.sleep(0.5)  # published before the router exists
    router = PrefixRouter(
        {"a": NodeEndpoints(a.info["kv_events"], a.info["kv_events_replay"])},
        components=layout.components,
        page_size=PAGE,
        sliding_window=WINDOW,
    )
    try:
        time.sleep(0.2)
        engine_a.call("run", tokens=list(range(5000, 5008)))  # any new batch shows the gap

        def caught_up():
            router.poll(50)
            return router.best(hashes, Tier.HOST) == ("a", 8)

        wait_for(caught_up, 30, "the replayed history")
    finally:
        router.close()
