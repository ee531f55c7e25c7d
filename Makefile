# Two commands do all the set-up: `make run` and `make test`. Both create and
# use a virtual environment in .venv (override with VENV=...).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run single test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,spark]'
	touch $(STAMP)

## run: the local three-node cluster (config/node1.xml to node3.xml); Ctrl-C stops all three
run: $(STAMP)
	$(VENV)/bin/qserver local-cluster

## single: one node on 127.0.0.1:1111 (no config file needed; CONFIG=file for another)
single: $(STAMP)
	$(VENV)/bin/qserver run $(if $(CONFIG),--config $(CONFIG))

## test: lint (ruff), types (mypy), then the whole test suite; settings in pyproject.toml
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest

## bench: throughput and latency of one node against the no-op floor
bench: $(STAMP)
	$(PY) bench/run_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
