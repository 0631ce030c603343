# The two commands a newcomer needs are `make demo` and `make test`; both create the
# virtual environment (.venv) when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test test-all test-engines test-vllm test-sglang lint demo bench-tree clean

setup:
	VENV=$(VENV) bash scripts/bootstrap.sh

# ruff, the default suite, then every real-engine suite in that engine's own environment.
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q
	$(MAKE) test-engines

test-engines: test-vllm test-sglang

# vLLM's CPU engine with hicache as its host and disk tier (tests/engines/vllm), in its own
# environment: scripts/vllm_env.sh builds .venv-vllm once and reuses it.
test-vllm:
	bash scripts/vllm_env.sh
	.venv-vllm/bin/python -m pytest -q tests/engines/vllm

# SGLang's released code in its own environment (.venv-sglang, built on first use).
test-sglang:
	bash scripts/sglang_env.sh
	.venv-sglang/bin/python -m pytest -q tests/engines/sglang

test-all: setup
	$(PY) -m pytest -q -m "not gpu"

lint: setup
	$(VENV)/bin/ruff check .

demo: setup
	$(VENV)/bin/hicache demo

bench-tree: setup
	$(PY) benchmarks/bench_tree.py

clean:
	rm -rf $(VENV) .venv-vllm .venv-sglang build dist *.egg-info .pytest_cache
