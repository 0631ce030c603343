"""``hicache run-hf`` as a user meets it: bad flags end in one line and exit status 2, the
default workload reaches the host tier, and a run shows hits on the device, the host and
the disk (after the controller restarts) with every compared token bit-identical."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from hicache.cli import main
from hicache.integrations.transformers_demo import (
    add_run_hf_arguments,
    longest_request_tokens,
)

SMALL = ["--model", "lfm2", "--device", "cpu", "--users", "3", "--turns", "2"]
SMALL += ["--system-tokens", "32", "--message-tokens", "8", "--new-tokens", "2"]
SMALL += ["--page-size", "4", "--chunk-tokens", "8", "--device-tokens", "64"]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--device-tokens", "128"], "--device-tokens 128 holds 128 tokens"),
        (["--page-size", "5"], "--chunk-tokens 64 is not a multiple of --page-size 5"),
        (["--users", "0"], "--users must be at least 1"),
        (["--new-tokens", "0"], "--new-tokens must be at least 1"),
        (["--system-tokens", "-1"], "--system-tokens must be at least 0"),
        (["--size", "realistic", "--model", "jamba"], "configs for bamba, llama only"),
        (["--device", "tpu0"], "is not a torch device"),
        (["--turns", "40", "--device-tokens", "4096"], "more than the model's 512 positions"),
        (["--host-pool-bytes", "1"], "host_pool_bytes=1"),
    ],
)
def test_a_bad_flag_combination_is_one_line_and_exit_status_2(flags, says, capsys):
    assert main(["run-hf", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[transformers]")]
    assert len(lines) == 1 and lines[0].startswith("hicache run-hf: "), err
    assert says in lines[0]


def test_without_transformers_it_says_which_extra_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # an import of it fails
    assert main(["run-hf", "--device", "cpu"]) == 2
    assert 'pip install "hicache[transformers]"' in capsys.readouterr().err


def test_the_command_line_shows_no_traceback_for_a_bad_flag():
    cmd = [sys.executable, "-m", "hicache.cli", "run-hf", "--device-tokens", "128"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert "give at least 192" in run.stderr


def test_the_default_workload_holds_on_the_device_but_overflows_it():
    p = argparse.ArgumentParser()
    add_run_hf_arguments(p)
    args = p.parse_args([])
    assert longest_request_tokens(args) <= args.device_tokens
    chats = args.users * longest_request_tokens(args) - (args.users - 1) * args.system_tokens
    assert chats > args.device_tokens, "the default run must reach the host tier"


def test_a_run_hits_every_tier_and_every_compared_token_is_bit_identical(capsys, monkeypatch):
    # the command turns oneDNN off for its process; keep this process as it was
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", torch.backends.mkldnn.enabled)
    assert main(["run-hf", *SMALL]) == 0
    out = capsys.readouterr().out
    hits = {
        row.split()[-2]: int(row.split()[-1].replace(",", ""))
        for row in out.splitlines()
        if row.strip().startswith("hit tokens:")
    }
    assert min(hits.values()) > 0, out
    line = next(row for row in out.splitlines() if "bit-identical" in row)
    identical, compared = (int(w.replace(",", "")) for w in line.split(":")[1].split()[:3:2])
    assert identical == compared > 0, line
    assert "0 mismatches" in out
