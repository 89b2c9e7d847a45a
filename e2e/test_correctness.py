"""Greedy P/D output equals a colocated reference, token for token."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import Stack
from pdstack import client, tiny_model

BLOCK = 16
# Shorter than a block, exactly k blocks, k blocks + 1, and a prompt over
# vLLM's default per-step token budget (2048). On GPU hosts the long one is
# prefilled in several chunks; on CPU, vLLM disables chunked prefill for MLA
# models, so it is one step, and runs only because configs/targets/cpu.yaml
# raises the budget (without it the request never starts).
LENGTHS = {
    "under-one-block": 5,
    "exact-blocks": 4 * BLOCK,
    "blocks-plus-one": 4 * BLOCK + 1,
    "over-step-budget": 2100,
}
MAX_TOKENS = 16


def reference(stack: Stack, prompt: list[int]) -> list[int]:
    return client.complete(stack.reference, prompt, MAX_TOKENS).token_ids


@pytest.mark.parametrize("length", LENGTHS.values(), ids=LENGTHS.keys())
def test_pd_equals_colocated(stack: Stack, length: int) -> None:
    prompt = stack.prompt(length, salt=length)
    expected = reference(stack, prompt)
    got = client.complete(stack.router, prompt, MAX_TOKENS).token_ids
    print(f"prompt {length} tokens: P/D {got[:8]}... reference {expected[:8]}...")
    assert got == expected


def test_sixteen_distinct_prompts_at_once(stack: Stack) -> None:
    prompts = [stack.prompt(20 + 13 * i, salt=100 + i) for i in range(16)]
    expected = [reference(stack, p) for p in prompts]
    with ThreadPoolExecutor(max_workers=16) as pool:
        got = list(
            pool.map(
                lambda p: client.complete(stack.router, p, MAX_TOKENS).token_ids,
                prompts,
            )
        )
    wrong = [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
    print(f"16 concurrent prompts: {16 - len(wrong)} equal the reference")
    assert wrong == []
    # The outputs must differ between prompts, or equality proves nothing.
    assert len({tuple(e) for e in expected}) > 8


@pytest.mark.parametrize("server", ["prefill", "decode"])
def test_batch_invariance(stack: Stack, server: str) -> None:
    """A prompt alone and inside a batch gives the same greedy tokens.

    Without this, a compute bug that depends on batch shape (as vLLM's CPU
    RoPE has for plain-RoPE MLA) looks exactly like a transfer bug.
    """
    url = getattr(stack, server)
    prompt = stack.prompt(37, salt=7)
    others = [stack.prompt(29, salt=8), stack.prompt(51, salt=9)]
    alone = client.complete(url, prompt, MAX_TOKENS).token_ids
    with ThreadPoolExecutor(max_workers=3) as pool:
        batched = list(
            pool.map(
                lambda p: client.complete(url, p, MAX_TOKENS).token_ids,
                [prompt, *others],
            )
        )
    assert batched[0] == alone


def test_pd_equals_an_independent_reference(
    stack: Stack, probes: list[tiny_model.Probe]
) -> None:
    """Against Hugging Face transformers' greedy output (float32), computed at
    generation time: a reference that shares no code with vLLM."""
    chosen = sorted(probes, key=lambda p: len(p.prompt))[::8]
    for probe in chosen:
        got = client.complete(stack.router, probe.prompt, MAX_TOKENS).token_ids
        print(f"probe of {len(probe.prompt)} tokens: P/D {got[:6]}...")
        assert got == probe.greedy[:MAX_TOKENS]
