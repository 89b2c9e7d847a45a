"""pdstack.oracle: log-probabilities within a calibrated band, divergence only
at a near-tie inside it, exact tokens where the stack is exact.

The traces are the shape of the twin's (a random tiny model: chosen tokens
at -2 to -4 nats, margins from hundredths to a few nats) with the noise of
issue 25's bfloat16 stack: a few hundredths of a nat per log-probability,
enough to flip the reference at token 0 where its margin was 0.188 nats.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pdstack import oracle
from pdstack.oracle import Band, CalibrationError, Step, calibrate, judge, steps

# (token, logprob, runner-up, its logprob) of a reference's 12 positions, as
# the server reports them (top logprobs keyed by token id).
TRACE = [
    (4711, -2.61, 15, -2.798),  # the near-tie issue 25 met at token 0: 0.188
    (93, -3.02, 640, -4.43),
    (2207, -2.18, 12, -3.15),
    (15, -3.77, 881, -4.19),
    (881, -2.95, 93, -5.25),
    (4711, -3.40, 302, -3.45),
    (302, -2.26, 77, -3.38),
    (77, -3.15, 2207, -3.81),
    (1290, -2.83, 4711, -5.88),
    (93, -3.61, 15, -3.90),
    (640, -2.47, 1290, -4.30),
    (12, -3.09, 302, -3.83),
]
REFERENCE = steps(
    [t for t, *_ in TRACE],
    [{f"token_id:{t}": lp, f"token_id:{r}": rlp} for t, lp, r, rlp in TRACE],
)
# The largest |Δlogprob| of a healthy bf16 answer (issue 25's stack flipped
# a 0.188-nat margin: a margin is two such moves).
BF16_NOISE = 0.07


def noisy(
    reference: list[Step], scale: float, seed: int, shift: float = 0.0
) -> list[Step]:
    """The same tokens, each candidate's log-probability moved by up to
    ``scale`` (and token 0's by ``shift`` more: wrong KV acts there first)."""
    rng = random.Random(seed)
    out = []
    for i, s in enumerate(reference):
        top = {
            t: lp + rng.uniform(-scale, scale) + (shift if i == 0 else 0.0)
            for t, lp in s.top.items()
        }
        out.append(Step(s.token, top[s.token], s.margin, top))
    return out


def flipped(answer: list[Step], at: int, token: int | None = None) -> list[Step]:
    """``answer`` taking ``token`` (default: the runner-up it reports) at
    ``at``, with its own text after it."""
    here = answer[at]
    token = (
        token
        if token is not None
        else max((t for t in here.top if t != here.token), key=here.top.__getitem__)
    )
    top = {**here.top, token: here.top.get(token, -9.0)}
    return [
        *answer[:at],
        Step(token, top[token], 0.1, top),
        *(Step(9000 + i, -3.0, 0.5) for i in range(len(answer) - at - 1)),
    ]


@pytest.fixture
def bf16_band() -> Band:
    """A band calibrated on four healthy bf16-like answers."""
    pairs = [(REFERENCE, noisy(REFERENCE, BF16_NOISE, seed)) for seed in range(4)]
    return calibrate(pairs, exact=False)


def test_calibration_is_a_multiple_of_the_noise_measured(bf16_band: Band) -> None:
    assert bf16_band.samples == 4 * len(REFERENCE)
    assert 0.8 * BF16_NOISE < bf16_band.noise <= BF16_NOISE
    assert bf16_band.nats == pytest.approx(oracle.MULTIPLE * bf16_band.noise)
    assert not bf16_band.exact
    assert "calibration tokens" in bf16_band.describe()


def test_healthy_bf16_noise_passes(bf16_band: Band) -> None:
    verdict = judge(REFERENCE, noisy(REFERENCE, BF16_NOISE, seed=99), bf16_band)
    assert verdict.ok, verdict.describe()
    assert verdict.judged == len(REFERENCE)
    # Every margin up to the band's counts: 0.188, 0.05 (and 0.29 if inside).
    assert verdict.near_ties == sum(s.margin <= bf16_band.nats for s in REFERENCE)
    assert verdict.near_ties >= 2
    assert 0 < verdict.largest <= BF16_NOISE
    assert "near-ties" in verdict.describe()


def test_a_flip_at_a_near_tie_inside_the_band_passes(bf16_band: Band) -> None:
    """Issue 25's healthy answer: the runner-up at token 0, margin 0.188.
    The fixed-epsilon oracle (0.1 nats) failed it."""
    answer = flipped(noisy(REFERENCE, BF16_NOISE, seed=5), at=0)
    verdict = judge(REFERENCE, answer, bf16_band)
    assert verdict.ok, verdict.describe()
    assert (verdict.flipped_at, verdict.judged) == (0, 0)
    assert verdict.margin == pytest.approx(0.188)
    assert "near-tie at token 0" in verdict.describe()
    # Not under a band of 0.1 nats, the fixed epsilon this oracle replaced.
    assert not judge(REFERENCE, answer, Band(0.1, exact=False)).ok


def test_a_flip_where_the_reference_is_confident_fails(bf16_band: Band) -> None:
    answer = flipped(noisy(REFERENCE, BF16_NOISE, seed=6), at=1)
    verdict = judge(REFERENCE, answer, bf16_band)
    assert not verdict.ok
    assert (verdict.failure, verdict.failed_at) == ("diverged", 1)
    assert verdict.margin == pytest.approx(1.41)
    assert "left the reference at token 1" in verdict.describe()


@pytest.mark.parametrize("shift", [-4.0, -1.0, 2.5])
def test_wrong_kv_moving_token_0_fails_without_a_flip(
    bf16_band: Band, shift: float
) -> None:
    """Negative control: wrong KV moves token 0's log-probability by nats
    while greedy may still pick the same token. Argmax alone (the oracle this
    replaced) passed it."""
    answer = noisy(REFERENCE, BF16_NOISE, seed=7, shift=shift)
    verdict = judge(REFERENCE, answer, bf16_band)
    assert not verdict.ok
    assert (verdict.failure, verdict.failed_at) == ("moved", 0)
    assert verdict.largest > abs(shift) - BF16_NOISE
    assert "token 0 moved" in verdict.describe()


@pytest.mark.parametrize("shift", [-3.0, 1.5])
def test_wrong_kv_flipping_a_near_tie_fails(bf16_band: Band, shift: float) -> None:
    """Negative control: wrong KV also flips near-ties (docs/reliability.md:
    corrupt_checked_kv left the reference at token 0 where its margin was
    0.17 nats), but moves the log-probabilities with it."""
    answer = flipped(noisy(REFERENCE, BF16_NOISE, seed=10, shift=shift), at=0)
    verdict = judge(REFERENCE, answer, bf16_band)
    assert (verdict.ok, verdict.failure, verdict.failed_at) == (False, "moved", 0)


def test_a_token_the_reference_did_not_rate_close_fails(bf16_band: Band) -> None:
    """At a near-tie, another token than the runners-up the reference rated
    within the band is not noise."""
    answer = flipped(noisy(REFERENCE, BF16_NOISE, seed=11), at=0, token=555)
    verdict = judge(REFERENCE, answer, bf16_band)
    assert (verdict.ok, verdict.failure, verdict.failed_at) == (False, "diverged", 0)


def test_a_move_later_on_the_shared_tokens_fails(bf16_band: Band) -> None:
    answer = noisy(REFERENCE, BF16_NOISE, seed=8)
    answer[6] = Step(answer[6].token, answer[6].logprob - 0.5, answer[6].margin)
    # A runner-up moved alone counts as much.
    assert not judge(REFERENCE, answer, bf16_band).ok
    answer = noisy(REFERENCE, BF16_NOISE, seed=8)
    answer[6].top[77] -= 0.5
    assert judge(REFERENCE, answer, bf16_band).failed_at == 6
    answer = noisy(REFERENCE, BF16_NOISE, seed=8)
    answer[6] = Step(answer[6].token, answer[6].logprob - 0.5, answer[6].margin)
    verdict = judge(REFERENCE, answer, bf16_band)
    assert (verdict.ok, verdict.failure, verdict.failed_at) == (False, "moved", 6)


def test_exact_band_accepts_no_flip_even_at_a_near_tie() -> None:
    float32 = noisy(REFERENCE, 2e-6, seed=1)
    band = calibrate([(REFERENCE, float32)] * 3, exact=True)
    assert band.nats == oracle.EXACT_FLOOR
    assert judge(REFERENCE, float32, band).ok
    verdict = judge(REFERENCE, flipped(float32, at=5), band)
    assert (verdict.ok, verdict.failure, verdict.failed_at) == (False, "diverged", 5)
    # ... nor a move that bf16 noise would excuse.
    assert not judge(REFERENCE, noisy(REFERENCE, 0.2, seed=2), band).ok


@pytest.mark.parametrize("length", [11, 13])
def test_an_answer_of_another_length_fails(bf16_band: Band, length: int) -> None:
    answer = noisy(REFERENCE, BF16_NOISE, seed=3)
    answer = (answer + answer)[:length]
    verdict = judge(REFERENCE, answer, bf16_band)
    judged = min(length, len(REFERENCE))
    assert (verdict.ok, verdict.failure, verdict.judged) == (False, "length", judged)


def tokens_of(answer: list[Step]) -> list[int]:
    return [s.token for s in answer]


def test_tokens_alone_equal_to_the_reference_pass_on_either_band(
    bf16_band: Band,
) -> None:
    """The fault suite's answers carry no log-probabilities: their tokens
    are judged against the reference's candidates."""
    for band in (bf16_band, Band(0.0, exact=True)):
        verdict = oracle.judge_tokens(REFERENCE, tokens_of(REFERENCE), band)
        assert verdict.ok and verdict.judged == len(REFERENCE), verdict.describe()


def test_tokens_alone_taking_a_near_tie_pass_only_on_a_band(bf16_band: Band) -> None:
    """The make e2e run on the bf16 twin that the exact comparison failed
    (5 of 64 load answers): another token where the reference's two best
    were within the band."""
    answer = tokens_of(flipped(REFERENCE, at=0))
    verdict = oracle.judge_tokens(REFERENCE, answer, bf16_band)
    assert (verdict.ok, verdict.flipped_at) == (True, 0), verdict.describe()
    exact = oracle.judge_tokens(REFERENCE, answer, Band(0.0, exact=True))
    assert (exact.ok, exact.failure) == (False, "diverged")


def test_tokens_alone_taking_an_unrated_token_at_a_near_tie_pass(
    bf16_band: Band,
) -> None:
    """The bf16 twin's load answer that swung both ways at token 0 (margin
    0.875, band 1.18): a token the reference did not rate, at a near-tie."""
    answer = tokens_of(flipped(REFERENCE, at=0, token=31337))
    assert oracle.judge_tokens(REFERENCE, answer, bf16_band).ok
    # ... which judge, given the answer's log-probabilities, does not accept.
    assert not judge(REFERENCE, flipped(REFERENCE, at=0, token=31337), bf16_band).ok


@pytest.mark.parametrize("token", [640, 31337])
def test_tokens_alone_leaving_a_confident_reference_fail(
    bf16_band: Band, token: int
) -> None:
    """Token 1: the reference's margin 1.41 nats; 640 is its runner-up,
    31337 a token it did not rate at all (what wrong KV produces)."""
    answer = tokens_of(flipped(REFERENCE, at=1, token=token))
    verdict = oracle.judge_tokens(REFERENCE, answer, bf16_band)
    assert (verdict.ok, verdict.failure, verdict.failed_at) == (False, "diverged", 1)


@pytest.mark.parametrize("length", [11, 13])
def test_tokens_alone_of_another_length_fail(bf16_band: Band, length: int) -> None:
    answer = (tokens_of(REFERENCE) * 2)[:length]
    verdict = oracle.judge_tokens(REFERENCE, answer, bf16_band)
    assert (verdict.ok, verdict.failure) == (False, "length")


def test_calibration_on_wrong_kv_is_refused() -> None:
    """Negative control: a stack whose KV is already wrong must not calibrate
    a band wide enough to let itself through."""
    pairs = [(REFERENCE, noisy(REFERENCE, 0.05, seed, shift=-3.0)) for seed in range(4)]
    with pytest.raises(CalibrationError, match="would let wrong KV through"):
        calibrate(pairs, exact=False)


def test_calibration_refuses_a_confident_flip_among_its_probes() -> None:
    pairs = [(REFERENCE, noisy(REFERENCE, BF16_NOISE, seed)) for seed in range(4)]
    pairs.append((REFERENCE, flipped(noisy(REFERENCE, 0.01, seed=9), at=2)))
    with pytest.raises(
        CalibrationError, match="probe 4: left the reference at token 2"
    ):
        calibrate(pairs, exact=False)


def test_calibration_needs_enough_tokens_and_keeps_the_floor() -> None:
    with pytest.raises(CalibrationError, match="fewer than"):
        calibrate([(REFERENCE, noisy(REFERENCE, 0.01, 0))], exact=False)
    quiet = [(REFERENCE, noisy(REFERENCE, 0.001, seed)) for seed in range(3)]
    assert calibrate(quiet, exact=False).nats == oracle.FLOOR
    assert calibrate(quiet, exact=False, floor=0.2).nats == 0.2


def test_steps_from_top_logprobs() -> None:
    top = [
        {"token_id:7": -0.1, "token_id:2": -1.6},
        {"token_id:3": -0.7, "token_id:8": -0.72},
        {"token_id:9": -0.0},
        # A chosen token not the best (sampled): its own log-probability.
        {"token_id:4": -1.5, "token_id:5": -0.9},
    ]
    got = steps([7, 3, 9, 4], top)
    assert [s.token for s in got] == [7, 3, 9, 4]
    assert [s.logprob for s in got] == [-0.1, -0.7, -0.0, -1.5]
    assert got[0].margin == pytest.approx(1.5)
    assert got[1].margin == pytest.approx(0.02)
    assert got[2].margin == float("inf")
    assert got[3].top == {4: -1.5, 5: -0.9}
    with pytest.raises(ValueError):
        steps([7, 3], top)
    with pytest.raises(ValueError, match="not among its candidates"):
        steps([8], top[:1])


# Real traces: the twin served in bfloat16 (tests/data/oracle_bf16_twin.json
# says what each is).
BF16_TWIN = json.loads(
    (Path(__file__).parent / "data/oracle_bf16_twin.json").read_text()
)


def pair(name: str) -> tuple[list[Step], list[Step]]:
    trace = BF16_TWIN[name]
    return steps(*trace["reference"]), steps(*trace["answer"])


@pytest.fixture(scope="module")
def twin_band() -> Band:
    """The band the e2e suite calibrates on the bf16 twin's probes."""
    return calibrate([pair(f"cal{i}") for i in range(8)], exact=False)


def test_the_bf16_twins_band(twin_band: Band) -> None:
    # Most probes are bit-equal to the reference; one moves a runner-up by
    # 0.39 nats (6 steps of a bf16 logit's 0.0625).
    assert twin_band.samples == 8 * 16
    assert twin_band.noise == pytest.approx(0.392, abs=0.001)
    assert twin_band.nats == pytest.approx(1.177, abs=0.003)


@pytest.mark.parametrize(("name", "at"), [("c2", 0), ("c5", 10)])
def test_the_bf16_twins_healthy_flips_pass(twin_band: Band, name: str, at: int) -> None:
    """c2 is issue 25's answer: another token at token 0, where the
    reference's margin was 0.188 nats; a fixed 0.1 failed it."""
    reference, answer = pair(name)
    verdict = judge(reference, answer, twin_band)
    assert verdict.ok, verdict.describe()
    assert verdict.flipped_at == at
    assert not judge(reference, answer, Band(0.1, exact=False)).ok
    # Its shared candidates moved by tenths of a nat: noise, not wrong KV.
    assert verdict.largest < 0.3


@pytest.mark.parametrize("name", ["corrupt0", "corrupt2"])
def test_the_bf16_twins_wrong_kv_fails_at_token_0(twin_band: Band, name: str) -> None:
    """Negative control on real wrong KV (corrupt_checked_kv): token 0 shares
    none of its 5 candidates with the reference's, even where the reference
    was nearly tied (corrupt2: margin 0.062 nats, inside any band)."""
    reference, answer = pair(name)
    assert not set(reference[0].top) & set(answer[0].top)
    for band in (twin_band, Band(oracle.CEILING, exact=False)):
        verdict = judge(reference, answer, band)
        assert (verdict.ok, verdict.failure, verdict.failed_at) == (
            False,
            "diverged",
            0,
        ), verdict.describe()
    if name == "corrupt2":
        assert "did not rate within the band" in verdict.describe()
