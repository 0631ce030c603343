"""Tests of the hicache serve process: server, sessions, security, execution lanes, metrics."""
