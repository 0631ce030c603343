"""The workload families: seeded and reproducible, valid Mooncake traces (prefix-hash ids),
each with the shape it claims."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from hicache.apps.replay import TraceRequest, load_trace
from hicache.apps.workloads import (
    AgentFamily,
    ChainIds,
    ChatFamily,
    RagFamily,
    agent_workload,
    chat_workload,
    compressed_sessions,
    rag_workload,
    shuffled_sessions,
    subsampled_sessions,
    write_rows,
)
from hicache.cli import main

SMALL = {
    "chat": lambda seed: chat_workload(ChatFamily(conversations=300, duration_s=200), seed),
    "agent": lambda seed: agent_workload(AgentFamily(sessions=40, duration_s=200), seed),
    "rag": lambda seed: rag_workload(RagFamily(requests=400, documents=300), seed),
}


def uses_per_block(rows: list[dict]) -> Counter:
    return Counter(h for r in rows for h in r["hash_ids"])


def test_equal_seeds_give_equal_workloads_and_other_seeds_others():
    for make in SMALL.values():
        assert make(3) == make(3)
        assert make(3) != make(4)


def test_every_family_is_a_valid_trace(tmp_path):
    for name, make in SMALL.items():
        path = tmp_path / f"{name}.jsonl"
        write_rows(path, make(0))
        trace = load_trace(path)  # refuses ids that are not prefix hashes
        assert len(trace) > 100, name
        for r in trace:
            assert (len(r.hash_ids) - 1) * 512 < r.input_length <= len(r.hash_ids) * 512


def test_chat_is_mostly_one_shot_blocks_and_agents_reuse_long_prefixes():
    chat = uses_per_block(SMALL["chat"](0))
    assert sum(1 for n in chat.values() if n == 1) > 0.6 * len(chat)
    agent_rows = SMALL["agent"](0)
    first_blocks = Counter(r["hash_ids"][0] for r in agent_rows)
    assert len(first_blocks) <= AgentFamily().tool_suites  # every session starts at a suite
    assert min(len(r["hash_ids"]) for r in agent_rows) >= AgentFamily().tool_blocks_min


def test_rag_scans_touch_documents_once_and_popular_ones_return():
    rows = SMALL["rag"](0)
    # A document's first block (after one of the system prompts) counts its requests.
    doc_starts = Counter(r["hash_ids"][RagFamily().system_blocks] for r in rows)
    assert max(doc_starts.values()) >= 5  # a popular document
    assert sum(1 for n in doc_starts.values() if n == 1) > 50  # scanned once


def test_chain_ids_follow_content_and_parent():
    ids = ChainIds()
    a = ids.chain(["x", "y"])
    assert ids.chain(["x", "y", "z"])[:2] == a
    assert ids.chain(["y"]) != a[1:]  # the same content after another parent is another block


def test_variants_keep_the_requests_and_sessions(tmp_path):
    trace = [
        TraceRequest(t, 1024, 1, ids)
        for t, ids in [(0, (0, 1)), (10, (5,)), (20, (0, 1, 2)), (40, (5, 6)), (80, (0, 3))]
    ]
    shuffled = shuffled_sessions(trace, 0)
    assert sorted(map(lambda r: tuple(r["hash_ids"]), shuffled)) == sorted(
        r.hash_ids for r in trace
    )
    compressed = compressed_sessions(trace, 4.0)
    assert [r["timestamp"] for r in compressed] == [0, 10, 5, 18, 20]
    sub = subsampled_sessions(trace, 0.5, 0)
    roots = {r["hash_ids"][0] for r in sub}
    assert all(r["hash_ids"][0] in roots for r in sub)
    assert sum(1 for r in trace if r.hash_ids[0] in roots) == len(sub)  # whole sessions


def test_the_command_writes_every_family_and_a_manifest(tmp_path, capsys):
    shared = tmp_path / "base.jsonl"
    write_rows(shared, SMALL["chat"](1))
    out = tmp_path / "w"
    assert (
        main(
            [
                "bench",
                "workloads",
                "--out",
                str(out),
                "--seed",
                "2",
                "--trace",
                str(shared),
                "--scale",
                "0.05",
            ]
        )
        == 0
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["seed"] == 2
    names = set(manifest["families"])
    assert {"shared", "shared-shuffled", "shared-compressed", "shared-subsample"} <= names
    assert {"chat", "agent", "rag"} <= names
    for name, m in manifest["families"].items():
        assert len(load_trace(out / m["file"])) == m["requests"], name
    assert "chat" in capsys.readouterr().out
    assert Path(out / "chat.jsonl").stat().st_size > 0
