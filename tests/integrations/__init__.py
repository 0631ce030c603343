"""Tests of the engine integrations that need no engine installed (hicache/integrations/)."""
