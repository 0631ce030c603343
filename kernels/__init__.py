"""Triton copy kernels with torch reference versions (imported as hicache.kernels)."""
