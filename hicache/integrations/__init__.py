"""Integrations with serving engines and model libraries, one module per engine.

Each module imports its engine only inside itself, so ``import hicache`` never needs vLLM,
SGLang or transformers installed.
"""

from hicache.integrations.import_guard import prefer_installed_kernels

# From a checkout's root, the folder kernels/ would shadow the PyPI package transformers
# imports (module docstring of hicache.integrations.import_guard).
prefer_installed_kernels()
