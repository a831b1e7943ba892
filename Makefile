# diffstage: on a fresh machine.
#   make demo      the whole system on an embedded local cluster: operator + the trained tiny digits stage, a grid of
#                  the ten digits through the Service and the judge's score; KEEP=1 keeps it up to try the playground
#                  page in a browser (the URL is printed) until Ctrl-C
#   make cluster   the same local cluster kept running for your kubectl (prints KUBECONFIG), until Ctrl-C
#   make test      runs the test suite (unit, runtime integration, operator integration, local cluster e2e)
#   make gpu-check on a machine with one CUDA GPU: the GPU check (< 8 min; SKIP and exit 0 without one)
#   make train-tiny  retrains the shipped tiny digits model and its judge on CPU (docs/trained-model.md)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: demo demo-engine cluster screenshots test test-stress test-alone venv bench crds images e2e-kind gpu-check clean \
	train-tiny train-tiny-check

venv: $(STAMP)

# torch first, pinned exactly: pip then takes the CPU wheel on disk instead of a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# The emulated Kubernetes API, the operator process and a pod runner (pods as local processes); no Docker. The stage
# serves the trained tiny digits model: the ten digits through its Service, the judge's score, the grid PNG.
demo: $(STAMP)
	$(PY) -m e2e.local.demo --out .demo/digits.png $(if $(KEEP),--keep)

# The playground's screenshots in docs/img, taken by its browser tests (a Chromium is needed: apt-get install chromium).
screenshots: $(STAMP)
	DIFFSTAGE_SCREENSHOTS=docs/img $(PY) -m pytest -q tests/stage_runtime/playground/test_page_images.py \
		tests/stage_runtime/playground/test_page_video.py

# The embedded local cluster for your own kubectl: writes .cluster/kubeconfig, prints what to try; Ctrl-C stops it
# and checks that nothing is left.
cluster: $(STAMP)
	$(PY) -m e2e.local.dev_cluster --workdir .cluster

# The engine alone, in this process: the ten digits with the trained tiny model, the judge's score, the grid PNG.
demo-engine: $(STAMP)
	$(PY) -m stage_runtime.demo --out .demo/digits.png

# The trained tiny digits model (docs/trained-model.md): trains the DiT, its VAE and the digit judge on CPU (~10-15 min,
# one thread, seed 0) into the shipped folder stage_runtime/models/tiny/trained, with the digest in MANIFEST.json.
train-tiny: $(STAMP)
	$(PY) -m stage_runtime train-tiny --seed 0 --threads 1

# Retrains into .train-check and compares with the shipped model: the same digest (bitwise), or judge figures within
# the stated margins (another CPU rounds differently); exit 1 if neither.
train-tiny-check: $(STAMP)
	$(PY) -m stage_runtime train-tiny .train-check --seed 0 --threads 1 --check

# Three workers on two cores, one test module at a time each (its module and session fixtures are built once, on one
# worker): the suite waits on processes, probes and resyncs about as much as it computes (two workers: 26.6 min of
# pytest from a clean clone on a quiet 2-core machine, three: 23.3; docs/testing.md#budgets). PYTEST_ARGS adds options
# (a shuffled run: PYTEST_ARGS='--random-order-bucket=module --random-order-seed=N').
TEST_WORKERS ?= 3
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The flake finder (docs/testing.md): the timing-sensitive modules N times each, shuffled within the module, without
# and with a CPU hog on one core; a table of passes per test. STRESS_ARGS narrows it (--hog on, module paths).
STRESS_RUNS ?= 5
test-stress: $(STAMP)
	$(PY) tests/stress.py --runs $(STRESS_RUNS) $(STRESS_ARGS)

# Every test module in a pytest process of its own, its tests shuffled (a module that needs another one first fails).
test-alone: $(STAMP)
	$(PY) tests/alone.py $(ALONE_ARGS)

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
	$(PY) bench/offload.py
	$(PY) bench/dlo.py
	$(PY) bench/fail_closed.py
	$(PY) bench/stall.py
	$(PY) bench/model_families.py
	$(PY) bench/model_fetch.py
	$(PY) bench/rank_start.py
	$(PY) bench/video_encode.py
	$(PY) bench/video_families.py --mixed
	$(PY) bench/video_decode.py
	$(PY) bench/checkpoint_cost.py

# Tier 6 on the one GPU a lent machine has (docs/testing.md, "The GPU check"): correctness on CUDA, the parallel paths
# with ranks sharing the device, real-size throughput; under 8 minutes, a table and .gpu-check/report.json. Without
# CUDA it says SKIP and why, and exits 0; GPU_CHECK_ARGS adds options (--cpu-dry-run runs it all on CPU at toy sizes).
gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

# Tier 5, opt-in: a kind cluster with fake GPU capacity, the images loaded, the same scenario as the local
# e2e, then the cluster deleted. Without Docker or kind it says why and exits 0.
e2e-kind: $(STAMP)
	$(PY) -m e2e.kind.run

# The runtime (CPU), runtime-cuda and operator images, where Docker runs; otherwise says why and exits 0.
images:
	bash images/build.sh

clean:
	rm -rf $(VENV) build *.egg-info .demo .cluster .train-check
