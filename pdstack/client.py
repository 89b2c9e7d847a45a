"""OpenAI-style completions against the stack, with the token ids vLLM returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import requests

MODEL = "pd-model"
REQUEST_TIMEOUT_S = 300.0

# The key a stack with an API key (compose's secret) requires on /v1, set once
# by the caller (the e2e suite's --api-key-file); None: no key.
_api_key: str | None = None


def use_api_key(key: str | None) -> None:
    global _api_key
    _api_key = key or None


def headers() -> dict[str, str]:
    """What a request to a /v1 path carries: the API key, if one is set."""
    return {"Authorization": f"Bearer {_api_key}"} if _api_key else {}


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    # Per generated position, the best candidates' log-probabilities (only
    # when asked for with ``logprobs``).
    top_logprobs: list[dict[str, float]] | None = None


class CompletionError(RuntimeError):
    pass


def complete(
    base_url: str,
    prompt: list[int] | str,
    max_tokens: int = 16,
    timeout: float = REQUEST_TIMEOUT_S,
    **extra: object,
) -> Completion:
    """Greedy completion: temperature 0, so P/D must equal colocated exactly."""
    return complete_all(base_url, prompt, max_tokens, timeout, **extra)[0]


def complete_all(
    base_url: str,
    prompt: list[int] | str | list[list[int]],
    max_tokens: int = 16,
    timeout: float = REQUEST_TIMEOUT_S,
    **extra: object,
) -> list[Completion]:
    """Every choice of one request (a batch of prompts, n > 1), by index."""
    body = greedy(prompt, max_tokens, **extra)
    response = requests.post(
        f"{base_url}/v1/completions", json=body, headers=headers(), timeout=timeout
    )
    if response.status_code != 200:
        raise CompletionError(
            f"{base_url}: HTTP {response.status_code}: {response.text[:500]}"
        )
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    missing = [c for c in choices if c.get("token_ids") is None]
    if missing or not choices:
        raise CompletionError(f"{base_url}: no token_ids in {missing or choices}")
    return [
        Completion(
            c["token_ids"],
            c["text"],
            c.get("finish_reason"),
            (c.get("logprobs") or {}).get("top_logprobs"),
        )
        for c in choices
    ]


def greedy(
    prompt: list[int] | str | list[list[int]], max_tokens: int, **extra: Any
) -> dict[str, Any]:
    """The body of a greedy completion with its token ids (``extra`` wins)."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        # Stop only at max_tokens, so every compared output has the same length.
        "ignore_eos": True,
        **extra,
    }


def trace(
    base_url: str,
    prompt: list[int],
    max_tokens: int = 16,
    timeout: float = REQUEST_TIMEOUT_S,
    **extra: object,
) -> Completion:
    """A greedy completion with the two best candidates at every position,
    keyed by token id ("token_id:N": two tokens with the same text stay apart)."""
    done = complete(
        base_url,
        prompt,
        max_tokens,
        timeout,
        logprobs=2,
        return_tokens_as_token_ids=True,
        **extra,
    )
    if done.top_logprobs is None or len(done.top_logprobs) != len(done.token_ids):
        raise CompletionError(f"{base_url}: no top logprobs per token in {done}")
    return done


def tokenize(base_url: str, text: str) -> list[int]:
    response = requests.post(
        f"{base_url}/tokenize",
        json={"model": MODEL, "prompt": text, "add_special_tokens": False},
        timeout=30,
    )
    response.raise_for_status()
    return response.json()["tokens"]


def max_model_len(base_url: str) -> int:
    """The served model's max-model-len (vLLM's model card on /v1/models)."""
    response = requests.get(f"{base_url}/v1/models", headers=headers(), timeout=30)
    response.raise_for_status()
    (card,) = [c for c in response.json()["data"] if c["id"] == MODEL]
    return int(card["max_model_len"])
