"""stall_guard.write's polling rounds: a round stops at the first descriptor
still running (a status call or two per round, not one per pending
descriptor), and a descriptor done out of order still counts as progress
against the stall bound (stall_guard.SWEEP_S)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from bench.loopback import Endpoint, Peer
from pd_mooncake import staging, stall_guard

MIB = 1 << 20
# Descriptors of the real write: a staged record of 64 MiB.
DESCRIPTORS = 64


class Counting:
    """A real engine whose status calls are counted."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.calls = engine, 0

    def transfer_submit_write(self, *args: Any) -> int:
        return self.engine.transfer_submit_write(*args)

    def transfer_check_status(self, batch_id: int) -> int:
        self.calls += 1
        return self.engine.transfer_check_status(batch_id)


def test_a_round_costs_a_status_call_or_two_not_one_per_descriptor() -> None:
    """Real engines on loopback, a 64 MiB record in 1 MiB descriptors:
    Mooncake's TCP transport completes them about in order, so the calls are
    about one per round and per descriptor, plus a poll of all of them per
    SWEEP_S; polling every pending descriptor each round made it one per
    round and pending descriptor (thousands for a 152 MiB record)."""
    size = DESCRIPTORS * MIB
    sender = Endpoint(size)
    sender.data[:] = np.resize(np.arange(251, dtype=np.uint8), size)
    with Peer(Endpoint, size) as decode:
        session, dst = decode.call("address")
        engine = Counting(sender.engine)
        rounds = [0]

        def sleep(seconds: float) -> None:
            rounds[0] += 1
            time.sleep(seconds)

        start = time.monotonic()
        outcome = stall_guard.write(
            engine,
            session,
            *staging.chunks(sender.base, dst, size),
            stall_s=1.0,
            may_resend=lambda now: True,
            orphans=stall_guard.Orphans(),
            sleep=sleep,
        )
        wall = time.monotonic() - start
        assert outcome.status == 0 and outcome.resends == 0
        assert decode.call("digest", size) == sender.digest(size)
    sweeps = wall / stall_guard.SWEEP_S + 1
    bound = rounds[0] + 1 + DESCRIPTORS * (1 + sweeps)
    print(f"{engine.calls} status calls, {rounds[0] + 1} rounds, {wall:.3f}s")
    assert engine.calls <= bound, (engine.calls, bound)


class OutOfOrder:
    """Descriptors done at set times after submission, the first last
    (Mooncake's completion order cannot be set on a real engine)."""

    def __init__(self, done_after: list[float], clock: Any) -> None:
        self.done_after, self.clock = done_after, clock
        self._ids = itertools.count(1)
        self.due: dict[int, float] = {}

    def transfer_submit_write(self, session: str, src: int, dst: int, n: int) -> int:
        """Descriptor ``src`` (its index here) done ``done_after[src]`` later."""
        batch_id = next(self._ids)
        self.due[batch_id] = self.clock() + self.done_after[src]
        return batch_id

    def transfer_check_status(self, batch_id: int) -> int:
        if self.clock() < self.due[batch_id]:
            return stall_guard.RUNNING
        del self.due[batch_id]  # Mooncake frees the id with its final status
        return stall_guard.DONE


def test_a_descriptor_done_out_of_order_is_progress() -> None:
    """The first descriptor is done after 0.5 s, the other nine one every
    50 ms before it: no 0.2 s passes without a descriptor done, so nothing
    is resent, although the first still runs for 0.5 s. Rounds that stopped
    at the first would see no progress and resend at 0.2 s."""
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    engine = OutOfOrder([0.5] + [0.05 * k for k in range(1, 10)], lambda: now[0])
    outcome = stall_guard.write(
        engine,
        "127.0.0.1:1",
        list(range(10)),
        list(range(10)),
        [4096] * 10,
        stall_s=0.2,
        may_resend=lambda t: True,
        orphans=stall_guard.Orphans(),
        clock=lambda: now[0],
        sleep=sleep,
    )
    assert outcome.status == 0 and outcome.resends == 0, outcome
    assert 0.5 <= outcome.seconds < 0.5 + 2 * stall_guard.POLL_S
    assert engine.due == {}  # each polled to its final status
