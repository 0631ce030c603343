"""Tests of the transfer kernels (kernels/)."""
