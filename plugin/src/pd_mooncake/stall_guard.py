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
the blocks before the pull's completion notice, which follows this call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
# long against a round (a few microseconds per pending descriptor).
POLL_S = 0.001
# Ids of earlier submissions still unsettled, kept for polling; past this
# many (a peer that never answers again) they are dropped, leaking their
# batch descriptors rather than growing without bound.
MAX_ORPHANS = 65536


@dataclass
class Orphans:
    """Submissions replaced by a resend, polled until Mooncake settles them
    (shared by the worker's sender threads)."""

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
    seconds: float


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
    on_resend: Callable[[int], None] = lambda pending: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Outcome:
    """Write every descriptor to ``session``; status 0 once all are done.

    A failed descriptor (peer gone, connection refused) fails the write once
    the others have settled; a stall (or a slice Mooncake timed out) resends
    the pending ones while ``may_resend(now)`` allows, else fails the write.
    """
    start = clock()
    descriptors = list(zip(src, dst, lengths, strict=True))
    pending = _submit(engine, session, descriptors, range(len(descriptors)), orphans)
    resends, failed, progress, wait_s = 0, False, start, stall_s
    while pending:
        still: dict[int, int] = {}
        timed_out = False
        for index, batch_id in pending.items():
            status = engine.transfer_check_status(batch_id)
            if status == RUNNING:
                still[index] = batch_id
            elif status == DONE:
                progress, wait_s = clock(), stall_s
            elif status == FAILED:
                failed = True
            else:  # TIMED_OUT: Mooncake gave up on the slice, id not freed.
                still[index], timed_out = batch_id, True
        pending = still
        orphans.poll(engine)
        now = clock()
        if not pending or (now - progress < wait_s and not timed_out):
            if pending:
                sleep(POLL_S)
            continue
        orphans.adopt(list(pending.values()))
        if failed or not may_resend(now):
            return Outcome(-1, resends, now - start)
        on_resend(len(pending))
        pending = _submit(engine, session, descriptors, pending, orphans)
        resends, progress, wait_s = resends + 1, now, 2 * wait_s
    if pending is None:
        failed = True
    return Outcome(-1 if failed else 0, resends, clock() - start)


def _submit(
    engine: Any,
    session: str,
    descriptors: Sequence[tuple[int, int, int]],
    indices: Iterable[int],
    orphans: Orphans,
) -> dict[int, int] | None:
    """Batch ids by descriptor index; None (the submitted ones orphaned) when
    Mooncake refuses one, which it does at once for a peer that is gone."""
    submitted: dict[int, int] = {}
    for index in indices:
        batch_id = engine.transfer_submit_write(session, *descriptors[index])
        if batch_id == NOT_SUBMITTED:
            orphans.adopt(list(submitted.values()))
            return None
        submitted[index] = batch_id
    return submitted
