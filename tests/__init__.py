"""The test suite, laid out like the source; fixtures live in the conftest.py of each folder."""
