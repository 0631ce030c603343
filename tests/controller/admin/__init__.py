"""Tests of the admin operations and hicachectl."""
