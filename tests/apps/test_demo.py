"""``hicache demo``: a short run end to end, and its failure paths."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from hicache.apps.demo import (
    QUICK_WORKLOAD,
    add_demo_arguments,
    demo_settings,
    report_demo,
    run_demo,
)
from hicache.apps.engine.demo_report import PhaseReport
from hicache.apps.engine.worker import WorkerEngine, WorkerSettings


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    return parser.parse_args(argv)


def test_the_quick_demo_hits_every_tier_where_it_must_and_every_logit_is_exact(tmp_path, capsys):
    workdir = tmp_path / "demo"
    argv = ["--quick", "--json", "--no-progress", "--workdir", str(workdir)]
    code = run_demo(parse(argv))
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    doc = json.loads(out)
    assert doc == json.loads((workdir / "demo.json").read_text())
    assert doc["ok"] and doc["mismatches"] == 0 and doc["failed_requests"] == 0
    chat, restart = doc["phases"]
    cfg = QUICK_WORKLOAD
    # phase 1: engines hit their own turns and system prompts on the device, and each
    # other's backups on the host; nothing was ever evicted to disk only
    assert chat["requests"] == cfg.conversations * cfg.turns
    assert chat["hit_tokens"]["device"] > 0 and chat["hit_tokens"]["host"] > 0
    assert chat["hit_tokens"]["disk"] == 0
    assert chat["bytes_moved"]["device_to_host"] > 0 and chat["bytes_moved"]["host_to_device"] > 0
    # phase 2, after restarting everything: the second-to-last turns come back from disk,
    # read straight into the engines' CPU pools (disk_load_direct, the default: they stay
    # on disk only, not on host); device hits need a Mamba state cached past the loaded
    # one, which these short turns rarely leave
    assert restart["requests"] == 2 * cfg.conversations
    assert restart["hit_tokens"]["disk"] > 0
    assert restart["bytes_moved"]["disk_to_device"] > 0
    for phase in (chat, restart):
        # every generated token's logits were compared, and every token is either a hit
        # or computed (no preemption at these sizes)
        assert (
            phase["checked_tokens"]
            == phase["generated_tokens"]
            == (phase["requests"] * cfg.new_tokens)
        )
        assert phase["preemptions"] == 0
        hits = sum(phase["hit_tokens"].values())
        computed = phase["prompt_tokens"] + phase["generated_tokens"] - phase["requests"]
        assert hits + phase["computed_tokens"] == computed == phase["no_cache_computed_tokens"]
        assert phase["time_s"] > 0 and phase["no_cache_time_s"] > 0
        assert len(phase["timeline"]) == phase["requests"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert doc["plot"] and Path(doc["plot"]).stat().st_size > 0
    else:
        assert "matplotlib is not installed" in doc["plot_note"]


def test_a_logit_mismatch_fails_the_demo_loudly(tmp_path, capsys):
    settings = demo_settings(parse(["--quick", "--workdir", str(tmp_path)]))
    phase = PhaseReport("phase 1", "test", requests=1, checked_tokens=4)
    phase.mismatches.append({"rid": "c0-t1", "run": "cached", "engine": "A", "max_abs_diff": 0.5})
    code = report_demo([phase], settings, 1.0, plot=False)
    err = capsys.readouterr().err
    assert code == 1
    assert "LOGIT MISMATCH in phase 1" in err and "c0-t1" in err
    assert "hicache demo FAILED: 1 requests whose logits differ" in err
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert not doc["ok"] and doc["mismatches"] == 1


def test_tokens_whose_logits_were_never_compared_fail_the_demo(tmp_path, capsys):
    """Exactness is proven only for what was compared: a phase that generated more tokens
    than it checked fails, as a mismatch does."""
    settings = demo_settings(parse(["--quick", "--workdir", str(tmp_path)]))
    phase = PhaseReport("phase 1", "test", requests=2, checked_tokens=4, generated_tokens=8)
    code = report_demo([phase], settings, 1.0, plot=False)
    err = capsys.readouterr().err
    assert code == 1
    assert "the logits of 4 generated tokens were never compared" in err
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert not doc["ok"] and doc["unchecked_tokens"] == 4


def test_the_worker_detects_logits_that_differ_from_generate():
    """The check that the demo relies on: a stored logit off by one ulp is a mismatch."""
    events: list[dict] = []
    threads = torch.get_num_threads()  # the worker sets its own
    engine = WorkerEngine(WorkerSettings(engine_id="t", full_slots=2048), events.append)
    try:
        prompt = list(range(3, 40))
        requests = [
            {"rid": "same", "prompt": prompt, "max_new_tokens": 3},
            {"rid": "bent", "prompt": prompt[::-1], "max_new_tokens": 3},
        ]
        engine.run("cached", requests)
        engine.run("nocache", requests)
        bent = engine.logits["cached"]["bent"]
        bent[1, 7] = torch.nextafter(bent[1, 7], torch.tensor(float("inf")))
        assert engine.verify(["same", "bent"]) == {"event": "verify_done", "checked": 2}
        verdicts = {e["rid"]: e for e in events if e["event"] == "verified"}
        assert verdicts["same"]["cached"] and verdicts["same"]["nocache"]
        assert verdicts["bent"]["cached"] is False and verdicts["bent"]["nocache"]
        assert verdicts["bent"]["cached_max_abs_diff"] > 0
    finally:
        engine.close()
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layers", "full,moe"], "--layers 'full,moe'"),
        (["--page-size", "0"], "--page-size must be >= 1"),
        (["--turns", "0"], "turns must be >= 1"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(tmp_path, capsys, argv, message):
    assert run_demo(parse([*argv, "--workdir", str(tmp_path)])) == 2
    assert message in capsys.readouterr().err
