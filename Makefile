# numpyro_pc developer tasks.  Only Python 3.11 and GNU make are assumed.
SHELL := /bin/bash

VENV        ?= .venv
PY          ?= $(VENV)/bin/python
SPHINXBUILD ?= $(VENV)/bin/sphinx-build
BOOTSTRAP_PY := $(shell command -v python3.11 2>/dev/null || command -v python3 2>/dev/null)
EXTRAS      ?= test,docs,gp,federated
STAMP       := $(VENV)/.installed
# pytest-xdist workers: CI and the project's machines have 2 cores.
PYTEST_WORKERS ?= 2

# One OpenBLAS thread: XLA runs its own thread pool, and a threaded OpenBLAS beside it
# makes small LAPACK calls 10-100x slower on few cores (docs/install.md).  Override freely.
export OPENBLAS_NUM_THREADS ?= 1

.PHONY: help venv demo test test-all lint unit unit-slow test-durations notebooks notebooks-full docs architecture bench clean distclean

help:
	@echo "make venv       create $(VENV) and install -e .[$(EXTRAS)] (re-runs when pyproject.toml changes)"
	@echo "make demo       run the end-to-end demo (python -m numpyro_pc demo)"
	@echo "make test       the gate CI runs (~20 min on 2 cores): lint, the unit tests' gate tier, notebooks, strict docs"
	@echo "make test-all   make test, then the slow tier of the unit tests (~55 min more on 2 cores)"
	@echo "make lint       ruff check (pyflakes and pycodestyle rules, 120 columns), the import-layer contract, mypy"
	@echo "make unit       pytest on tests/ without the slow tier (tests/tiers.py)"
	@echo "make unit-slow  pytest on the slow tier only"
	@echo "make test-durations  run every test and record its seconds in tests/durations.json (commit it)"
	@echo "make notebooks  check that the committed outputs are current, then execute notebooks/*.ipynb (NUMPYRO_PC_FAST=1)"
	@echo "make notebooks-full  full-size runs written back into notebooks/ with their outputs (commit them)"
	@echo "make docs       sphinx-build -W (html in docs/_build/html)"
	@echo "make architecture  redraw docs/_static/architecture.{png,txt} from the import graph (commit them)"
	@echo "make bench      run every benchmarks/bench_*.py"
	@echo "make clean      remove build and run outputs (keeps $(VENV)); distclean also removes $(VENV)"

venv: $(STAMP)

# The stamp is newer than pyproject.toml and this Makefile once the install
# succeeded; editing either (dependencies, extras, EXTRAS) triggers a re-install.  The editable
# install puts the repository root on sys.path (see package-dir in
# pyproject.toml), so modules added later import without re-installing.
$(STAMP): pyproject.toml Makefile
	@if [ ! -x "$(VENV)/bin/python" ]; then \
	  if [ -z "$(BOOTSTRAP_PY)" ]; then echo "error: neither python3.11 nor python3 found" >&2; exit 1; fi; \
	  echo "creating $(VENV) with $(BOOTSTRAP_PY)"; \
	  "$(BOOTSTRAP_PY)" -m venv "$(VENV)"; \
	fi
	$(VENV)/bin/python -m pip install --upgrade pip
	$(VENV)/bin/python -m pip install -e ".[$(EXTRAS)]"
	@touch "$@"

demo: venv
	$(PY) -m numpyro_pc demo

test: venv
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory unit
	$(MAKE) --no-print-directory notebooks
	$(MAKE) --no-print-directory docs

lint: venv
	$(VENV)/bin/ruff check numpyro_pc tests benchmarks scripts
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy numpyro_pc
	$(PY) scripts/architecture.py --check

unit: venv
	$(PY) -m pytest -q -x -rsx -n $(PYTEST_WORKERS) --durations=15 -m "not slow" tests

unit-slow: venv
	$(PY) -m pytest -q -x -rsx -n $(PYTEST_WORKERS) --durations=15 -m slow tests

test-all: test
	$(MAKE) --no-print-directory unit-slow

test-durations: venv
	$(PY) -m pytest -q -rsx -n $(PYTEST_WORKERS) --record-durations tests/durations.json tests
	$(PY) -m pytest -q -rsx -n $(PYTEST_WORKERS) --record-durations tests/durations.json -m "not slow" tests

notebooks: venv
	$(PY) scripts/run_notebooks.py notebooks --check-committed
	NUMPYRO_PC_FAST=1 $(PY) scripts/run_notebooks.py notebooks

notebooks-full: venv
	$(PY) scripts/run_notebooks.py notebooks --full --write-back

architecture: venv
	$(PY) scripts/architecture.py

docs: venv
	$(SPHINXBUILD) -W --keep-going -b html docs docs/_build/html

bench: venv
	@set -e; found=0; \
	for f in benchmarks/bench_*.py; do \
	  [ -e "$$f" ] || continue; found=1; \
	  echo "=== $$f"; \
	  $(PY) "$$f"; \
	done; \
	if [ "$$found" = 0 ]; then echo "no benchmarks/bench_*.py scripts found"; fi

clean:
	rm -rf docs/_build docs/_generated_notebooks notebooks/_executed demo_output benchmarks/_out \
	  .pytest_cache build dist *.egg-info
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -print0 | xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV)
