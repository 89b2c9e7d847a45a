"""pdstack.oracle: equal up to the reference's first near-tie, exact at 0."""

from __future__ import annotations

import pytest

from pdstack.oracle import GPU_EPSILON, Step, judge, steps

# A reference of five tokens, nearly tied (0.02 nats) at position 3.
REFERENCE = [Step(7, 1.2), Step(3, 0.8), Step(9, 2.5), Step(4, 0.02), Step(5, 1.0)]


def test_equal_answer_passes_at_any_epsilon() -> None:
    for eps in (0.0, 0.05, GPU_EPSILON):
        verdict = judge(REFERENCE, [7, 3, 9, 4, 5], eps)
        assert verdict.ok, verdict.describe()


def test_divergence_at_a_near_tie_passes() -> None:
    # The runner-up at position 3, then anything: numerics, not KV.
    verdict = judge(REFERENCE, [7, 3, 9, 8, 1], 0.05)
    assert verdict.ok
    assert (verdict.near_tie_at, verdict.compared) == (3, 3)
    assert "near-tie at token 3" in verdict.describe()


def test_confident_divergence_fails() -> None:
    verdict = judge(REFERENCE, [7, 6, 9, 4, 5], 0.05)
    assert not verdict.ok
    assert (verdict.diverged_at, verdict.margin) == (1, 0.8)
    assert "token 1" in verdict.describe()


def test_divergence_after_the_near_tie_is_not_compared() -> None:
    assert judge(REFERENCE, [7, 3, 9, 4, 6], 0.05).ok
    # Exact (epsilon 0): the same answer fails where it leaves the reference.
    verdict = judge(REFERENCE, [7, 3, 9, 4, 6], 0.0)
    assert not verdict.ok and verdict.diverged_at == 4


def test_epsilon_zero_compares_every_token_even_a_near_tie() -> None:
    verdict = judge(REFERENCE, [7, 3, 9, 8, 5], 0.0)
    assert not verdict.ok and verdict.diverged_at == 3


def test_a_short_or_long_answer_fails() -> None:
    assert not judge(REFERENCE, [7, 3, 9], 0.0).ok
    assert not judge(REFERENCE, [7, 3, 9, 4, 5, 5], 0.0).ok


def test_negative_epsilon_is_an_error() -> None:
    with pytest.raises(ValueError, match="epsilon"):
        judge(REFERENCE, [7], -0.1)


def test_steps_from_top_logprobs() -> None:
    top = [
        {"token_id:7": -0.1, "token_id:2": -1.6},
        {"token_id:3": -0.7, "token_id:8": -0.72},
        {"token_id:9": -0.0},
    ]
    got = steps([7, 3, 9], top)
    assert [s.token for s in got] == [7, 3, 9]
    assert got[0].margin == pytest.approx(1.5)
    assert got[1].margin == pytest.approx(0.02)
    assert got[2].margin == float("inf")
    with pytest.raises(ValueError):
        steps([7, 3], top)
