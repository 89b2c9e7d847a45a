"""Is a P/D answer the reference's answer? Exact where the stack is exact,
and up to the first near-tie where its numerics depend on the batch.

On a GPU the kernels (and so the last bits of a logit) change with batch
composition, so a correct P/D stack can leave a colocated reference where the
reference's two best tokens are nearly tied. Wrong KV does not wait for a
near-tie: it changes the distribution itself and diverges where the reference
is confident. So the answer must equal the reference token for token up to
the first position whose top-1 over top-2 margin (in nats) is below
``epsilon``; from there on nothing is compared. With ``epsilon`` 0 (the CPU
twin, or a GPU stack with ``VLLM_BATCH_INVARIANT=1``) every token is compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The default for a GPU stack that is not batch invariant. bfloat16 keeps 8
# significant bits: a logit of magnitude 4-8 is exact to 2^-5 = 0.031 nats, and
# a batch-dependent reduction order moves it by an ulp or two. The margin is a
# difference of two such logits, so up to about 0.1 nats of it can be noise.
# Measured on the twin (24 random prompts of 8-200 tokens, 32 greedy tokens
# each): median margin 0.97 nats, 6.3% of positions under 0.1; the first one
# under 0.1 came at token 0-24 (median 8.5) in 22 prompts, not within 32 in 2.
# So a comparison up to the first near-tie still covers several tokens of most
# prompts, and corrupted KV leaves the reference at the first token or so,
# where it is confident (e2e/test_negative_controls.py asserts it at 0.1).
GPU_EPSILON = 0.1


@dataclass(frozen=True)
class Step:
    """One generated position of the reference: its token and how far its
    log-probability is above the runner-up's."""

    token: int
    margin: float


@dataclass(frozen=True)
class Verdict:
    ok: bool
    # Positions compared (all of them when no near-tie came first).
    compared: int
    # The first position the reference was nearly tied, if compared up to it.
    near_tie_at: int | None
    # The first position the answer left the reference while it was confident.
    diverged_at: int | None
    margin: float | None

    def describe(self) -> str:
        if self.diverged_at is not None:
            return (
                f"left the reference at token {self.diverged_at}, where its "
                f"margin was {self.margin:.3f} nats"
            )
        if self.near_tie_at is not None:
            return (
                f"equal for {self.compared} tokens, up to a near-tie at token "
                f"{self.near_tie_at} (margin {self.margin:.3f} nats)"
            )
        return f"equal for all {self.compared} tokens"


def judge(reference: Sequence[Step], answer: Sequence[int], epsilon: float) -> Verdict:
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    for i, step in enumerate(reference):
        if step.margin < epsilon:
            return Verdict(True, i, i, None, step.margin)
        if i >= len(answer) or answer[i] != step.token:
            return Verdict(False, i, None, i, step.margin)
    if len(answer) != len(reference):
        return Verdict(False, len(reference), None, len(reference), None)
    return Verdict(True, len(reference), None, None, None)


def steps(
    token_ids: Sequence[int], top_logprobs: Sequence[dict[str, float]]
) -> list[Step]:
    """Steps from an OpenAI completion's ``logprobs.top_logprobs`` (two per
    position at least). A position with a single candidate is not tied."""
    out = []
    for token, top in zip(token_ids, top_logprobs, strict=True):
        best = sorted(top.values(), reverse=True)
        margin = best[0] - best[1] if len(best) > 1 else float("inf")
        out.append(Step(token, margin))
    return out
