"""Tests of the applications (hicache/apps/): demo, replay, workloads, the reference engine."""
