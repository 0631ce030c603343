"""The resume rule (hicache/resume.py): every component's match rule, on presence rows."""

from __future__ import annotations

import pytest

from hicache.resume import resumable_pages, window_pages
from hicache.types import ComponentType

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA


def held(v: int) -> bool:
    return v == 1


def test_full_only_is_the_leading_run():
    assert resumable_pages({FULL: [1, 1, 1, 0, 1]}, held) == 3


def test_mamba_needs_a_state_exactly_at_the_end():
    rows = {FULL: [1, 1, 1, 1, 1, 1], MAMBA: [0, 1, 0, 1, 0, 0]}
    assert resumable_pages(rows, held) == 4


def test_swa_needs_an_unbroken_window_ending_at_the_match():
    rows = {FULL: [1] * 6, SWA: [1, 0, 1, 1, 0, 0]}
    assert resumable_pages(rows, held, swa_window_pages=2) == 4  # pages 2,3
    assert resumable_pages(rows, held, swa_window_pages=3) == 1  # only the short start
    short = {FULL: [1, 1], SWA: [1, 1]}
    assert resumable_pages(short, held, swa_window_pages=4) == 2  # shorter than the window


def test_every_rule_at_once_and_the_window_in_pages():
    rows = {FULL: [1] * 5, SWA: [0, 1, 1, 1, 1], MAMBA: [0, 0, 1, 0, 1]}
    assert resumable_pages(rows, held, swa_window_pages=window_pages(8, 4)) == 5
    rows[MAMBA][4] = 0
    assert resumable_pages(rows, held, swa_window_pages=2) == 3
    assert window_pages(9, 4) == 3 and window_pages(None, 4) == 0
    with pytest.raises(ValueError):
        resumable_pages(rows, held)
