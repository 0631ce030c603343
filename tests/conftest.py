"""What every test shares: the pools' debug checks, the hypothesis profiles, one torch thread.

The default suite is deterministic: every property and state-machine test draws the same
examples on every run (``derandomize``), so a red CI is a regression, not a new draw.
Exploration with fresh random examples is the ``slow`` soak (tests/core/test_stateful_soak.py),
or any test run with ``HICACHE_HYPOTHESIS_PROFILE=explore``. A failure prints the
``@reproduce_failure`` blob that replays it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# The pools' debug checks (a duplicate page in a free that claims distinct pages raises)
# are on for every test of this process. Not through the environment: a sidecar refuses
# HICACHE_ variables that are not its options.
try:
    from hicache import pools as _pools
except ImportError:  # a bare GPU host running only `-m gpu` files
    _pools = None
if _pools is not None:
    _pools.DEBUG_CHECKS = True

try:
    from hypothesis import settings
except ImportError:  # a bare GPU host running only `-m gpu` files has no hypothesis
    settings = None

if settings is not None:
    settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    settings.register_profile("explore", derandomize=False, print_blob=True)
    settings.load_profile(os.environ.get("HICACHE_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for the module: the tiny models' matmuls are too small to gain from
    threads, and on a loaded machine a second thread only contends."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
