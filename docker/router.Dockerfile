# Router image: vllm-router, started by pdstack.route with its flags rendered
# from configs/router.yaml (the same renderer as the CPU twin). The same image
# on GPU and CPU hosts. Build through make, which fills the wheelhouse on the
# host (run/wheelhouse/router from requirements/router.txt: no step here
# reaches a package index) and makes the Debian base where no registry can be
# reached:
#   make images
#
# VLLM_ROUTER_VERSION names the release in the image's labels;
# tests/test_docker.py checks it equals requirements/router.txt, whose pins
# this image installs.
ARG VLLM_ROUTER_VERSION=0.1.17
# Also the CPU serving image's base; scripts/debian-base.sh makes it when it
# cannot be pulled.
ARG DEBIAN_IMAGE=debian:bookworm-slim

FROM ${DEBIAN_IMAGE}
ARG VLLM_ROUTER_VERSION
ARG DEBIAN_IMAGE
ARG DEBIAN_FRONTEND=noninteractive

LABEL org.opencontainers.image.title="pd-mooncake-router" \
      org.opencontainers.image.description="vllm-router for P/D disaggregated vLLM with the Mooncake connector" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${DEBIAN_IMAGE}" \
      org.opencontainers.image.version="vllm-router${VLLM_ROUTER_VERSION}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# System packages, and why each is here:
#   python3, python3-venv  Debian bookworm's Python 3.11, in a venv (Debian's
#                          Python is externally managed)
#   tini                   PID 1: forwards signals to the router, reaps children.
#   curl                   the compose health check (`curl -fsS .../health`).
# hadolint ignore=DL3008
RUN --mount=type=cache,target=/var/cache/apt,sharing=locked \
    --mount=type=cache,target=/var/lib/apt/lists,sharing=locked \
    rm -f /etc/apt/apt.conf.d/docker-clean \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv tini curl \
    && python3 -m venv /opt/venv \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin pd
ENV PATH=/opt/venv/bin:${PATH} \
    VIRTUAL_ENV=/opt/venv

RUN --mount=type=bind,source=run/wheelhouse,target=/wheels \
    --mount=type=bind,source=requirements/router.txt,target=/src/router.txt \
    pip install --no-cache-dir --no-index --find-links /wheels/router -r /src/router.txt

COPY pdstack /opt/pd/pdstack
COPY configs /opt/pd/configs
ENV PYTHONPATH=/opt/pd \
    PD_CONFIGS=/opt/pd/configs \
    PYTHONUNBUFFERED=1

# Build-time checks: the installed release is the labelled one, and the
# rendered command parses with it.
RUN python3 -c "import importlib.metadata as m, sys; v = m.version('vllm-router'); \
sys.exit(0 if v == '${VLLM_ROUTER_VERSION}' else f'vllm-router {v} != ${VLLM_ROUTER_VERSION}')" \
    && PREFILL_URL=http://prefill:1 DECODE_URL=http://decode:2 python3 -c \
    'import os; from pdstack import route; \
from vllm_router.launch_router import parse_router_args as parse; \
parse(route.command(os.environ))'

# Non-root (the user is created with the system packages above).
USER 10001:10001

ENTRYPOINT ["tini", "--"]
CMD ["python3", "-m", "pdstack.route"]
