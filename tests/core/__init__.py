"""Tests of the core library (hicache/): tree, cache, components, pools, eviction, tiering."""
