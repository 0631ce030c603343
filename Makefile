# The two commands a newcomer needs are `make demo` and `make test`; both create the
# virtual environment (.venv) when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test test-all test-sglang lint demo bench-tree clean

setup:
	VENV=$(VENV) bash scripts/bootstrap.sh

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q
	$(MAKE) test-sglang

test-all: setup
	$(PY) -m pytest -q -m "not gpu"

# SGLang's released code in its own environment (.venv-sglang, built on first use).
test-sglang:
	bash scripts/sglang_env.sh
	.venv-sglang/bin/python -m pytest -q tests/engines/sglang

lint: setup
	$(VENV)/bin/ruff check .

demo: setup
	$(VENV)/bin/hicache demo

bench-tree: setup
	$(PY) benchmarks/bench_tree.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
