"""Tests of the lower tiers: LMDB and the remote (Valkey/Redis Cluster) tier."""
