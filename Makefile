# Two commands for a fresh machine: `make demo` and `make test`. Everything else is detail.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
TOOLS_VENV ?= .venv-tools

.PHONY: demo test services e2e crd bench tools clean

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
	touch $(VENV)/.run $@

demo: $(VENV)/.run
	$(VENV)/bin/trainingrun validate examples/tiny.yaml
	rm -rf runs/tiny
	$(VENV)/bin/trainingrun run examples/tiny.yaml --out runs/tiny

# A fresh machine: the venv, the system services (.ci/services: apt-get install redis-server prometheus when root or
# passwordless sudo, else an error naming the packages) and checkov's own venv; then the whole suite.
test: $(VENV)/.dev services tools
	$(PY) -m pytest -q tests

services:
	.ci/services

# checkov lives in its own environment: resolved together with the dev extras pip backtracks for many minutes.
$(TOOLS_VENV)/.ok:
	test -x $(TOOLS_VENV)/bin/python || $(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install -q checkov
	touch $@

tools: $(TOOLS_VENV)/.ok

e2e: $(VENV)/.dev
	TRAININGRUN_E2E=1 $(PY) -m pytest -q tests/e2e

crd: $(VENV)/.run
	$(VENV)/bin/trainingrun crd > crds/trainingrun.yaml

bench: $(VENV)/.dev
	for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) $(TOOLS_VENV) runs .pytest_cache .hypothesis
