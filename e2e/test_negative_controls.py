"""Negative controls: the detectors above do catch a missing or wrong transfer.

With the plugin's KV checksum on (``kv_checksum``, on in configs/vllm), KV
corrupted as decode receives it never reaches an answer: each request fails
or is recomputed, and decode's mismatch counter says so. With it off (a
stack given by URLs, or the twin rendered without it) the same fault gives
wrong answers while every transfer metric says success. Either way KV
corrupted after the checksum verified it reaches the answers, and the
correctness check (pdstack.oracle) must catch it: metrics are not proof.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import PROFILE, Stack, decode_fault_file
from pd_mooncake.faults import CORRUPT_CHECKED_KV, CORRUPT_RECEIVED_KV
from pdstack import client, config, kv_layout, oracle
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


@pytest.fixture(scope="module")
def checksum_on(stack: Stack) -> bool:
    """Whether decode verifies every transfer (both roles must agree, or no
    transfer would succeed); the twin's configuration has it on."""
    on = {
        name: m.scrape(getattr(stack, name)).total(m.CHECKSUM_ENABLED) == 1
        for name in ("prefill", "decode")
    }
    print(f"kv_checksum: {on}")
    assert on["prefill"] == on["decode"], on
    if stack.owned:
        # The twin serves what configs/vllm says (kv_checksum: true there),
        # or PD_MOONCAKE_KV_CHECKSUM in this environment.
        rendered = config.with_env_overrides(
            config.vllm_flags("decode", PROFILE, "cpu"), role="decode"
        )
        flags = rendered["kv-transfer-config"]
        configured = flags["kv_connector_extra_config"].get("kv_checksum", False)
        assert on["decode"] == configured, (on, configured)
    return on["decode"]


@pytest.fixture
def fault_file(stack: Stack) -> Path:
    return decode_fault_file(stack)


Corrupted = tuple[
    list[list[oracle.Step]], list[list[oracle.Step] | str], m.Snapshot, m.Snapshot, int
]


@pytest.fixture
def corrupted(
    stack: Stack,
    checksum_on: bool,
    fault_file: Path,
    layout: kv_layout.KVLayout,
) -> Iterator[Callable[[str, int], Corrupted]]:
    """Four requests through the router with fault ``name`` on (on decode,
    for the rest of the test): the references, each answer's tokens (or its
    error), prefill's and decode's deltas (decode's once it counted each
    region's checksum verdicts, or 1 s with the checksum off) and the number
    of regions."""
    # The oracle's band, calibrated while the stack is still healthy.
    print(f"healthy {stack.band.describe()}")
    regions = layout.layers
    verdicts = 4 * regions if checksum_on else 0

    def run(name: str, salt: int) -> Corrupted:
        fault_file.parent.mkdir(parents=True, exist_ok=True)
        fault_file.write_text(name)
        prompts = [stack.prompt(30 + 11 * i, salt=salt + i) for i in range(4)]
        expected = [stack.reference_steps(p, MAX_TOKENS) for p in prompts]
        prefill0, decode0 = m.scrape(stack.prefill), m.scrape(stack.decode)
        got: list[list[oracle.Step] | str] = []
        for p in prompts:
            try:
                got.append(stack.answer(p, MAX_TOKENS))
            except client.CompletionError as exc:
                got.append(str(exc))
        prefill = m.settle(stack.prefill, prefill0, lambda d: d.total(m.TRANSFERS) >= 4)
        decode = m.settle(
            stack.decode,
            decode0,
            lambda d: (
                d.total(m.CHECKSUM_MATCH) + d.total(m.CHECKSUM_MISMATCH) >= verdicts
            ),
            deadline_s=20.0 if verdicts else 1.0,
        )
        print(f"prefill transfers {prefill.total(m.TRANSFERS)}")
        return expected, got, prefill, decode, regions

    try:
        yield run
    finally:
        fault_file.unlink(missing_ok=True)


def token_0(expected: list[oracle.Step], got: list[oracle.Step]) -> str:
    """How far an answer's token 0 is from the reference's: the largest
    |Δlogprob| of a candidate both report or, with none in common, how far
    the reference's token fell at least (below the answer's last candidate);
    the chosen tokens' own |Δlogprob|, and the reference's margin where the
    token differs."""
    want, have = expected[0], got[0]
    if set(want.candidates()) & set(have.candidates()):
        said = f"|Δlogprob| {oracle.largest_move(want, have):.3f}"
    else:
        fell = want.logprob - min(have.candidates().values())
        said = f"no candidate in common: fell >= {fell:.2f}"
    said += f" (chosen {abs(have.logprob - want.logprob):.3f})"
    if have.token != want.token:
        said += f", another token (reference margin {want.margin:.3f})"
    return said


def assert_wrong_with_success_metrics(
    stack: Stack,
    expected: list[list[oracle.Step]],
    got: list[list[oracle.Step] | str],
    prefill: m.Snapshot,
) -> None:
    """Every answer fails the oracle, under the stack's calibrated band and
    under the widest band a calibration may give (oracle.CEILING, near-ties
    accepted), while every transfer metric says success."""
    answers = [g for g in got if isinstance(g, list)]
    assert len(answers) == len(got), got
    print(
        "token 0: "
        + "; ".join(token_0(e, g) for e, g in zip(expected, answers, strict=True))
        + f" ({stack.band.describe()})"
    )
    for band in (stack.band, oracle.Band(oracle.CEILING, exact=False)):
        verdicts = [
            oracle.judge(e, g, band) for e, g in zip(expected, answers, strict=True)
        ]
        print(f"exact {band.exact}: " + "; ".join(v.describe() for v in verdicts))
        assert all(not v.ok for v in verdicts), [v.describe() for v in verdicts]
    assert prefill.total(m.TRANSFERS) == len(got)
    assert prefill.total(m.FAILED_TRANSFERS) == 0


def test_checksum_keeps_corrupted_kv_out_of_every_answer(
    stack: Stack,
    checksum_on: bool,
    corrupted: Callable[[str, int], Corrupted],
    layout: kv_layout.KVLayout,
) -> None:
    """KV corrupted as decode receives it: with the checksum on, each request
    fails or is recomputed (kv_load_failure_policy), never answered wrong, and
    decode counts a mismatch in every region of each; with it off, the
    answers are wrong and every metric says success."""
    expected, got, prefill, decode, regions = corrupted(CORRUPT_RECEIVED_KV, 5100)
    mismatch = decode.by_label(m.CHECKSUM_MISMATCH, "region")
    outcomes = [
        g if isinstance(g, str) else oracle.judge(e, g, stack.band).describe()
        for e, g in zip(expected, got, strict=True)
    ]
    print(f"checksum on: {checksum_on}; answers: {outcomes}; mismatches {mismatch}")
    if not checksum_on:
        assert_wrong_with_success_metrics(stack, expected, got, prefill)
        assert not mismatch
        return
    for e, g in zip(expected, got, strict=True):
        # Failed ("fail", vLLM's default policy: HTTP 500), or recomputed
        # and then exact.
        assert isinstance(g, str) or oracle.judge(e, g, stack.band).ok, g
    # One corrupted receive per transfer (a router that retried a failed
    # request would have made more than one per request), each caught in
    # every region; prefill sent each successfully: only decode's check saw
    # the damage.
    transfers = prefill.total(m.TRANSFERS)
    assert transfers == len(got), f"{transfers} transfers for {len(got)} requests"
    assert sorted(mismatch.values()) == [transfers] * regions, mismatch
    layouts = decode.by_label(m.CHECKSUM_MISMATCH, "layout")
    assert set(layouts) == {r.layout for r in layout.regions}, layouts
    assert decode.total(m.CHECKSUM_MATCH) == 0
    assert decode.total(m.FAILED_RECVS) == transfers
    assert prefill.total(m.FAILED_TRANSFERS) == 0


def test_corruption_after_the_checksum_fails_the_correctness_check(
    stack: Stack, checksum_on: bool, corrupted: Callable[[str, int], Corrupted]
) -> None:
    """KV overwritten after the checksum verified it (or without one): the
    answers leave the reference while every metric, the checksum's included,
    says success. The correctness check is what catches it."""
    expected, got, prefill, decode, regions = corrupted(CORRUPT_CHECKED_KV, 5200)
    assert_wrong_with_success_metrics(stack, expected, got, prefill)
    assert decode.total(m.CHECKSUM_MISMATCH) == 0
    if checksum_on:
        assert decode.total(m.CHECKSUM_MATCH) == 4 * regions


def test_switch_off_restores_exact_output(
    stack: Stack, checksum_on: bool, fault_file: Path, layout: kv_layout.KVLayout
) -> None:
    """After the faults, the same stack is exact again (the switch is off),
    and with the checksum on every region of the request is verified."""
    assert not fault_file.exists()
    prompt = stack.prompt(30, salt=5100)
    expected = stack.reference_steps(prompt, MAX_TOKENS)
    before = m.scrape(stack.decode)
    got = stack.answer(prompt, MAX_TOKENS)
    verdict = stack.judge(expected, got, "after the fault")
    assert verdict.ok, verdict.describe()
    if checksum_on:
        regions = layout.layers
        delta = m.settle(
            stack.decode, before, lambda d: d.total(m.CHECKSUM_MATCH) >= regions
        )
        assert (
            sorted(delta.by_label(m.CHECKSUM_MATCH, "region").values()) == [1] * regions
        )
        assert delta.total(m.CHECKSUM_MISMATCH) == 0
