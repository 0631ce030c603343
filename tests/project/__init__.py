"""Tests of the project as a whole: structure, packaging, docs, deployment files."""
