"""Workloads of several kinds in the Mooncake trace format, built reproducibly from a seed.

An eviction policy judged on one trace is tuned to it. ``hicache bench workloads --out DIR
--seed N`` writes one JSONL trace per family below (and ``manifest.json`` with each one's
requests and distinct blocks), so ``hicache bench replay`` can be run over all of them:

* ``shared``: the shared synthetic Mooncake trace as given (when ``--trace`` names it);
* ``shared-shuffled``: its sessions (requests with the same first block) each moved to
  the start time of another session, keeping the gaps within a session;
* ``shared-compressed``: every gap within a session divided by ``compress_factor``, so a
  session's requests return sooner and interleave less with other sessions;
* ``shared-subsample``: a random half of its sessions, whole;
* ``chat``: multi-turn conversations in the model of the demo's chat workload
  (:mod:`hicache.apps.engine.workload`: shared system prompts, each turn the previous prompt
  plus the reply plus a new user message), at trace scale and in blocks: many one-turn
  conversations with a pasted document, and every request's last block partial (the
  next turn rewrites it), so most blocks are never used again;
* ``agent``: tool-using agent sessions: a few long tool-suite prefixes shared by every
  session, then short steps that each append a tool result, in quick bursts;
* ``rag``: retrieval-augmented requests (a system prompt, then one document from a
  Zipf-popular corpus, then the question) mixed with sequential scans of the corpus that
  touch every document once, the pattern that flushes an LRU cache.

Block ids are prefix hashes, as in the format: a block's id is a function of its content
and of the id before it (:class:`ChainIds`), so equal prefixes get equal ids and an id
always follows the same id.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hicache.apps.replay import TraceRequest, load_trace, unique_blocks

BLOCK_TOKENS = 512


class ChainIds:
    """Block ids by content: the id of a block is fixed by its content key and the id of
    the block before it (-1 at a request's start)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, Hashable], int] = {}

    def chain(self, contents: Sequence[Hashable], parent: int = -1) -> list[int]:
        """The ids of ``contents`` following block ``parent``, new ones allocated."""
        out = []
        for content in contents:
            key = (parent, content)
            parent = self._ids.get(key, -2)
            if parent == -2:
                parent = self._ids[key] = len(self._ids)
            out.append(parent)
        return out


def _record(ts_ms: float, ids: list[int], output_tokens: int, rng: np.random.Generator) -> dict:
    # The last block of a prompt is partial: input_length ends somewhere inside it.
    partial = int(rng.integers(1, BLOCK_TOKENS + 1))
    n_in = (len(ids) - 1) * BLOCK_TOKENS + partial
    return {
        "timestamp": round(ts_ms),
        "input_length": n_in,
        "output_length": output_tokens,
        "hash_ids": ids,
    }


def _zipf_choice(rng: np.random.Generator, n: int, exponent: float, size: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** exponent
    return rng.choice(n, size=size, p=weights / weights.sum())


# -- conversations ---------------------------------------------------------------------


@dataclass(frozen=True)
class ChatFamily:
    """Conversation workload sizes (blocks of 512 tokens, seconds)."""

    conversations: int = 7900
    system_prompts: int = 3000
    system_blocks_max: int = 6
    system_zipf: float = 1.0
    one_turn_share: float = 0.68  # conversations of a single request
    turns_mean: float = 2.6  # of the others (geometric, at least 2)
    document_share: float = 0.6  # first turns that paste a document
    document_blocks_max: int = 48
    user_blocks_max: int = 6
    reply_blocks_max: int = 2
    think_s_mean: float = 90.0
    duration_s: float = 3600.0


def chat_workload(family: ChatFamily, seed: int) -> list[dict]:
    """Conversations (see the module docstring); each turn's prompt is the previous
    prompt's full blocks, the reply and a new user message, ending in a partial block."""
    rng = np.random.default_rng([seed, 1])
    ids = ChainIds()
    f = family
    sys_len = rng.integers(1, f.system_blocks_max + 1, f.system_prompts)
    sys_of = _zipf_choice(rng, f.system_prompts, f.system_zipf, f.conversations)
    starts = np.sort(rng.uniform(0, f.duration_s, f.conversations))
    rows = []
    for c in range(f.conversations):
        s = int(sys_of[c])
        prompt = [("sys", s, i) for i in range(sys_len[s])]
        if rng.random() < f.one_turn_share:
            turns = 1
        else:
            turns = 2 + int(rng.geometric(1.0 / max(1.0, f.turns_mean - 1.0))) - 1
        t_s = float(starts[c])
        if rng.random() < f.document_share:
            n_doc = int(rng.integers(4, f.document_blocks_max + 1))
            prompt += [("doc", c, i) for i in range(n_doc)]
        for turn in range(turns):
            n_user = int(rng.integers(1, f.user_blocks_max + 1))
            prompt += [("user", c, turn, i) for i in range(n_user)]
            # The last block is partial: the next turn's content rewrites it.
            request = [*prompt, ("tail", c, turn)]
            out_tokens = int(rng.integers(16, f.reply_blocks_max * BLOCK_TOKENS))
            rows.append(_record(t_s * 1000, ids.chain(request), out_tokens, rng))
            prompt += [("reply", c, turn, i) for i in range(1 + out_tokens // BLOCK_TOKENS)]
            t_s += float(rng.exponential(f.think_s_mean))
    return rows


# -- agents ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentFamily:
    """Agent sessions: long shared tool prefixes, short bursts of steps."""

    sessions: int = 900
    tool_suites: int = 6
    tool_blocks_min: int = 16
    tool_blocks_max: int = 48
    suite_zipf: float = 0.8
    task_blocks_max: int = 6
    steps_min: int = 3
    steps_max: int = 20
    step_blocks_max: int = 3
    step_s_mean: float = 4.0
    duration_s: float = 3600.0


def agent_workload(family: AgentFamily, seed: int) -> list[dict]:
    """Agent sessions (see the module docstring)."""
    rng = np.random.default_rng([seed, 2])
    ids = ChainIds()
    f = family
    suite_len = rng.integers(f.tool_blocks_min, f.tool_blocks_max + 1, f.tool_suites)
    suite_of = _zipf_choice(rng, f.tool_suites, f.suite_zipf, f.sessions)
    starts = rng.uniform(0, f.duration_s, f.sessions)
    rows = []
    for a in range(f.sessions):
        s = int(suite_of[a])
        prompt = [("tools", s, i) for i in range(suite_len[s])]
        prompt += [("task", a, i) for i in range(int(rng.integers(1, f.task_blocks_max + 1)))]
        t_s = float(starts[a])
        for step in range(int(rng.integers(f.steps_min, f.steps_max + 1))):
            rows.append(_record(t_s * 1000, ids.chain([*prompt, ("tail", a, step)]), 64, rng))
            n_new = int(rng.integers(1, f.step_blocks_max + 1))
            prompt += [("step", a, step, i) for i in range(n_new)]
            t_s += float(rng.exponential(f.step_s_mean))
    return rows


# -- retrieval with scans ------------------------------------------------------------------


@dataclass(frozen=True)
class RagFamily:
    """Retrieval requests over a corpus, with sequential scans mixed in."""

    requests: int = 10000
    system_prompts: int = 4
    system_blocks: int = 2
    documents: int = 12000
    document_blocks_min: int = 2
    document_blocks_max: int = 12
    document_zipf: float = 0.9
    scan_share: float = 0.3  # requests that read the next document of a scan instead
    duration_s: float = 3600.0


def rag_workload(family: RagFamily, seed: int) -> list[dict]:
    """Retrieval and scan requests (see the module docstring)."""
    rng = np.random.default_rng([seed, 3])
    ids = ChainIds()
    f = family
    doc_len = rng.integers(f.document_blocks_min, f.document_blocks_max + 1, f.documents)
    # Popularity is a random permutation of the corpus, so a scan (in corpus order) does
    # not run through the popular documents first.
    rank = rng.permutation(f.documents)
    picks = rank[_zipf_choice(rng, f.documents, f.document_zipf, f.requests)]
    times = np.sort(rng.uniform(0, f.duration_s, f.requests))
    scan_next = 0
    rows = []
    for i in range(f.requests):
        if rng.random() < f.scan_share:
            d, scan_next = scan_next, (scan_next + 1) % f.documents
        else:
            d = int(picks[i])
        s = int(rng.integers(f.system_prompts))
        request = [("sys", s, b) for b in range(f.system_blocks)]
        request += [("doc", d, b) for b in range(doc_len[d])]
        request.append(("question", i))
        rows.append(_record(times[i] * 1000, ids.chain(request), 128, rng))
    return rows


# -- variants of a given trace -------------------------------------------------------------


def _as_rows(trace: Sequence[TraceRequest]) -> list[dict]:
    return [
        {
            "timestamp": r.timestamp_ms,
            "input_length": r.input_length,
            "output_length": r.output_length,
            "hash_ids": list(r.hash_ids),
        }
        for r in trace
    ]


def _sessions(trace: Sequence[TraceRequest]) -> list[list[int]]:
    """Indices of the requests of each session (same first block), in time order."""
    by_root: dict[int, list[int]] = {}
    for i, r in enumerate(trace):
        by_root.setdefault(r.hash_ids[0] if r.hash_ids else -1 - i, []).append(i)
    return list(by_root.values())


def shuffled_sessions(trace: Sequence[TraceRequest], seed: int) -> list[dict]:
    """Each session moved to another session's start time, its own gaps kept."""
    rng = np.random.default_rng([seed, 4])
    rows = _as_rows(trace)
    sessions = _sessions(trace)
    starts = [trace[s[0]].timestamp_ms for s in sessions]
    for session, start in zip(sessions, rng.permutation(starts)):
        shift = float(start) - trace[session[0]].timestamp_ms
        for i in session:
            rows[i]["timestamp"] = round(trace[i].timestamp_ms + shift)
    return rows


def compressed_sessions(trace: Sequence[TraceRequest], factor: float) -> list[dict]:
    """Every gap within a session divided by ``factor``."""
    rows = _as_rows(trace)
    for session in _sessions(trace):
        t0 = trace[session[0]].timestamp_ms
        for i in session:
            rows[i]["timestamp"] = round(t0 + (trace[i].timestamp_ms - t0) / factor)
    return rows


def subsampled_sessions(trace: Sequence[TraceRequest], share: float, seed: int) -> list[dict]:
    """A random ``share`` of the sessions, whole (at least one)."""
    rng = np.random.default_rng([seed, 5])
    sessions = _sessions(trace)
    keep = [s for s in sessions if rng.random() < share] or sessions[:1]
    rows = _as_rows(trace)
    return [rows[i] for i in sorted(i for s in keep for i in s)]


# -- the command ---------------------------------------------------------------------------


def _scaled(family: object, scale: float, counts: tuple[str, ...]) -> object:
    """``family`` with its ``counts`` fields (and its duration) times ``scale``, so the
    rate of arrivals stays what it was."""
    changes = {name: max(1, round(getattr(family, name) * scale)) for name in counts}
    changes["duration_s"] = family.duration_s * scale
    return replace(family, **changes)


GENERATED: dict[str, Callable[[int, float], list[dict]]] = {
    "chat": lambda seed, scale: chat_workload(
        _scaled(ChatFamily(), scale, ("conversations", "system_prompts")), seed
    ),
    "agent": lambda seed, scale: agent_workload(_scaled(AgentFamily(), scale, ("sessions",)), seed),
    "rag": lambda seed, scale: rag_workload(
        _scaled(RagFamily(), scale, ("requests", "documents")), seed
    ),
}


def write_rows(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` as a JSONL trace in time order (stable for equal times)."""
    rows = sorted(rows, key=lambda r: r["timestamp"])
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))


def build_workloads(
    out_dir: Path,
    seed: int,
    shared_trace: Path | None,
    compress_factor: float = 4.0,
    scale: float = 1.0,
) -> dict[str, dict]:
    """Write every family's trace into ``out_dir`` (generated ones at ``scale`` times
    their size); returns the manifest (also written as ``manifest.json``): per family its
    file, requests and distinct blocks."""
    out_dir.mkdir(parents=True, exist_ok=True)
    families: dict[str, list[dict]] = {}
    if shared_trace is not None:
        base = load_trace(shared_trace)
        families["shared"] = _as_rows(base)
        families["shared-shuffled"] = shuffled_sessions(base, seed)
        families["shared-compressed"] = compressed_sessions(base, compress_factor)
        families["shared-subsample"] = subsampled_sessions(base, 0.5, seed)
    for name, make in GENERATED.items():
        families[name] = make(seed, scale)
    manifest = {}
    for name, rows in families.items():
        path = out_dir / f"{name}.jsonl"
        write_rows(path, rows)
        trace = load_trace(path)  # also checks that the ids are prefix hashes
        manifest[name] = {
            "file": path.name,
            "requests": len(trace),
            "distinct_blocks": unique_blocks(trace),
            "requested_blocks": sum(len(r.hash_ids) for r in trace),
        }
    doc = {"seed": seed, "scale": scale, "families": manifest}
    (out_dir / "manifest.json").write_text(json.dumps(doc))
    return manifest


def add_workload_arguments(sub: argparse._SubParsersAction) -> None:
    """The ``hicache bench workloads`` subcommand."""
    p = sub.add_parser(
        "workloads",
        help="write traces of several workload families (seeded) for `bench replay`",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("--out", required=True, help="directory for the JSONL traces")
    p.add_argument("--seed", type=int, default=0, help="seed of every generator")
    p.add_argument(
        "--trace",
        help="a Mooncake trace to include with its variants (shuffled, compressed, subsample)",
    )
    p.add_argument(
        "--compress-factor", type=float, default=4.0, help="gap divisor of shared-compressed"
    )
    p.add_argument(
        "--scale", type=float, default=1.0, help="size of the generated families (1: trace scale)"
    )


def run_workloads(args: argparse.Namespace) -> int:
    """Build the workloads and print one line per family."""
    if not (args.compress_factor > 0 and args.scale > 0):
        print("hicache bench workloads: --compress-factor and --scale must be > 0", file=sys.stderr)
        return 2
    trace = Path(args.trace) if args.trace else None
    manifest = build_workloads(Path(args.out), args.seed, trace, args.compress_factor, args.scale)
    for name, m in manifest.items():
        reuse = 1 - m["distinct_blocks"] / m["requested_blocks"]
        print(
            f"{name:18s} {m['requests']:7,d} requests {m['distinct_blocks']:8,d} distinct "
            f"blocks {m['requested_blocks']:8,d} requested (infinite cache {reuse:.1%})"
        )
    return 0
