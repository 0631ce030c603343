"""Integrations with serving engines and model libraries, one module per engine.

Each module imports its engine only inside itself, so ``import hicache`` never needs vLLM,
SGLang or transformers installed.
"""
