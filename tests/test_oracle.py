"""pdstack.oracle: equal up to the reference's first near-tie, exact at 0."""

from __future__ import annotations

from typing import Any

import pytest

from pdstack.oracle import GPU_EPSILON, Step, judge, steps

# A reference of five tokens, nearly tied (0.02 nats) at position 3.
REFERENCE = [Step(7, 1.2), Step(3, 0.8), Step(9, 2.5), Step(4, 0.02), Step(5, 1.0)]


@pytest.mark.parametrize(
    ("answer", "eps", "ok", "verdict_is"),
    [
        # The equal answer passes at any epsilon.
        ([7, 3, 9, 4, 5], 0.0, True, {}),
        ([7, 3, 9, 4, 5], 0.05, True, {}),
        ([7, 3, 9, 4, 5], GPU_EPSILON, True, {}),
        # The runner-up at position 3, then anything: numerics, not KV.
        ([7, 3, 9, 8, 1], 0.05, True, {"near_tie_at": 3, "compared": 3}),
        # A confident divergence fails.
        ([7, 6, 9, 4, 5], 0.05, False, {"diverged_at": 1, "margin": 0.8}),
        # A divergence after the near-tie is not compared; exact (epsilon 0),
        # the same answer fails where it leaves the reference.
        ([7, 3, 9, 4, 6], 0.05, True, {}),
        ([7, 3, 9, 4, 6], 0.0, False, {"diverged_at": 4}),
        # Epsilon 0 compares every token, even a near-tie.
        ([7, 3, 9, 8, 5], 0.0, False, {"diverged_at": 3}),
        # A short or long answer fails.
        ([7, 3, 9], 0.0, False, {}),
        ([7, 3, 9, 4, 5, 5], 0.0, False, {}),
    ],
)
def test_judge(answer: list[int], eps: float, ok: bool, verdict_is: dict[str, Any]):
    verdict = judge(REFERENCE, answer, eps)
    assert verdict.ok is ok, verdict.describe()
    assert {name: getattr(verdict, name) for name in verdict_is} == verdict_is


def test_a_verdict_says_where() -> None:
    assert "near-tie at token 3" in judge(REFERENCE, [7, 3, 9, 8, 1], 0.05).describe()
    assert "token 1" in judge(REFERENCE, [7, 6, 9, 4, 5], 0.05).describe()


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
