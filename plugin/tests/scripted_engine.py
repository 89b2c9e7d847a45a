"""A TransferEngine stand-in whose sends follow a script, for the stall tests.

A Mooncake TCP stall (both peers stop reading what is already in their
sockets until the next submission; kvcache-ai/Mooncake#4209 family, seen in
CI and on the twin) cannot be produced on demand between two real engines,
so these tests script it. A script is a list of rounds, each
``(status, seconds)``: 0 completes every descriptor of the round ``seconds``
after it was submitted; -1 with 0 seconds fails them at once (a peer that is
gone); -1 with more seconds never completes them (``NEVER``: a stall, until
a new round). A round is the run of submissions between two polls:
stall_guard submits all pending descriptors at once. The same script drives
upstream's sync call (``batch_transfer_sync_write``: the round's status
after its seconds), so a negative control can run upstream's send against
it.

A stall that ends (``(0, seconds)`` beyond the stall bound) completes
whatever happened since: a resend that went through, or one that failed,
the writer having given up. With ``real`` (a real TransferEngine) each
completing descriptor is written by it at its due time, reading the source
then, as a submission that resumes does; it reports done once that write
is. ``landed`` lists those writes, ``join`` waits for them.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from pd_mooncake import stall_guard

NEVER = float("inf")
# Past the script every round stalls; upstream's sync call then takes this.
STALL_S = 0.05


class ScriptedEngine:
    def __init__(self, rounds: list[tuple[int, float]], real: Any = None) -> None:
        self.script = list(rounds)
        self.rounds = 0
        self.real = real
        # (when, destination, status) of each real write, in order.
        self.landed: list[tuple[float, int, int]] = []
        self._writers: list[threading.Thread] = []
        self._ids = itertools.count(1)
        # Batch id: (status it settles with, when).
        self._due: dict[int, tuple[int, float]] = {}
        self._polled_since_submit = True
        self.lock = threading.Lock()

    def _next_round(self) -> tuple[int, float]:
        self.rounds += 1
        return self.script.pop(0) if self.script else (-1, STALL_S)

    def transfer_submit_write(self, session: str, src: int, dst: int, n: int) -> int:
        with self.lock:
            if self._polled_since_submit:
                self._round = self._next_round()
                self._polled_since_submit = False
            status, seconds = self._round
            batch_id = next(self._ids)
            if status == 0 and self.real is not None:
                self._due[batch_id] = (stall_guard.DONE, NEVER)  # until written
                writer = threading.Thread(
                    target=self._write_later,
                    args=(batch_id, seconds, session, src, dst, n),
                    daemon=True,
                )
                self._writers.append(writer)
                writer.start()
            elif status == 0:
                self._due[batch_id] = (stall_guard.DONE, time.monotonic() + seconds)
            elif seconds == 0:
                self._due[batch_id] = (stall_guard.FAILED, time.monotonic())
            else:
                self._due[batch_id] = (stall_guard.DONE, NEVER)
            return batch_id

    def _write_later(
        self, batch_id: int, seconds: float, session: str, src: int, dst: int, n: int
    ) -> None:
        time.sleep(seconds)
        real_id = self.real.transfer_submit_write(session, src, dst, n)
        status = stall_guard.FAILED
        if real_id != stall_guard.NOT_SUBMITTED:
            while (status := self.real.transfer_check_status(real_id)) == 0:
                time.sleep(0.001)
        with self.lock:
            self.landed.append((time.monotonic(), dst, status))
            self._due[batch_id] = (status, time.monotonic())

    def join(self, timeout_s: float) -> None:
        """Until every write scripted to complete has."""
        end = time.monotonic() + timeout_s
        for writer in list(self._writers):
            writer.join(max(0.0, end - time.monotonic()))
            assert not writer.is_alive(), f"a scripted write not done in {timeout_s}s"

    def transfer_check_status(self, batch_id: int) -> int:
        with self.lock:
            self._polled_since_submit = True
            status, due = self._due[batch_id]
            if time.monotonic() < due:
                return stall_guard.RUNNING
            del self._due[batch_id]
        return status

    def batch_transfer_sync_write(self, *args: Any) -> int:
        with self.lock:
            status, seconds = self._next_round()
        time.sleep(seconds)
        return status
