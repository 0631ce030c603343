"""Tests of the page store: LocalController, page index, pins, host pool, copies, counters."""
