"""What a stack given by URLs is, read before anything is measured, and the
bad inputs caught there, each as one line naming the fix (BenchInputError):
a URL that does not answer, a key the stack refuses, prompts longer than
the stack's max-model-len. The figures the goodput sweep is sized by come
from the stack itself: /v1/models (served name, max_model_len) and
prefill's ``vllm:cache_config_info`` (KV blocks, block size).
"""

from __future__ import annotations

from dataclasses import dataclass

import requests

from pdstack import client
from pdstack import metrics as m

TIMEOUT_S = 10.0


class BenchInputError(ValueError):
    pass


@dataclass(frozen=True)
class StackInfo:
    model: str
    max_model_len: int
    # Prefill's KV cache in tokens (blocks x block size); None if not reported.
    kv_tokens: int | None


def _get(name: str, url: str, path: str) -> requests.Response:
    try:
        response = requests.get(
            f"{url}{path}", headers=client.headers(), timeout=TIMEOUT_S
        )
    except requests.RequestException as exc:
        raise BenchInputError(
            f"cannot reach the {name} at {url} ({type(exc).__name__}): is the stack "
            f"up? check BENCH_{name.upper()}_URL"
        ) from None
    if response.status_code in (401, 403):
        raise BenchInputError(
            f"{url}{path} answered {response.status_code}: the stack wants an API key; "
            "give BENCH_API_KEY_FILE=<a file holding the key> (the one in it is "
            "refused, if one was given)"
        )
    if not response.ok:
        raise BenchInputError(
            f"{url}{path} answered {response.status_code}: {response.text[:120]}; "
            f"is BENCH_{name.upper()}_URL this stack's {name}?"
        )
    return response


def inspect(urls: dict[str, str]) -> StackInfo:
    """Every URL answers /v1/models (with the key, if any); the served model
    and its max_model_len from the router's, the KV size from prefill."""
    models = {}
    for name, url in urls.items():
        models[name] = _get(name, url, "/v1/models").json().get("data") or []
    served = models["router"] or models["prefill"]
    if not served:
        raise BenchInputError(f"{urls['router']}/v1/models lists no model")
    first = served[0]
    max_len = int(first.get("max_model_len") or 0)
    if not max_len:  # the router may not pass it on; prefill's says
        max_len = int((models["prefill"] or [{}])[0].get("max_model_len") or 0)
    try:
        info = m.scrape(urls["prefill"]).labels_of(m.CACHE_CONFIG_INFO)
    except requests.RequestException:  # no KV size: the defaults size the sweep
        info = {}
    blocks, block = info.get("num_gpu_blocks", ""), info.get("block_size", "")
    kv = int(blocks) * int(block) if blocks.isdigit() and block.isdigit() else None
    return StackInfo(str(first["id"]), max_len, kv)


def inspect_server(role: str, url: str) -> None:
    """One more server of ``role`` (several behind the router) answers
    /v1/models, with the key if one is given."""
    _get(role, url, "/v1/models")


def check_lengths(info: StackInfo, input_len: int, output_len: int) -> None:
    if info.max_model_len and input_len + output_len > info.max_model_len:
        raise BenchInputError(
            f"prompts of {input_len} tokens + {output_len} output tokens exceed the "
            f"stack's max-model-len {info.max_model_len}: lower "
            "BENCH_GOODPUT_INPUT_LEN / BENCH_GOODPUT_OUTPUT_LEN"
        )
