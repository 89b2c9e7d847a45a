#!/usr/bin/env bash
# Builds (once) what `make test-compat` runs another vLLM release with, and
# prints its path. Cached under $PD_COMPAT_CACHE/<name>-<hash of the pin file>:
# a changed pin file builds anew, an unchanged one is reused (pip's own cache
# keeps the wheels across rebuilds).
#   scripts/compat-venv.sh venv NAME PINS    a venv with exactly PINS (--no-deps)
#                                            and pytest (requirements/test.txt's pin)
#   scripts/compat-venv.sh source NAME PINS  PINS' wheels unpacked, nothing installed
set -euo pipefail
kind=$1 name=$2 pins=$3
cache=${PD_COMPAT_CACHE:-$HOME/.cache/pd-mooncake/venvs}
key=$(sha256sum "$pins" | cut -c1-12)
dest=$cache/$name-$key
if [[ -e $dest/.complete ]]; then
  echo "compat $name: cached at $dest" >&2
  echo "$dest"
  exit 0
fi
mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.$name-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
case $kind in
  venv)
    # Built where it stays: a venv's scripts name their own path.
    rm -rf "$dest"
    ${PYTHON:-python3} -m venv "$dest"
    "$dest/bin/python" -m pip install --quiet --upgrade pip
    "$dest/bin/python" -m pip install --quiet --no-deps -r "$pins" \
      "$(grep -E '^pytest==' requirements/test.txt)"
    "$dest/bin/python" -c "import vllm, vllm._custom_ops, mooncake.engine"
    ;;
  source)
    "${PIP:-pip}" download --quiet --no-deps -r "$pins" -d "$tmp/wheels"
    mkdir -p "$tmp/src"
    for wheel in "$tmp"/wheels/*.whl; do
      python3 -m zipfile -e "$wheel" "$tmp/src"
    done
    rm -rf "$dest"
    mv "$tmp/src" "$dest"
    ;;
  *)
    echo "usage: $0 venv|source NAME PINS" >&2
    exit 2
    ;;
esac
touch "$dest/.complete"
echo "compat $name: built in $((SECONDS - start)) s, $(du -sh "$dest" | cut -f1) at $dest" >&2
echo "$dest"
