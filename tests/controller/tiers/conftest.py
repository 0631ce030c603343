"""Fixtures of the lower tiers' tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cluster import LocalCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three masters on loopback for the module's tests, stopped by their PIDs after."""
    c = LocalCluster(tmp_path_factory.mktemp("cluster"), masters=3).start()
    yield c
    c.stop()
