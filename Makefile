# One-word entry points. `make demo` and `make test` create .venv when it is missing.
# TORCH pins the torch build installed into .venv: this machine serves torch 2.14.1 from
# its local wheel store (the build TorchRL 0.14's compiled extension loads with).
# Elsewhere, override it: `make test TORCH="torch>=2.5"`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.14.1
PY := $(VENV)/bin/python
# The tests cover every integration, so the test venv gets every extra.
EXTRAS ?= dev,examples,sb3,ray,bench,fast

BENCHES := bench_replay bench_episodes bench_priority bench_checkpoint bench_ragged bench_prefetch

.PHONY: demo test lint bench bench-quick bench-detail bench-cuda clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)" -e ".[$(EXTRAS)]"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/quickstart.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

# The suite's one table (W1-W5, scaling, memory) with PASS/FAIL against the raw floor and the
# peers (cpprb, SB3, TorchRL: the bench extra); JSON in benchmarks/results/, plot in
# benchmarks/scaling.png. --quick runs in under two minutes. Current numbers: docs/performance.md.
bench: $(VENV)/.installed
	$(PY) benchmarks/suite.py

bench-quick: $(VENV)/.installed
	$(PY) benchmarks/suite.py --quick

# The per-feature benchmarks (prioritized replay, episodes, checkpoints, the ring), beside raw
# TorchRL.
bench-detail: $(VENV)/.installed
	for b in $(BENCHES); do $(PY) benchmarks/$$b.py || exit 1; done

# The CUDA benchmark (GPU storage, CPU memmap -> GPU, inserts): needs a CUDA device.
bench-cuda: $(VENV)/.installed
	$(PY) benchmarks/bench_cuda.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
