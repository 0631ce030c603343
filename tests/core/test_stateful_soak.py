"""Soak of the two state machines with fresh random examples (``pytest -m slow``).

The default suite replays a fixed set of examples (see conftest.py); this draws new ones
on every run, many more of them, to find what the fixed set does not cover. Set
``HICACHE_SOAK_EXAMPLES`` to change how many each machine runs and ``HICACHE_SOAK_STEPS``
how many steps each example takes (longer runs reach deeper states).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.core.test_tiers_stateful import TieredMachine
from tests.core.test_tree_stateful import TreeMachine

EXAMPLES = int(os.environ.get("HICACHE_SOAK_EXAMPLES", "1000"))
STEPS = int(os.environ.get("HICACHE_SOAK_STEPS", "50"))


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("machine", [TreeMachine, TieredMachine], ids=["tree", "tiers"])
def test_state_machine_soak(machine):
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            derandomize=False,
            database=None,
            deadline=None,
            print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
