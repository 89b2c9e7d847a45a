#!/bin/sh
# Entrypoint of the serving image (after tini): turns file secrets into the
# variables vLLM reads, then execs the command.
#
# Compose hands secrets over as files under /run/secrets, never through
# `environment:`. vLLM takes its API key only from VLLM_API_KEY or --api-key,
# and a flag would be readable by any host user with `ps`; the environment of
# a process is private to its user. An empty file means no key.
# (The Hugging Face token needs no help: huggingface_hub reads the file named
# by HF_TOKEN_PATH.) The file's variable is PD_API_KEY_FILE: vLLM warns about
# every VLLM_* variable it does not know.
set -eu

if [ -n "${PD_API_KEY_FILE:-}" ]; then
    if [ ! -r "$PD_API_KEY_FILE" ]; then
        echo "serving-entrypoint: cannot read PD_API_KEY_FILE=$PD_API_KEY_FILE" \
            "(does the secret file exist and is it readable by uid $(id -u)?)" >&2
        exit 1
    fi
    key=$(cat "$PD_API_KEY_FILE")
    if [ -n "$key" ]; then
        VLLM_API_KEY=$key
        export VLLM_API_KEY
    fi
    unset key
fi

exec "$@"
