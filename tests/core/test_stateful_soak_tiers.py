"""Soak of the tiered machine's two variants (``pytest -m slow``): sliding windows of several
pages over a small SWA pool, and transfers that settle late. Fresh random examples, as many
and as long as test_stateful_soak.py's knobs say (``HICACHE_SOAK_EXAMPLES``,
``HICACHE_SOAK_STEPS``)."""

from __future__ import annotations

import pytest

from tests.core.test_stateful_soak import test_state_machine_soak as soak
from tests.core.test_tiers_stateful import LateTransferMachine, SWAPressureMachine


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(
    "machine", [SWAPressureMachine, LateTransferMachine], ids=["swa-pressure", "late-transfers"]
)
def test_tiered_variants_soak(machine):
    soak(machine)
