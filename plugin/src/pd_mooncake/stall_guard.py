"""Prefill's KV write with its own stall bound, in place of Mooncake's sync call.

Upstream sends a pull's blocks with ``batch_transfer_sync_write``, which
(Mooncake 0.3.13, transfer_engine_py.cpp) spins on the batch's status without
sleeping and gives up only after ``max(5, MC_TRANSFER_TIMEOUT)`` seconds plus
one per GiB. Measured on the 2-core twin: the spin takes a core from both
servers for the whole transfer, and in a TCP stall (kvcache-ai/Mooncake#4209
family; here both peers stopped reading bytes already in their sockets'
receive queues, on every lane, until the next submission) each attempt cost
the whole timeout, then the retry sent every block again.

Here each descriptor is submitted on its own (``transfer_submit_write``) and
polled (``transfer_check_status``) with a sleep between rounds. When no
descriptor completes for ``stall_s`` the ones still pending are submitted
again, which is what set the stalled lanes moving in the measurements. The
wait doubles after each resend until a descriptor completes again, so a host
too loaded to make progress (or a first connection, slow under load: seen
once in CI) is not sent ever more copies of the same descriptors. The
earlier submissions are kept and polled until Mooncake settles them, so their
batch ids are freed and none of them is reported done twice. Whether a
resend may start at all is the caller's decision (``may_resend``): it knows
how long decode still waits for these blocks.

Writing the same bytes to the same place twice is safe: decode does not use
the blocks before the pull's completion notice, which follows this call. A
write that resumes after that notice is not: prefill frees and reuses the
source blocks once the send is reported (done or failed), decode its blocks,
and the late submission then carries another request's bytes into them. So
``write`` returns only once every submission it made has settled (done or
failed) or is ``settle_s`` old (Mooncake's own attempt timeouts end it by
then): the rule and the timeouts it relies on are stated once, in
``send_deadline``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pd_mooncake.send_deadline import MOONCAKE_ATTEMPT_TIMEOUTS

# transfer_check_status: 1 done (id freed), -1 failed (id freed), -2 Mooncake
# timed the slice out (id kept), 0 still running.
DONE, FAILED, TIMED_OUT, RUNNING = 1, -1, -2, 0
# transfer_submit_write returns 0 when the write could not be submitted
# (segment not found: the peer is gone).
NOT_SUBMITTED = 0

# Seconds without any descriptor completing that count as a stall. A
# descriptor is one KV block of one layer (tens of KiB) or a few contiguous
# ones; at the twin's slowest measured rate (43 MB/s, both servers busy) one
# completes every millisecond or so.
DEFAULT_STALL_S = 1.0
# Between polling rounds: short against a transfer (13-600 ms measured) and
# long against a round.
POLL_S = 0.001
# A round polls the pending descriptors in submission order and stops at the
# first still running: Mooncake's TCP transport completes a write's slices
# about in order, so a round is a status call or two, not one per pending
# descriptor (a 152 MiB staged record, 153 descriptors, on loopback: about
# 230 status calls instead of 4,050, 2026-12-03). All of them are polled
# every SWEEP_S (a descriptor done out of order is progress: the stall
# bound needs it seen) and before a stall or a timed-out slice is acted on.
SWEEP_S = 0.05
# How long a submission can still write, at Mooncake's default timeouts; the
# connector passes the configured value (send_deadline.SendTimeouts.attempt_s).
DEFAULT_SETTLE_S = max(MOONCAKE_ATTEMPT_TIMEOUTS.values())
# Ids of submissions still running past their settle bound, kept for polling
# (a write waits for its own until then); past this many (a peer that never
# answers again) they are dropped, leaking their batch descriptors rather
# than growing without bound.
MAX_ORPHANS = 65536


@dataclass
class Orphans:
    """Submissions still running past their write's settle bound, polled
    until Mooncake settles them, which frees their ids (shared by the
    worker's sender threads)."""

    ids: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def poll(self, engine: Any) -> None:
        if not self.ids:
            return
        with self.lock:
            self.ids = [
                i for i in self.ids if engine.transfer_check_status(i) == RUNNING
            ]

    def adopt(self, ids: Sequence[int]) -> None:
        with self.lock:
            room = MAX_ORPHANS - len(self.ids)
            self.ids.extend(ids[: max(room, 0)])


@dataclass
class Outcome:
    status: int
    resends: int
    # Until the write's own result was known.
    seconds: float
    # Then spent waiting for submissions it had replaced or given up on.
    held_s: float = 0.0
    # Of those, how many were still running at their bound (handed to the
    # orphans: past Mooncake's attempt timeouts, see send_deadline).
    unsettled: int = 0


def write(
    engine: Any,
    session: str,
    src: Sequence[int],
    dst: Sequence[int],
    lengths: Sequence[int],
    *,
    stall_s: float,
    may_resend: Callable[[float], bool],
    orphans: Orphans,
    settle_s: float = DEFAULT_SETTLE_S,
    on_resend: Callable[[int], None] = lambda pending: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Outcome:
    """Write every descriptor to ``session``; status 0 once all are done.

    A failed descriptor (peer gone, connection refused) fails the write once
    the others have settled; a stall (or a slice Mooncake timed out) resends
    the pending ones while ``may_resend(now)`` allows, else fails the write.
    Either way it returns only once every submission it made is done,
    failed, or ``settle_s`` old (send_deadline: the late-write rule).
    """
    start = clock()
    descriptors = list(zip(src, dst, lengths, strict=True))
    # This call's submissions not yet seen settled, and when each was made.
    unsettled: dict[int, float] = {}
    try:
        status, resends = _write(
            engine,
            session,
            descriptors,
            unsettled,
            stall_s=stall_s,
            may_resend=may_resend,
            orphans=orphans,
            on_resend=on_resend,
            clock=clock,
            sleep=sleep,
        )
    finally:
        # Also when Mooncake raised: no caller may report this send while a
        # submission of it can still read the source or write the target.
        seconds = clock() - start
        held_s, left = _settle(engine, unsettled, settle_s, orphans, clock, sleep)
    return Outcome(status, resends, seconds, held_s, left)


def _write(
    engine: Any,
    session: str,
    descriptors: Sequence[tuple[int, int, int]],
    unsettled: dict[int, float],
    *,
    stall_s: float,
    may_resend: Callable[[float], bool],
    orphans: Orphans,
    on_resend: Callable[[int], None],
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> tuple[int, int]:
    """(status, resends); submissions replaced by a resend stay in
    ``unsettled`` (polled here, waited for by the caller)."""
    pending = _submit(
        engine, session, descriptors, range(len(descriptors)), unsettled, clock
    )
    resends, failed, progress, wait_s = 0, False, clock(), stall_s
    swept = clock()
    while pending:
        began = clock()
        sweep = began - swept >= SWEEP_S or began - progress >= wait_s
        if sweep:
            swept = began
        settled: list[int] = []
        timed_out = False
        for index, batch_id in pending.items():
            status = engine.transfer_check_status(batch_id)
            if status == DONE:
                del unsettled[batch_id]
                progress, wait_s = clock(), stall_s
            elif status == FAILED:
                del unsettled[batch_id]
                failed = True
            else:
                # TIMED_OUT: Mooncake gave up on the slice, id not freed.
                timed_out = timed_out or status == TIMED_OUT
                if sweep:
                    continue
                break  # the rest in a later round (SWEEP_S)
            settled.append(index)
        for index in settled:
            del pending[index]
        if sweep:
            if len(unsettled) > len(pending):
                _poll(engine, unsettled, skip=set(pending.values()))
            orphans.poll(engine)
        now = clock()
        if not pending or (now - progress < wait_s and not timed_out):
            if pending:
                sleep(POLL_S)
            continue
        if not sweep:
            # A stall or a timed-out slice is acted on only over all of them:
            # the ones past the first may be done.
            swept = float("-inf")
            continue
        if failed or not may_resend(now):
            return -1, resends
        on_resend(len(pending))
        pending = _submit(engine, session, descriptors, pending, unsettled, clock)
        resends, progress, wait_s = resends + 1, now, 2 * wait_s
    return (-1 if failed or pending is None else 0), resends


def _poll(engine: Any, unsettled: dict[int, float], skip: set[int]) -> None:
    """Forget the submissions Mooncake has settled (it frees their ids: each
    is polled to a final status once only)."""
    for batch_id in [b for b in unsettled if b not in skip]:
        if engine.transfer_check_status(batch_id) in (DONE, FAILED):
            del unsettled[batch_id]


def _settle(
    engine: Any,
    unsettled: dict[int, float],
    settle_s: float,
    orphans: Orphans,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> tuple[float, int]:
    """Wait until each submission in ``unsettled`` has settled or is
    ``settle_s`` old; the ones still running then go to ``orphans``.
    (seconds waited, how many went)."""
    start = clock()
    try:
        while unsettled and clock() < max(unsettled.values()) + settle_s:
            _poll(engine, unsettled, skip=set())
            if unsettled:
                sleep(POLL_S)
    except Exception:
        # Mooncake cannot tell (it raised): wait the bound out instead.
        if unsettled:
            sleep(max(0.0, max(unsettled.values()) + settle_s - clock()))
        raise
    finally:
        orphans.adopt(list(unsettled))
    return clock() - start, len(unsettled)


def _submit(
    engine: Any,
    session: str,
    descriptors: Sequence[tuple[int, int, int]],
    indices: Iterable[int],
    unsettled: dict[int, float],
    clock: Callable[[], float],
) -> dict[int, int] | None:
    """Batch ids by descriptor index; None when Mooncake refuses one, which
    it does at once for a peer that is gone (the ones submitted before stay
    in ``unsettled``)."""
    submitted: dict[int, int] = {}
    for index in indices:
        batch_id = engine.transfer_submit_write(session, *descriptors[index])
        if batch_id == NOT_SUBMITTED:
            return None
        unsettled[batch_id] = clock()
        submitted[index] = batch_id
    return submitted
