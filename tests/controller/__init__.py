"""Tests of the node side (controller/), one folder per layer."""
