"""Tests of what an engine process imports: the sidecar client, its halves of sharing."""
