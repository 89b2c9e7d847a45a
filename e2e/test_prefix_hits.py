"""Decode's own prefix cache on top of P/D: full and partial hits stay exact.

vLLM disables prefix caching for MLA models on CPU ("MLA is enabled on a
non-GPU platform; forcing chunked prefill and prefix caching to be
disabled"), so on the CPU twin these requests load every prompt token from
prefill again; the outputs must still equal the reference. Where decode
reports prefix caching enabled (GPU hosts), a local hit is also required.
"""

from __future__ import annotations

from conftest import Stack
from pdstack import client
from pdstack import metrics as m

MAX_TOKENS = 12


def test_full_prefix_hit_on_decode(stack: Stack) -> None:
    prompt = stack.prompt(80, salt=4000)
    expected = stack.reference_steps(prompt, MAX_TOKENS)
    first = stack.answer(prompt, MAX_TOKENS)
    before = m.scrape(stack.decode)
    second = stack.answer(prompt, MAX_TOKENS)
    delta = m.settle(
        stack.decode, before, lambda d: d.total(m.PROMPT_TOKENS_BY_SOURCE) >= 80
    )
    sources = delta.by_label(m.PROMPT_TOKENS_BY_SOURCE, "source")
    print(f"second identical request: decode prompt sources {sources}")
    for label, answer in (("first", first), ("second", second)):
        verdict = stack.judge(expected, answer, f"full prefix hit, {label}")
        assert verdict.ok, f"{label}: {verdict.describe()}"
    assert sum(sources.values()) == len(prompt)
    info = m.scrape(stack.decode).labels_of(m.CACHE_CONFIG_INFO)
    if info.get("enable_prefix_caching") == "True":
        assert sources.get("local_cache_hit", 0) > 0
    else:
        assert sources.get("external_kv_transfer", 0) == len(prompt)


def test_partial_prefix_hit_on_decode(stack: Stack) -> None:
    shared = stack.prompt(64, salt=4100)
    client.complete(stack.router, shared + stack.prompt(20, salt=4200), MAX_TOKENS)
    prompt = shared + stack.prompt(30, salt=4300)
    expected = stack.reference_steps(prompt, MAX_TOKENS)
    got = stack.answer(prompt, MAX_TOKENS)
    verdict = stack.judge(expected, got, "partial prefix hit")
    assert verdict.ok, verdict.describe()


def test_prefix_caching_state_is_known(stack: Stack) -> None:
    """The conditional above reads real server state, not a guess."""
    info = m.scrape(stack.decode).labels_of(m.CACHE_CONFIG_INFO)
    assert info, "decode exports no vllm:cache_config_info"
    assert info["enable_prefix_caching"] in ("True", "False")
