"""``explain`` and ``hicachectl explain`` on a real sidecar: page by page, where each page
of a prompt is and why the rest is not (after a host eviction and a disk eviction, the
prompt's tail never stored), an engine's last lookups as they were answered, and the
counts in ``hicache_miss_reasons_total``."""

from __future__ import annotations

import urllib.request

from hicache.controller.admin import cli as admin_cli
from hicache.controller.wire.protocol import Verb
from tests.support.sidecar import EngineProc, Sidecar, layout_file, short_tmpdir, wait_for

MIX = "full+swa+mamba"
PAGE = 4


def test_explain_tells_page_by_page_where_a_prompt_is_and_why_not(capsys):
    workdir = short_tmpdir("ex")
    args = ["--layout-file", str(layout_file(workdir, MIX, PAGE))]
    with Sidecar(workdir, args, metrics=True) as sc:
        engine = EngineProc(sc.endpoint, "engine-a", MIX)
        fresh = EngineProc(sc.endpoint, "engine-b", MIX)  # nothing on its device
        try:
            engine.receive()
            fresh.receive()
            tokens = list(range(700, 732))  # 8 pages
            engine.call("run", tokens=tokens)
            admin = sc.admin()
            wait_for(
                lambda: admin.call(Verb.STATS)["residency"]["disk"]["full"]["resident"] == 8,
                30,
                "the prompt on disk",
            )
            admin.call(Verb.EVICT, {"tier": "host", "bytes": 1 << 30})
            page_bytes = admin.call(Verb.STATS)["disk"]["live_bytes"] // 8
            admin.call(Verb.EVICT, {"tier": "disk", "bytes": 2 * page_bytes})
            longer = tokens + list(range(900, 916))  # 4 more pages, never computed
            reply = admin.call(Verb.EXPLAIN, {"tokens": longer})
            fresh.call("run", tokens=longer)  # its lookup is engine-b's last
            admin.close()
        finally:
            engine.close()
            fresh.close()
        assert reply["pages"] == 12
        runs = reply["runs"]
        assert runs[0]["first"] == 0 and runs[0]["where"]["full"] == "disk"
        tail = runs[-1]
        assert (tail["first"], tail["last"]) == (8, 11)
        assert {w["reason"] for w in tail["why"].values()} == {"never_stored"}
        evicted = [r for r in runs if any(w["reason"] == "evicted" for w in r["why"].values())]
        assert [(r["first"], r["last"]) for r in evicted] == [(6, 6), (7, 7)]  # the tail
        assert {(w["reason"], w["tier"]) for w in evicted[1]["why"].values()} == {
            ("evicted", "disk")
        }  # page 6 had no Mamba state stored (states are kept at the chain's end)

        argv = ["--endpoint", sc.endpoint, "explain"]
        assert admin_cli.main([*argv, "--tokens", ",".join(map(str, longer))]) == 0
        out = capsys.readouterr().out
        assert out.startswith("prompt: 12 pages of 4 tokens\n")
        assert "absent: evicted (disk)" in out and "absent: never_stored" in out
        assert admin_cli.main([*argv, "--engine", "engine-b", "--last", "1"]) == 0
        out = capsys.readouterr().out
        assert out.startswith("engine engine-b: last 1 lookups, oldest first\nlookup 1: ")
        assert "12 pages; first miss: full" in out and "evicted (disk)" in out

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{sc.metrics_port}/metrics").read()
        text = metrics.decode()
        series = 'hicache_miss_reasons_total{component="full",reason="never_stored",tier="none"}'
        assert series in text
