# diffstage: two commands on a fresh machine.
#   make demo   builds the tiny built-in model and generates one PNG through the engine (no cluster, no GPU)
#   make test   runs the test suite (unit, runtime integration)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: demo test venv bench crds clean

venv: $(STAMP)

# torch first, pinned exactly: pip then takes the CPU wheel on disk instead of a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m stage_runtime.demo

test: $(STAMP)
	$(PY) -m pytest -q

# The CRD is generated from stage_operator/api (never edited by hand; tests fail on drift).
crds: $(STAMP)
	$(PY) -m stage_operator.crdgen --out crds

bench: $(STAMP)
	$(PY) bench/engine_overhead.py
	$(PY) bench/step_mode.py
	$(PY) bench/executor_overhead.py
	$(PY) bench/operator_reconcile.py
	$(PY) bench/operator_restart.py
	$(PY) bench/http_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info .demo
