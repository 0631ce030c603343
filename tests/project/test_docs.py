"""The commands in the operator and integrator docs work as written.

Convention (docs/operations.md, docs/integration.md): every ```bash or ```python block is
preceded by an HTML comment, either ``<!-- test: run -->`` or ``<!-- test: skip: why -->``.
The runnable blocks of one document are run in order, as one bash script (a Python block
is fed to ``python -``), so that a sidecar started by one block serves the next ones. The
script runs in a scratch directory holding a link to the repository's ``deploy/``, with
this checkout's ``.venv/bin`` first on ``PATH``, ``XDG_RUNTIME_DIR`` inside the scratch
directory and ``HICACHE_METRICS_PORT`` set to a free port (so that a sidecar already on
this machine cannot collide). A ```text block preceded by ``<!-- test: output -->`` lists
lines that the output of the runnable block before it must contain, in order.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.sidecar import free_port, short_tmpdir

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
COMMAND_DOCS = ("operations.md", "integration.md")
COMMAND_LANGS = {"bash", "sh", "shell", "console", "python"}
SCRIPT_TIMEOUT_S = 300

_FENCE = re.compile(r"^```([a-zA-Z]*)\s*$")
_MARKER = re.compile(r"^<!--\s*test:\s*(run|output|skip:\s*(.+?))\s*-->\s*$")


@dataclass
class Block:
    doc: str
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    marker: str | None  # "run", "output", "skip" or None
    reason: str = ""


def parse_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` with the test marker on the line before it."""
    lines = path.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1).lower()
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        assert j < len(lines), f"{path.name}:{start + 1}: unclosed code block"
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mk = _MARKER.match(prev.strip())
        marker = reason = None
        if mk:
            marker = "skip" if mk.group(1).startswith("skip") else mk.group(1)
            reason = (mk.group(2) or "").strip()
        blocks.append(
            Block(path.name, start + 1, lang, "\n".join(lines[start + 1 : j]), marker, reason or "")
        )
        i = j + 1
    return blocks


def build_script(blocks: list[Block], outdir: str) -> tuple[str, list[Block]]:
    """One bash script running the ``run`` blocks in order; block N's output goes to
    ``<outdir>/N.txt``. Returns the script and the blocks it runs."""
    runnable = [b for b in blocks if b.marker == "run"]
    parts = [
        "set -euo pipefail",
        # Whatever a block left running in the background ends with the script.
        "trap 'jobs -p | xargs -r kill 2>/dev/null || true' EXIT",
        f"mkdir -p {outdir}",
    ]
    for n, b in enumerate(runnable):
        parts.append(f'echo "=== block {n}: {b.doc}:{b.line}" >&2')
        if b.lang == "python":
            body = f"python - <<'HICACHE_DOC_PYTHON'\n{b.body}\nHICACHE_DOC_PYTHON"
        else:
            body = b.body
        parts.append(f"{{\n{body}\n}} > {outdir}/{n}.txt 2>&1")
    return "\n".join(parts) + "\n", runnable


def _doc_blocks(name: str) -> list[Block]:
    return parse_blocks(DOCS / name)


@pytest.mark.parametrize("name", COMMAND_DOCS)
def test_every_command_block_is_marked(name):
    """A command a reader is told to type is either run by this test or says why not."""
    blocks = _doc_blocks(name)
    unmarked = [
        f"{b.doc}:{b.line}"
        for b in blocks
        if b.lang in COMMAND_LANGS and b.marker not in ("run", "skip")
    ]
    assert not unmarked, f"command blocks without <!-- test: run/skip --> marker: {unmarked}"
    assert all(b.reason for b in blocks if b.marker == "skip"), "a skip marker needs a reason"
    assert any(b.marker == "run" for b in blocks)


@pytest.mark.parametrize("name", COMMAND_DOCS)
def test_relative_links_resolve(name):
    text = (DOCS / name).read_text()
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        if not (DOCS / target).resolve().exists():
            broken.append(target)
    assert not broken, f"{name}: links to missing files: {broken}"


def _expected_outputs(blocks: list[Block]) -> dict[int, list[str]]:
    """{index among runnable blocks: lines its output must contain}."""
    out: dict[int, list[str]] = {}
    n = -1
    for b in blocks:
        if b.marker == "run":
            n += 1
        elif b.marker == "output":
            assert n >= 0, f"{b.doc}:{b.line}: an output block before any runnable block"
            out[n] = [line for line in b.body.splitlines() if line.strip()]
    return out


def _run_doc(name: str, workdir: Path) -> tuple[subprocess.CompletedProcess, list[Block], Path]:
    blocks = _doc_blocks(name)
    script, runnable = build_script(blocks, "doc-output")
    (workdir / "deploy").symlink_to(REPO / "deploy")
    (workdir / "xdg").mkdir(mode=0o700)
    venv_bin = str(Path(sys.executable).parent)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HICACHE_") or k == "HICACHE_REQUIRE_PROMETHEUS"
    }
    env.update(
        PATH=venv_bin + os.pathsep + env.get("PATH", ""),
        XDG_RUNTIME_DIR=str(workdir / "xdg"),
        HICACHE_METRICS_PORT=str(free_port()),
        PYTHONUNBUFFERED="1",
    )
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(timed out after {SCRIPT_TIMEOUT_S}s)"
    finally:
        # A sidecar the script started must never outlive the test.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return res, runnable, workdir / "doc-output"


def _report(res: subprocess.CompletedProcess, runnable: list[Block], outdir: Path) -> str:
    parts = [f"exit {res.returncode}", res.stderr[-3000:]]
    for n, b in enumerate(runnable):
        f = outdir / f"{n}.txt"
        if f.exists():
            parts.append(f"--- block {n} ({b.doc}:{b.line}) output:\n{f.read_text()[-3000:]}")
    log = outdir.parent / "sidecar.log"
    if log.exists():
        parts.append(f"--- sidecar.log:\n{log.read_text()[-3000:]}")
    return "\n".join(parts)


@pytest.mark.parametrize("name", COMMAND_DOCS)
def test_doc_commands_work_as_written(name):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (apt-get install curl)")
    needs_promtool = any("promtool" in b.body for b in _doc_blocks(name) if b.marker == "run")
    if needs_promtool and shutil.which("promtool") is None:
        if os.environ.get("HICACHE_REQUIRE_PROMETHEUS") == "1":
            pytest.fail("promtool is required (HICACHE_REQUIRE_PROMETHEUS=1)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    workdir = short_tmpdir("hcdoc")
    try:
        res, runnable, outdir = _run_doc(name, workdir)
        report = _report(res, runnable, outdir)
        assert res.returncode == 0, report
        for n in range(len(runnable)):
            assert f"=== block {n}:" in res.stderr, report
        for n, lines in _expected_outputs(_doc_blocks(name)).items():
            text = (outdir / f"{n}.txt").read_text().splitlines()
            pos = 0
            for want in lines:
                found = next((i for i in range(pos, len(text)) if text[i].rstrip() == want), None)
                assert found is not None, f"block {n} did not print {want!r}\n{report}"
                pos = found + 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_the_convention_catches_a_failing_command(tmp_path):
    """A block that fails fails the script, and the report names the block."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- test: run -->\n```bash\necho first\n```\n\n"
        "<!-- test: run -->\n```python\nraise SystemExit(3)\n```\n\n"
        "<!-- test: run -->\n```bash\necho never\n```\n"
    )
    script, runnable = build_script(parse_blocks(doc), "out")
    res = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert len(runnable) == 3
    assert res.returncode == 3
    assert "=== block 1: doc.md:7" in res.stderr and "=== block 2" not in res.stderr
    assert (tmp_path / "out" / "0.txt").read_text() == "first\n"


def test_performance_doc_says_how_to_run_every_benchmark():
    """The table at the top of docs/performance.md lists every script in benchmarks/, and
    each flag it shows is one that script (or ``hicache demo`` / ``bench replay``) defines."""
    text = (DOCS / "performance.md").read_text()
    start = text.index("## How to run each benchmark")
    section = text[start : text.index("\n## ", start + 1)]
    # .venv/bin/ or an engine's (or an anchor's) .venv-<name>/bin/
    commands = re.findall(r"`((?:\.venv(?:-[\w-]+)?/bin/|python3? )[^`]+)`", section)
    scripts = {Path(p).name for p in re.findall(r"benchmarks/\w+\.py", " ".join(commands))}
    on_disk = {p.name for p in (REPO / "benchmarks").glob("*.py")}
    assert on_disk - scripts == set(), (
        f"benchmarks without a command in the table: {on_disk - scripts}"
    )
    for command in commands:
        m = re.search(r"benchmarks/\w+\.py", command)
        if m:
            source = REPO / m.group(0)
        elif "hicache bench replay" in command:
            source = REPO / "hicache" / "apps" / "replay_bench.py"
        elif "hicache bench workloads" in command:
            source = REPO / "hicache" / "apps" / "workloads.py"
        else:
            source = REPO / "hicache" / "apps" / "demo.py"
        defined = set(re.findall(r"add_argument\(\s*\"(--[a-z-]+)\"", source.read_text()))
        shown = set(re.findall(r"--[a-z][a-z-]*", command))
        assert shown <= defined, f"{command}: flags {shown - defined} are not defined"


def test_integration_guide_names_every_cache_option():
    from hicache import CacheConfig

    text = (DOCS / "integration.md").read_text()
    missing = [name for name in CacheConfig.field_names() if f"`{name}`" not in text]
    assert not missing, f"CacheConfig options missing from docs/integration.md: {missing}"
