"""Decode's own prefix cache on top of P/D: full and partial hits stay exact."""

from __future__ import annotations

from conftest import Stack
from pdstack import client
from pdstack import metrics as m

MAX_TOKENS = 12


def test_full_prefix_hit_on_decode(stack: Stack) -> None:
    prompt = stack.prompt(80, salt=4000)
    expected = client.complete(stack.reference, prompt, MAX_TOKENS).token_ids
    first = client.complete(stack.router, prompt, MAX_TOKENS).token_ids
    before = m.scrape(stack.decode)
    second = client.complete(stack.router, prompt, MAX_TOKENS).token_ids
    delta = m.settle(
        stack.decode, before, lambda d: d.total(m.PROMPT_TOKENS_BY_SOURCE) >= 80
    )
    sources = delta.by_label(m.PROMPT_TOKENS_BY_SOURCE, "source")
    print(f"second identical request: decode prompt sources {sources}")
    assert first == expected
    assert second == expected
    assert sources.get("local_cache_hit", 0) > 0


def test_partial_prefix_hit_on_decode(stack: Stack) -> None:
    shared = stack.prompt(64, salt=4100)
    client.complete(stack.router, shared + stack.prompt(20, salt=4200), MAX_TOKENS)
    prompt = shared + stack.prompt(30, salt=4300)
    expected = client.complete(stack.reference, prompt, MAX_TOKENS).token_ids
    got = client.complete(stack.router, prompt, MAX_TOKENS).token_ids
    assert got == expected
