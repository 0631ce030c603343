"""``score`` and ``hicachectl score`` on a real sidecar: per tier, the longest prefix that
can be resumed with every component's rule, next to the bare run of KV pages."""

from __future__ import annotations

import json

from hicache.controller.admin import cli as admin_cli
from hicache.controller.wire.protocol import Verb
from tests.support.sidecar import EngineProc, Sidecar, layout_file, short_tmpdir, wait_for

MIX = "full+swa+mamba"
PAGE = 4
WINDOW = 8  # the test engine's sliding window (tests/support/sidecar.py)


def test_score_applies_the_mamba_rule_per_tier(capsys):
    workdir = short_tmpdir("sc")
    with Sidecar(workdir, ["--layout-file", str(layout_file(workdir, MIX, PAGE))]) as sc:
        engine = EngineProc(sc.endpoint, "A", MIX)
        try:
            engine.receive()
            tokens = list(range(500, 532))  # 8 pages
            engine.call("run", tokens=tokens)
            admin = sc.admin()
            args = {"tokens": tokens, "sliding_window": WINDOW}
            before = admin.call(Verb.SCORE, args)
            # Every Mamba state leaves host once disk (write-through) has committed it.
            wait_for(
                lambda: admin.call(Verb.STATS)["residency"]["disk"]["mamba"]["resident"],
                30,
                "the Mamba state on disk",
            )
            admin.call(Verb.EVICT, {"tier": "host", "bytes": 1 << 30, "component": "mamba"})
            after = admin.call(Verb.SCORE, args)
            admin.close()
        finally:
            engine.close()
        assert before["pages"] == 8 and before["page_size"] == PAGE
        assert before["resumable"]["host"] == 8 == before["kv_pages"]["host"]
        assert after["kv_pages"]["host"] == 8  # the KV pages are all still on host
        assert after["resumable"]["host"] == 0  # but no state to resume from there
        assert after["resumable"]["disk"] == 8

        argv = ["--endpoint", sc.endpoint, "--json", "score", "--sliding-window", str(WINDOW)]
        code = admin_cli.main([*argv, "--tokens", ",".join(map(str, tokens))])
        assert code == 0
        assert json.loads(capsys.readouterr().out)["resumable"] == after["resumable"]
