# syntax=docker/dockerfile:1.7
# Prefill and decode image: the upstream vLLM image plus the Mooncake transfer
# engine, the RDMA user-space libraries and our plugin. vLLM and torch are the
# base image's and are never re-resolved. Build from the repository root:
#   docker build -f docker/serving.Dockerfile -t pd-mooncake/serving:local .
#
# These ARGs are the only place the image pins live; tests/test_docker.py
# checks they equal requirements/cpu.txt (the CPU twin's pins).
ARG VLLM_VERSION=v0.32.0
ARG MOONCAKE_VERSION=0.3.13.post1
ARG UV_VERSION=0.9.26

# uv is bind-mounted into the install steps only, never copied into the image.
FROM ghcr.io/astral-sh/uv:${UV_VERSION} AS uv

FROM vllm/vllm-openai:${VLLM_VERSION}
ARG VLLM_VERSION
ARG MOONCAKE_VERSION

LABEL org.opencontainers.image.title="pd-mooncake-serving" \
      org.opencontainers.image.description="vLLM prefill/decode server with the PDMooncakeConnector plugin (P/D disaggregation over Mooncake)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/vllm/vllm-openai:${VLLM_VERSION}" \
      org.opencontainers.image.version="${VLLM_VERSION}-mooncake${MOONCAKE_VERSION}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
USER 0:0

# System packages, and why each is here:
#   ibverbs-providers  libmlx5.so.1 and the libibverbs provider plugins. Needed
#                      even for TCP: mooncake's engine.so has a hard DT_NEEDED on
#                      libmlx5.so.1, so `import mooncake.engine` fails without it;
#                      with RDMA, libibverbs finds no device without the plugins.
#   libibverbs1        libibverbs.so.1, DT_NEEDED by engine.so (any protocol).
#   librdmacm1         RDMA connection manager, used by the rdma-core providers to
#                      resolve RoCE/iWARP addresses (the `rdma` compose profile).
#   libnuma1           libnuma.so.1, DT_NEEDED by engine.so: NUMA-aware buffers.
#   tini               PID 1: forwards signals, reaps vLLM's worker processes.
#   curl               the compose health checks (`curl -fsS .../health`); it
#                      also brings libcurl4, DT_NEEDED by engine.so.
# Versions come from the base image's distribution (rdma-core packages must
# match each other, which one apt transaction guarantees).
# hadolint ignore=DL3008
RUN --mount=type=cache,target=/var/cache/apt,sharing=locked \
    --mount=type=cache,target=/var/lib/apt/lists,sharing=locked \
    rm -f /etc/apt/apt.conf.d/docker-clean \
    && apt-get update \
    && apt-get install -y --no-install-recommends \
        ibverbs-providers libibverbs1 librdmacm1 libnuma1 tini curl

# Mooncake: the wheel built for the image's CUDA major. Everything already in
# the image is frozen as a constraint, so this step can add packages but never
# change vLLM, torch or anything else the base image ships.
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=from=uv,source=/uv,target=/usr/local/bin/uv \
    cuda="$(python3 -c 'import torch; print(torch.version.cuda)')" \
    && case "${cuda%%.*}" in \
        12) wheel=mooncake-transfer-engine ;; \
        13) wheel=mooncake-transfer-engine-cuda13 ;; \
        *) echo "serving.Dockerfile: no Mooncake wheel for CUDA '${cuda}'" \
                "(torch.version.cuda); known majors: 12, 13" >&2; exit 1 ;; \
    esac \
    && uv pip list --system --format freeze > /tmp/base-constraints.txt \
    && UV_LINK_MODE=copy uv pip install --system \
        --constraint /tmp/base-constraints.txt "${wheel}==${MOONCAKE_VERSION}" \
    && rm /tmp/base-constraints.txt

# Our plugin, without dependencies (it declares none; vLLM comes from the base).
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=from=uv,source=/uv,target=/usr/local/bin/uv \
    --mount=type=bind,source=plugin,target=/src/plugin,rw \
    UV_LINK_MODE=copy uv pip install --system --no-deps /src/plugin

# pdstack renders the vLLM command line from configs/ (it needs PyYAML,
# requests and python-dotenv, all in the vLLM image).
COPY pdstack /opt/pd/pdstack
COPY configs /opt/pd/configs
COPY --chmod=0755 docker/serving-entrypoint.sh /usr/local/bin/serving-entrypoint
ENV PYTHONPATH=/opt/pd \
    PD_CONFIGS=/opt/pd/configs \
    HF_HOME=/cache/huggingface \
    PD_MODEL_CACHE=/cache/pd-models \
    VLLM_CACHE_ROOT=/cache/vllm

# Build-time checks. No GPU driver here: if libcuda.so.1 is not resolvable,
# Mooncake (which links it) is checked against the CUDA stub instead.
RUN python3 -c "import vllm, sys; v = vllm.__version__.split('+')[0]; \
sys.exit(0 if v == '${VLLM_VERSION#v}' else f'vLLM {v} != ${VLLM_VERSION}')" \
    && if ! ldconfig -p | grep -q 'libcuda\.so\.1 '; then \
        stub="$(mktemp -d)" \
        && ln -s /usr/local/cuda/lib64/stubs/libcuda.so "${stub}/libcuda.so.1" \
        && export LD_LIBRARY_PATH="${stub}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"; \
    fi \
    && python3 -c 'import mooncake.engine' \
    && python3 -c 'import pd_mooncake; pd_mooncake.register(); \
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F; \
assert "PDMooncakeConnector" in F._registry, "plugin did not register its connector"' \
    && python3 -m pdstack.serve --role prefill --target gpu --profile kimi-k2.5 --print

# Non-root. /cache is a named volume in compose: a fresh volume takes this
# directory's ownership, so the models and compile caches are writable.
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin pd \
    && mkdir -p /cache \
    && chown pd:pd /cache
USER 10001:10001
WORKDIR /home/pd

# serving-entrypoint turns file secrets into the variables vLLM reads.
ENTRYPOINT ["tini", "--", "serving-entrypoint"]
CMD ["python3", "-m", "pdstack.serve"]
