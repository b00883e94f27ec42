# One-word entry points. `make demo` and `make test` create .venv when it is missing.
# TORCH pins the torch build installed into .venv: this machine serves torch 2.14.1 from
# its local wheel store (the build TorchRL 0.14's compiled extension loads with).
# Elsewhere, override it: `make test TORCH="torch>=2.5"`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.14.1
PY := $(VENV)/bin/python

.PHONY: demo test lint bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)" -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/quickstart.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_replay.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
