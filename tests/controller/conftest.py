"""Fixtures of the node-side tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.sidecar import short_tmpdir


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A fresh folder with a short path (a Unix socket path must fit 107 bytes), removed
    after the test."""
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)
