"""Negative controls: the detectors above do catch a missing or wrong transfer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from conftest import FAULT_FILE, Stack
from pdstack import client
from pdstack import metrics as m

MAX_TOKENS = 16


def test_request_without_transfer_does_not_count_as_external(stack: Stack) -> None:
    """Straight to decode, no transfer parameters: nothing may look loaded."""
    prompt = stack.prompt(45, salt=5000)
    before = m.scrape(stack.decode)
    client.complete(stack.decode, prompt, MAX_TOKENS)
    delta = m.settle(
        stack.decode, before, lambda d: d.total(m.PROMPT_TOKENS_BY_SOURCE) >= 45
    )
    sources = delta.by_label(m.PROMPT_TOKENS_BY_SOURCE, "source")
    print(f"direct to decode: sources {sources}")
    assert delta.total(m.EXTERNAL_HITS) == 0
    assert sources.get("external_kv_transfer", 0) == 0
    assert sources.get("local_compute", 0) == 45


@pytest.fixture
def corrupted_kv(stack: Stack) -> Iterator[None]:
    if not stack.owned:
        pytest.skip("the fault switch exists only on a stack this suite started")
    FAULT_FILE.write_text("corrupt_received_kv")
    try:
        yield
    finally:
        FAULT_FILE.unlink(missing_ok=True)


def test_corrupted_kv_fails_the_correctness_check(
    stack: Stack, corrupted_kv: None
) -> None:
    """With decode's received KV overwritten, outputs leave the reference, while
    the transfer metrics still report success: metrics are not proof."""
    prompts = [stack.prompt(30 + 11 * i, salt=5100 + i) for i in range(4)]
    expected = [
        client.complete(stack.reference, p, MAX_TOKENS).token_ids for p in prompts
    ]
    before = m.scrape(stack.prefill)
    got = [client.complete(stack.router, p, MAX_TOKENS).token_ids for p in prompts]
    delta = m.settle(stack.prefill, before, lambda d: d.total(m.TRANSFERS) >= 4)
    wrong = sum(g != e for g, e in zip(got, expected, strict=True))
    print(
        f"corrupted KV: {wrong}/4 outputs differ; transfers {delta.total(m.TRANSFERS)}"
    )
    assert wrong == len(prompts)
    assert delta.total(m.TRANSFERS) == len(prompts)
    assert delta.total(m.FAILED_TRANSFERS) == 0


def test_switch_off_restores_exact_output(stack: Stack) -> None:
    """After the fault, the same stack is exact again (the switch is off)."""
    assert not FAULT_FILE.exists()
    prompt = stack.prompt(30, salt=5100)
    expected = client.complete(stack.reference, prompt, MAX_TOKENS).token_ids
    assert client.complete(stack.router, prompt, MAX_TOKENS).token_ids == expected
