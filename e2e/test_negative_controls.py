"""Negative controls: the detectors above do catch a missing or wrong transfer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Stack
from pdstack import client, oracle
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


SWITCH_HELP = (
    "start decode with PD_MOONCAKE_FAULT_FILE=<path inside its container> and "
    "that directory bind-mounted from this host (docker/compose.e2e.yaml does "
    "both: run/e2e-fault), then pass --fault-file run/e2e-fault/fault "
    "(make e2e does)"
)


@pytest.fixture
def fault_file(stack: Stack) -> Path:
    if stack.fault_file is None:
        pytest.skip(f"no fault switch for decode: {SWITCH_HELP}")
    switch = m.scrape(stack.decode).labels_of(m.KV_CACHE_INFO).get("fault_switch")
    if switch != "file":
        pytest.skip(
            f"decode reports fault_switch={switch!r}, not 'file': {SWITCH_HELP}"
        )
    return stack.fault_file


@pytest.fixture
def corrupted_kv(fault_file: Path) -> Iterator[None]:
    fault_file.parent.mkdir(parents=True, exist_ok=True)
    fault_file.write_text("corrupt_received_kv")
    try:
        yield
    finally:
        fault_file.unlink(missing_ok=True)


def test_corrupted_kv_fails_the_correctness_check(
    stack: Stack, corrupted_kv: None
) -> None:
    """With decode's received KV overwritten, outputs leave the reference, while
    the transfer metrics still report success: metrics are not proof. Each
    leaves it where the reference is confident: the near-tie oracle of a GPU
    stack would catch it too."""
    prompts = [stack.prompt(30 + 11 * i, salt=5100 + i) for i in range(4)]
    expected = [stack.reference_steps(p, MAX_TOKENS) for p in prompts]
    before = m.scrape(stack.prefill)
    got = [client.complete(stack.router, p, MAX_TOKENS).token_ids for p in prompts]
    delta = m.settle(stack.prefill, before, lambda d: d.total(m.TRANSFERS) >= 4)
    epsilons = sorted({stack.epsilon, oracle.GPU_EPSILON})
    verdicts = {
        eps: [oracle.judge(e, g, eps) for e, g in zip(expected, got, strict=True)]
        for eps in epsilons
    }
    for eps, vs in verdicts.items():
        print(f"corrupted KV, epsilon {eps}: " + "; ".join(v.describe() for v in vs))
    print(f"transfers {delta.total(m.TRANSFERS)}")
    for eps, vs in verdicts.items():
        caught = [not v.ok for v in vs]
        assert all(caught), f"epsilon {eps}: {[v.describe() for v in vs]}"
    assert delta.total(m.TRANSFERS) == len(prompts)
    assert delta.total(m.FAILED_TRANSFERS) == 0


def test_switch_off_restores_exact_output(stack: Stack, fault_file: Path) -> None:
    """After the fault, the same stack is exact again (the switch is off)."""
    assert not fault_file.exists()
    prompt = stack.prompt(30, salt=5100)
    expected = stack.reference_steps(prompt, MAX_TOKENS)
    got = client.complete(stack.router, prompt, MAX_TOKENS).token_ids
    verdict = stack.judge(expected, got, "after the fault")
    assert verdict.ok, verdict.describe()
