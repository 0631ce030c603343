"""Fixtures of the SGLang suite (run by ``make test-sglang`` in .venv-sglang): SGLang's own
host pools built on the CPU, its reference file backend, and a hicache sidecar."""

from __future__ import annotations

import contextlib
import sys
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))  # tests.support
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.support.sidecar import Sidecar, short_tmpdir  # noqa: E402


@pytest.fixture
def sidecar():
    """A running ``hicache serve`` with its own socket and LMDB; stopped by its PID."""
    workdir = short_tmpdir("hcsgl")
    car = Sidecar(workdir)
    with car:
        yield car


@pytest.fixture(scope="session")
def sidecar_per_layout():
    """``get(name)``: a sidecar for one layout (a sidecar serves one), shared by the tests
    that neither restart nor kill it; each is stopped by its PID when the session ends."""
    started: dict[str, Sidecar] = {}

    def get(layout_name: str) -> Sidecar:
        if layout_name not in started:
            started[layout_name] = Sidecar(short_tmpdir("hcsgl")).start()
        return started[layout_name]

    yield get
    for car in started.values():
        with contextlib.suppress(Exception):
            car.stop(30)
        car.kill()


@pytest.fixture
def token_base(request) -> int:
    """A first token of this test's own: tests sharing a sidecar never share a page."""
    return zlib.crc32(request.node.nodeid.encode()) % 1_000_000 * 1000
