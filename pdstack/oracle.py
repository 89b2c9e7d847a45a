"""Is a P/D answer the reference's answer? Judged on log-probabilities, within
a noise band measured on the stack under test.

A P/D answer does not compute what a colocated reference computes: decode
computes the last prompt token from cached KV through its decode-path kernel,
the reference inside a whole prefill, and on a GPU the kernels also change
with the batch. In float32 the difference is invisible (0.002 nats at most
on the twin); in bfloat16 it moves log-probabilities by up to 0.4 nats (the
twin: mostly 0, p99 0.19), enough to flip the reference's choice where its
two best tokens are that close, even at token 0 (issue 25: a healthy bf16
stack left the reference at token 0 where its margin was 0.188 nats, over
the fixed 0.1 this oracle once assumed). Wrong KV moves them by nats: token
0's candidates no longer overlap the reference's.

So the band is measured, not assumed (``calibrate``): P/D answers against
their references on probe prompts, the largest |Δlogprob| of a candidate
token both report (the chosen one, the runners-up they share) up to their
first difference, times ``MULTIPLE``, at least a floor. Then an answer
(``judge``) must keep, at every judged position, those log-probabilities
within the band of the reference's, and may take another token only where
the reference rated it within the band of its own choice (a near-tie), its
log-probabilities still within the band (wrong KV can flip a near-tie too,
but moves everything by nats): from there on the two continue from
different text and nothing more is compared. Where the stack is exact
(the float32 twin; a GPU stack whose preflight says batch invariant),
``Band.exact`` compares every token and accepts no divergence at all.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Twice the largest |Δlogprob| seen bounds a gap between two candidates
# (each moved by up to it), and 1.5 on top covers noise a calibration of a
# couple of hundred tokens did not meet. Measured on the twin served in
# bfloat16 (756 shared positions, 5 candidates each): most positions move by
# 0 (bit-equal), p99 0.19 nats, the largest 0.39, and its healthy near-tie
# flip (issue 25's, at token 0) had a gap of 0.188 nats and moved its shared
# candidates by up to 0.26.
MULTIPLE = 3.0
# The least band of a stack that is not batch invariant. bfloat16 keeps 8
# significant bits: a logit of magnitude 8-16 is exact to 2^-4 = 0.0625 nats
# (the twin's bf16 log-probabilities move in such steps), so a calibration
# that saw less than that saw too few tokens.
FLOOR = 0.1
# The least band of an exact stack: there only the log-probabilities are
# within a band (tokens are compared everywhere). The float32 twin moves them
# by up to 0.002 nats (its 2100-token prompt, token 0; 0.0003 on short ones);
# 0.05 is 25 times that and a tenth of the least wrong KV moved a chosen
# token's log-probability (0.5 nats).
EXACT_FLOOR = 0.05
# A calibrated band above this is refused: it would reach what wrong KV does.
# With corrupt_checked_kv on decode (12 answers, 6 on the float32 twin, 6 on
# the bfloat16 one) token 0 shared none of its 5 candidates with the
# reference's: the reference's token fell below the answer's fifth, a move
# of 1.85 nats at least (2.84 at most). The bf16 twin's band is 1.18.
CEILING = 1.5
# Fewer judged tokens than this measure nothing.
MIN_SAMPLES = 32


class CalibrationError(RuntimeError):
    pass


@dataclass(frozen=True)
class Step:
    """One generated position: the token, its log-probability, how far that
    is above the runner-up's (the margin, in nats), and every candidate the
    server reported with its log-probability (the chosen token included)."""

    token: int
    logprob: float
    margin: float
    top: Mapping[int, float] = field(default_factory=dict, compare=False)

    def candidates(self) -> dict[int, float]:
        return {**self.top, self.token: self.logprob}


def largest_move(want: Step, got: Step) -> float:
    """The largest |Δlogprob| of a token both positions report: the chosen
    token where they agree, and the runners-up they share."""
    theirs = got.candidates()
    return max(
        (abs(theirs[t] - lp) for t, lp in want.candidates().items() if t in theirs),
        default=0.0,
    )


@dataclass(frozen=True)
class Band:
    """How far a healthy answer may move from the reference, in nats."""

    nats: float
    # Every token must equal the reference's: no divergence is accepted.
    exact: bool
    # What it was measured from: the largest |Δlogprob| over ``samples``
    # shared tokens (0 and 0 for a band given, not measured).
    noise: float = 0.0
    samples: int = 0

    def describe(self) -> str:
        kind = "exact tokens, log-probabilities within" if self.exact else "band"
        if not self.samples:
            return f"{kind} {self.nats:.3g} nats (given)"
        return (
            f"{kind} {self.nats:.3g} nats (largest |Δlogprob| {self.noise:.3g} "
            f"over {self.samples} calibration tokens x {MULTIPLE:g}, or the floor)"
        )


@dataclass(frozen=True)
class Verdict:
    ok: bool
    # Positions whose tokens and log-probabilities were compared.
    judged: int
    # Judged positions where the reference's margin lay inside the band.
    near_ties: int
    # The largest |Δlogprob| over the judged positions, and where.
    largest: float
    largest_at: int | None
    band: Band
    # The near-tie where the answer took another token (accepted).
    flipped_at: int | None = None
    # Where and why the answer failed: "diverged" (another token where the
    # reference was confident), "moved" (|Δlogprob| over the band), "length".
    failed_at: int | None = None
    failure: str | None = None
    # The reference's margin where the answer took another token.
    margin: float | None = None

    def describe(self) -> str:
        band = f"band {self.band.nats:.3g} nats"
        if self.failure == "diverged":
            said = (
                f"left the reference at token {self.failed_at}, where its margin "
                f"was {self.margin:.3f} nats ({band}{', exact' * self.band.exact})"
            )
            if not self.band.exact and (self.margin or 0.0) <= self.band.nats:
                said += ", for a token it did not rate within the band"
            return said
        if self.failure == "moved":
            return (
                f"log-probability of token {self.failed_at} moved {self.largest:.3f} "
                f"nats from the reference's, over the {band}"
            )
        if self.failure == "length":
            return f"equal for {self.judged} tokens, then the answer's length differs"
        said = (
            f"equal for {self.judged} tokens, largest |Δlogprob| "
            f"{self.largest:.3g} nats ({band}, {self.near_ties} near-ties)"
        )
        if self.flipped_at is not None:
            said += (
                f", then another token at the near-tie at token {self.flipped_at} "
                f"(margin {self.margin:.3f} nats)"
            )
        return said


def judge(reference: Sequence[Step], answer: Sequence[Step], band: Band) -> Verdict:
    """``answer`` against ``reference``, position by position."""
    largest, largest_at, near_ties = 0.0, None, 0

    def verdict(
        ok: bool,
        judged: int,
        flipped_at: int | None = None,
        failed_at: int | None = None,
        failure: str | None = None,
        margin: float | None = None,
    ) -> Verdict:
        return Verdict(
            ok,
            judged,
            near_ties,
            largest,
            largest_at,
            band,
            flipped_at,
            failed_at,
            failure,
            margin,
        )

    for i, (want, got) in enumerate(zip(reference, answer, strict=False)):
        delta = largest_move(want, got)
        if delta > largest:
            largest, largest_at = delta, i
        if got.token != want.token:
            # Another token is noise only if the reference rated it within
            # the band of its own choice (a near-tie), and every token both
            # report kept its log-probability: wrong KV moves them all.
            theirs = want.candidates().get(got.token, -math.inf)
            if band.exact or want.logprob - theirs > band.nats:
                return verdict(
                    False, i, failed_at=i, failure="diverged", margin=want.margin
                )
            if delta > band.nats:
                return verdict(False, i, failed_at=i, failure="moved")
            return verdict(True, i, flipped_at=i, margin=want.logprob - theirs)
        near_ties += want.margin <= band.nats
        if delta > band.nats:
            return verdict(False, i + 1, failed_at=i, failure="moved")
    judged = min(len(reference), len(answer))
    if len(answer) != len(reference):
        return verdict(False, judged, failed_at=judged, failure="length")
    return verdict(True, judged)


def judge_tokens(
    reference: Sequence[Step], tokens: Sequence[int], band: Band
) -> Verdict:
    """An answer known by its tokens only (a client's request: no
    log-probabilities) against ``reference``: every token equal (on an exact
    band: nothing else), or another one where the reference's own choice
    was a near-tie (its margin within the band). Which token it took is not
    judged: without the answer's log-probabilities a swing of the two sides
    cannot be told from wrong KV, and the bf16 twin's healthy swing at token
    0 (0.89 nats down for the reference's choice, over 0.92 up for a token
    below its fifth, a 17-token prompt in a batch of 64) took a token the
    reference did not rate. ``judge`` judges answers that carry them; this
    one is for the fault suite's requests, sent as clients send them."""
    near_ties = 0

    def verdict(ok: bool, at: int, **how: Any) -> Verdict:
        return Verdict(ok, at, near_ties, 0.0, None, band, **how)

    for i, (want, token) in enumerate(zip(reference, tokens, strict=False)):
        if token != want.token:
            if band.exact or want.margin > band.nats:
                return verdict(
                    False, i, failed_at=i, failure="diverged", margin=want.margin
                )
            return verdict(True, i, flipped_at=i, margin=want.margin)
        near_ties += want.margin <= band.nats
    judged = min(len(reference), len(tokens))
    if len(tokens) != len(reference):
        return verdict(False, judged, failed_at=judged, failure="length")
    return verdict(True, judged)


def shared_deltas(reference: Sequence[Step], answer: Sequence[Step]) -> list[float]:
    """|Δlogprob| at each position up to the first where the tokens differ."""
    out = []
    for want, got in zip(reference, answer, strict=False):
        if got.token != want.token:
            break
        out.append(largest_move(want, got))
    return out


def calibrate(
    pairs: Iterable[tuple[Sequence[Step], Sequence[Step]]],
    exact: bool,
    floor: float | None = None,
) -> Band:
    """The band of a stack from (reference, answer) pairs of probe prompts.

    Raises CalibrationError where the pairs measure too few tokens, where the
    noise is too large to tell wrong KV from (over CEILING), and where an
    answer fails the band measured (it left a confident reference: not noise).
    """
    measured = list(pairs)
    floor = (EXACT_FLOOR if exact else FLOOR) if floor is None else floor
    deltas = [d for ref, ans in measured for d in shared_deltas(ref, ans)]
    if len(deltas) < MIN_SAMPLES:
        raise CalibrationError(
            f"{len(deltas)} tokens shared with the reference over {len(measured)} "
            f"probe answers, fewer than {MIN_SAMPLES}: nothing measured"
        )
    noise = max(deltas)
    band = Band(max(floor, MULTIPLE * noise), exact, noise, len(deltas))
    if band.nats > CEILING:
        raise CalibrationError(
            f"largest |Δlogprob| {noise:.3f} nats over {len(deltas)} probe "
            f"tokens: a band of {band.nats:.3f}, over {CEILING} nats, would let "
            "wrong KV through (is KV already wrong?)"
        )
    failed = [
        f"probe {i}: {v.describe()}"
        for i, (ref, ans) in enumerate(measured)
        if not (v := judge(ref, ans, band)).ok
    ]
    if failed:
        raise CalibrationError("; ".join(failed))
    return band


def steps(
    token_ids: Sequence[int], top_logprobs: Sequence[dict[str, float]]
) -> list[Step]:
    """Steps from an OpenAI completion's ``logprobs.top_logprobs`` (two
    candidates per position at least), keyed "token_id:N" as
    ``pdstack.client.trace`` asks (two tokens of the same text stay apart).
    vLLM adds the chosen token to its position's candidates. A single
    candidate is not tied."""
    out = []
    for token, top in zip(token_ids, top_logprobs, strict=True):
        by_id = {int(key.removeprefix("token_id:")): lp for key, lp in top.items()}
        if token not in by_id:
            raise ValueError(f"token {token} is not among its candidates {top}")
        best = sorted(by_id.values(), reverse=True)
        margin = best[0] - best[1] if len(best) > 1 else math.inf
        out.append(Step(token, by_id[token], margin, by_id))
    return out
