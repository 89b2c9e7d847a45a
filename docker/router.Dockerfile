# syntax=docker/dockerfile:1.7
# Router image: vllm-router, started by pdstack.route with its flags rendered
# from configs/router.yaml (the same renderer as the CPU twin). Build from the
# repository root:
#   docker build -f docker/router.Dockerfile -t pd-mooncake/router:local .
#
# These ARGs are the only place the image pins live; tests/test_docker.py
# checks VLLM_ROUTER_VERSION equals requirements/cpu.txt.
ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm
ARG VLLM_ROUTER_VERSION=0.1.17
# pdstack.config reads configs/ with PyYAML; same version as the CPU venv.
ARG PYYAML_VERSION=6.0.4
# pdstack.config reads configs/ports.env with python-dotenv (requirements/cpu.txt).
ARG PYTHON_DOTENV_VERSION=1.2.4
ARG UV_VERSION=0.9.26

# uv is bind-mounted into the install step only, never copied into the image.
FROM ghcr.io/astral-sh/uv:${UV_VERSION} AS uv

FROM ${PYTHON_IMAGE}
ARG PYTHON_IMAGE
ARG VLLM_ROUTER_VERSION
ARG PYYAML_VERSION
ARG PYTHON_DOTENV_VERSION

LABEL org.opencontainers.image.title="pd-mooncake-router" \
      org.opencontainers.image.description="vllm-router for P/D disaggregated vLLM with the Mooncake connector" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/${PYTHON_IMAGE}" \
      org.opencontainers.image.version="vllm-router${VLLM_ROUTER_VERSION}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# System packages, and why each is here:
#   tini  PID 1: forwards signals to the router, reaps children.
#   curl  the compose health check (`curl -fsS .../health`).
# hadolint ignore=DL3008
RUN --mount=type=cache,target=/var/cache/apt,sharing=locked \
    --mount=type=cache,target=/var/lib/apt/lists,sharing=locked \
    rm -f /etc/apt/apt.conf.d/docker-clean \
    && apt-get update \
    && apt-get install -y --no-install-recommends tini curl \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin pd

RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=from=uv,source=/uv,target=/usr/local/bin/uv \
    UV_LINK_MODE=copy uv pip install --system \
        "vllm-router==${VLLM_ROUTER_VERSION}" "pyyaml==${PYYAML_VERSION}" \
        "python-dotenv==${PYTHON_DOTENV_VERSION}"

COPY pdstack /opt/pd/pdstack
COPY configs /opt/pd/configs
ENV PYTHONPATH=/opt/pd \
    PD_CONFIGS=/opt/pd/configs \
    PYTHONUNBUFFERED=1

# Build-time check: the rendered command parses with this vllm-router.
RUN PREFILL_URL=http://prefill:1 DECODE_URL=http://decode:2 python3 -c \
    'import os; from pdstack import route; \
from vllm_router.launch_router import parse_router_args as parse; \
parse(route.command(os.environ))'

# Non-root (the user is created with the system packages above).
USER 10001:10001

ENTRYPOINT ["tini", "--"]
CMD ["python3", "-m", "pdstack.route"]
