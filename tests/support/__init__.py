"""Plain code the tests import: test doubles, process wrappers, a local cluster.

Fixtures (what a test borrows for its run: a started sidecar, a cluster, a short folder)
live in the conftest.py of the folder whose tests use them. What is here is imported by
name, because a fixture cannot serve it: base classes the tests extend, what hypothesis
state machines build on, constants of parametrized tests, and code that runs outside pytest
(the engine worker process, the engine suites in their own environments, benchmarks).
"""
