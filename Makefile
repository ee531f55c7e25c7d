# Two commands do all the set-up: `make run` and `make test`. Both create and
# use a virtual environment in .venv (override with VENV=...).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
# make run installs what the daemon needs; make test adds the test tools and
# Spark (pyspark, pyarrow): a node needs neither.
STAMP_RUN := $(VENV)/.installed-run
STAMP_TEST := $(VENV)/.installed-test

.PHONY: run single test bench clean compiled

## compiled: the hot path compiled with mypyc (mypy's compiler; needs a C
# compiler), into qserver/_compiled/; again whenever one of its sources
# changed; without a compiler qserver runs as pure Python (qserver/compiled.py)
compiled: $(STAMP_RUN)
	$(PY) -m qserver.hotbuild ensure

$(STAMP_RUN): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e . mypy
	touch $(STAMP_RUN)

$(STAMP_TEST): $(STAMP_RUN)
	$(PIP) -e '.[test,spark]'
	touch $(STAMP_TEST)

## run: the local three-node cluster (config/node1.xml to node3.xml); Ctrl-C stops all three
run: compiled
	$(VENV)/bin/qserver local-cluster

## single: one node on 127.0.0.1:1111 (no config file needed; CONFIG=file for another)
single: compiled
	$(VENV)/bin/qserver run $(if $(CONFIG),--config $(CONFIG))

## test: lint (ruff), types (mypy), then the whole test suite; settings in pyproject.toml
# compileall first: the suite starts hundreds of Python processes (nodes, the
# CLI, Spark's workers), and where PYTHONDONTWRITEBYTECODE is set none of
# them would find our modules compiled (some 0.1 s of CPU each).
test: $(STAMP_TEST) compiled
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m compileall -q -j 0 qserver spark_integration tests bench
	$(PY) -m pytest

## bench: throughput and latency of one node against the no-op floor
bench: $(STAMP_TEST) compiled
	$(PY) bench/run_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info qserver/_compiled
