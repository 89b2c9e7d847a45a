"""Upstream's ``get_finished`` without a round across threads at every engine
step when there is nothing to collect.

vLLM asks the worker what finished after every step; upstream's worker
(``MooncakeConnectorWorker.get_finished``, the same in vLLM 0.19.1, 0.32 and
0.33) runs ``fetch_finished_recving_reqs`` on the receiver loop and
``fetch_finished_sending_reqs`` on the sender loop
(``asyncio.run_coroutine_threadsafe``) and waits for both: each loop thread
is woken once per step. While a request waits for its KV (decode) or for
decode's pull (prefill) the engine steps back to back, so those wake-ups
are most of what the transfer threads spend beside the bytes: on the CPU
twin prefill's loop thread burned 0.05 CPU-s per second holding one request
for decode's pull, nothing else happening (2026-12-03).

What a round collects is either recorded by the loop threads as it happens
(``finished_recving_reqs``, ``finished_sending_reqs``: sets this thread can
see are non-empty) or due to a clock (upstream's expiry of requests decode
never pulled, ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``; block_hold's end of a
hold, ``late_writes.DecodeHold``): those are minutes long and may be
reported ``SWEEP_S`` late. So a round runs when a set is non-empty, else at
most every ``SWEEP_S``.
"""

from __future__ import annotations

import time
from typing import Any

# How late a report due to a clock may come (an expiry, a hold's end).
SWEEP_S = 0.05


class FinishedRounds:
    """Mixed into the connector worker (before upstream's class)."""

    _next_round = 0.0

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        now = time.monotonic()
        # Read on this thread while the loop threads add to them: a set's
        # truth is one read under the GIL, and the sets are replaced only
        # inside a round, which this thread is waiting for.
        recorded = getattr(self, "finished_recving_reqs", None) or getattr(
            self, "finished_sending_reqs", None
        )
        if not recorded and now < self._next_round:
            return None, None
        self._next_round = now + SWEEP_S
        finished: Any = super().get_finished()  # type: ignore[misc]
        return finished
