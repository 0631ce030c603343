# The two commands a newcomer needs are `make demo` and `make test`; both create the
# virtual environment (.venv) when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test test-all test-vllm lint demo bench-tree clean

setup:
	VENV=$(VENV) bash scripts/bootstrap.sh

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q
	$(MAKE) test-vllm

# vLLM's CPU engine with hicache as its host and disk tier (tests/engines/vllm), in its own
# environment: scripts/vllm_env.sh builds .venv-vllm once and reuses it.
test-vllm:
	bash scripts/vllm_env.sh
	.venv-vllm/bin/python -m pytest -q tests/engines/vllm

test-all: setup
	$(PY) -m pytest -q -m "not gpu"

lint: setup
	$(VENV)/bin/ruff check .

demo: setup
	$(VENV)/bin/hicache demo

bench-tree: setup
	$(PY) benchmarks/bench_tree.py

clean:
	rm -rf $(VENV) .venv-vllm build dist *.egg-info .pytest_cache
