"""Prefill (worker): no send outlives decode's wait for it, and sends to a
silent decode hold no thread a healthy decode needs.

A stalled send's pending descriptors are sent again (connector
``_send_blocks``, ``stall_guard``), but never so late that a write could
still land when decode has given up on the request and handed its blocks to
another one (``SendTimeouts``, checked at start-up and before every resend,
on the clock decode's pull started: ``StampedQueue``, ``StampingSocket``,
``PullClock``). ``SessionExecutor`` gives each decode its own sender threads.

The late-write rule, stated here once (``stall_guard.write`` and the
connector's ``_send_blocks`` keep it; ``SendTimeouts.check`` verifies the
order of its timeouts at start-up):

    Prefill starts a Mooncake submission only if it ends (``attempt_s``)
    ``margin_s`` before decode's wait for the pull does (``decode_wait_s``
    from decode's last message); and it reports a send, done or failed,
    only once every submission it made for it is done, failed, or
    ``attempt_s`` old. Until then the send holds its requests' source
    blocks (upstream's ``SendBlockMeta.sending``) and decode its blocks (it
    waits for the answer).

Why each part: a report lets decode use or free its blocks and prefill free
its source blocks (at once on success; at its abort timeout on failure,
through upstream's expiry, which skips a request while ``sending`` is above
0: mooncake_connector.py ``fetch_finished_sending_reqs``). A submission that
resumed after that would read another request's KV from reused source
blocks into blocks decode gave to another request, after the checksum.
What it relies on:

- ``attempt_s``, the largest of Mooncake's own timeouts
  (``MOONCAKE_ATTEMPT_TIMEOUTS``): Mooncake ends a submission within it,
  so past it nothing reads the source blocks;
- ``decode_wait_s`` (decode's ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` + 60 s,
  restarted by each answer): every submission ends ``margin_s`` before it,
  so an answer held for them still reaches decode in time;
- ``prefill_abort_s`` (prefill's ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``):
  the latest a first attempt starts after its pull arrived. Order:
  ``prefill_abort_s + attempt_s + margin_s <= decode_wait_s``;
- a send that raises releases its ``sending`` count (the connector's
  ``_send_blocks`` and ``_build_transfer_params`` report it failed instead:
  upstream decrements only on its normal path).

Not covered here: bytes Mooncake handed to the kernel before it gave up on a
submission (TCP retransmits deliver them later, measured 38 s after a
failed pull); only decode can guard its blocks against those.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# Upstream's default VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (vllm/envs.py).
UPSTREAM_ABORT_REQUEST_TIMEOUT_S = 480.0
# Upstream decode waits this long past its abort timeout for each answer on a
# pull's socket (mooncake_connector.py receive_kv_from_single_worker: RCVTIMEO
# = (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60) s, restarted by every message).
DECODE_WAIT_EXTRA_S = 60.0
# Mooncake 0.3.13's own per-attempt timeouts, each 30 s by default: the batch
# wait (MC_TRANSFER_TIMEOUT, "Sync batch data transfer timeout after 30s") and
# the TCP client session's ("no transfer progress within 30s", "no status
# frame within 30s", seen in CI). A stalled attempt can outlast the first
# (measured here: 5 s with MC_TRANSFER_TIMEOUT=1), so the longest one bounds it.
MOONCAKE_ATTEMPT_TIMEOUTS = {
    "MC_TRANSFER_TIMEOUT": 30.0,
    "MC_TCP_PROGRESS_TIMEOUT_SEC": 30.0,
    "MC_TCP_STATUS_TIMEOUT_SEC": 30.0,
}
# Prefill is told decode's abort timeout through this (decode's environment is
# not prefill's); unset, both are assumed equal (production: neither is set).
DECODE_ABORT_ENV = "PD_MOONCAKE_DECODE_ABORT_REQUEST_TIMEOUT"
ABORT_ENV = "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"
# Between prefill's and decode's clocks of one pull: the ZMQ hop, decode's
# receiver loop noticing its timeout, an attempt's thread starting late.
DEADLINE_MARGIN_S = 10.0


class TimeoutOrderError(ValueError):
    """The configured timeouts let a send write into blocks decode freed."""


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "")
    try:
        return float(raw) if raw.strip() else default
    except ValueError as exc:
        raise TimeoutOrderError(f"{name}={raw!r} is not a number of seconds") from exc


@dataclass(frozen=True)
class SendTimeouts:
    """Prefill's view of one pull's clock.

    Decode gives up on a pull ``decode_wait_s`` after its last message from
    prefill (or after sending the pull), then frees the requests' blocks for
    other requests. Prefill waits up to ``prefill_abort_s`` for a request to
    be ready, then writes; an attempt can take ``attempt_s``. An attempt may
    start only if it ends ``margin_s`` before decode's wait does.
    """

    prefill_abort_s: float
    decode_wait_s: float
    attempt_s: float
    margin_s: float = DEADLINE_MARGIN_S

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SendTimeouts:
        prefill_abort = _seconds(env, ABORT_ENV, UPSTREAM_ABORT_REQUEST_TIMEOUT_S)
        decode_abort = _seconds(env, DECODE_ABORT_ENV, prefill_abort)
        attempt = max(
            _seconds(env, name, default)
            for name, default in MOONCAKE_ATTEMPT_TIMEOUTS.items()
        )
        return cls(prefill_abort, decode_abort + DECODE_WAIT_EXTRA_S, attempt)

    def check(self) -> None:
        """Start-up: the first attempt of a request that became ready at the
        last moment prefill waits for it must still end before decode gives
        up, and so must the wait for its submissions (the late-write rule)."""
        need = self.prefill_abort_s + self.attempt_s + self.margin_s
        if need > self.decode_wait_s:
            raise TimeoutOrderError(
                f"timeouts out of order: prefill's {ABORT_ENV} "
                f"({self.prefill_abort_s:g} s) + the longest Mooncake attempt "
                f"(max of {', '.join(MOONCAKE_ATTEMPT_TIMEOUTS)}: "
                f"{self.attempt_s:g} s) + margin {self.margin_s:g} s = {need:g} s "
                f"exceeds decode's wait for a pull, decode's {ABORT_ENV} + "
                f"{DECODE_WAIT_EXTRA_S:g} s = {self.decode_wait_s:g} s (told to "
                f"prefill by {DECODE_ABORT_ENV}, default: prefill's {ABORT_ENV}). "
                "A send could then write into blocks decode has given to "
                f"another request: raise decode's {ABORT_ENV} to at least "
                f"{need - DECODE_WAIT_EXTRA_S:g} (and {DECODE_ABORT_ENV} on "
                f"prefill with it), or lower prefill's {ABORT_ENV}."
            )

    def deadline(self, last_message: float) -> float:
        """When decode stops waiting, on prefill's monotonic clock, less the
        margin."""
        return last_message + self.decode_wait_s - self.margin_s

    def may_start(self, now: float, last_message: float) -> bool:
        return now + self.attempt_s <= self.deadline(last_message)


class PullClock:
    """When decode last heard from prefill on one pull's socket (its pull's
    arrival, then each answer): decode's wait restarts at each."""

    def __init__(self, arrival: float) -> None:
        self.last_message = arrival


# The pull being served by this sender task (send_kv_to_decode), read by its
# send attempts in the executor's threads (SessionExecutor copies contexts).
PULL_CLOCK: contextvars.ContextVar[PullClock | None] = contextvars.ContextVar(
    "pd_mooncake_pull_clock", default=None
)
# When the pull just taken from the sender queue arrived (StampedQueue.get).
PULL_ARRIVAL: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "pd_mooncake_pull_arrival", default=None
)


class StampedQueue(asyncio.Queue):
    """Upstream's sender queue, remembering when each pull arrived: a pull can
    wait there for a free sender task while decode's clock already runs."""

    def put_nowait(self, item: Any) -> None:
        super().put_nowait((item, time.monotonic()))

    def get_nowait(self) -> Any:
        item, arrival = super().get_nowait()
        # Runs in the sender task that will serve the pull (upstream's
        # _sender_worker awaits get() then send_kv_to_decode in one task).
        PULL_ARRIVAL.set(arrival)
        return item


class StampingSocket:
    """The pull's ROUTER socket as upstream's send_kv_to_decode uses it,
    restarting the pull's clock at every answer sent."""

    def __init__(self, sock: Any, clock: PullClock) -> None:
        self._sock = sock
        self._clock = clock

    async def send_multipart(self, *args: Any, **kwargs: Any) -> Any:
        result = await self._sock.send_multipart(*args, **kwargs)
        self._clock.last_message = time.monotonic()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class SessionExecutor(concurrent.futures.Executor):
    """Upstream's sender thread pool, one pool per decode session.

    Upstream runs every send in one pool of ``num_workers`` threads
    (mooncake_connector.py: ``_sender_executor``, ``run_in_executor(...,
    self._send_blocks, remote_session, ...)``). A decode whose host went
    silent holds each thread for a Mooncake timeout per attempt, and with
    retries for the whole retry window: sends to healthy decodes queue behind.
    Here each session (the first argument) gets its own pool of the same
    size, created on first use; the caller's context travels with the call.
    """

    def __init__(
        self,
        max_workers: int,
        initializer: Callable[[], None] | None = None,
        thread_name_prefix: str = "vllm-mooncake-sender",
    ) -> None:
        self._max_workers = max_workers
        self._initializer = initializer
        self._prefix = thread_name_prefix
        self._pools: dict[Any, concurrent.futures.ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def _pool(self, key: Any) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._max_workers,
                    thread_name_prefix=f"{self._prefix}-{len(self._pools)}",
                    initializer=self._initializer,
                )
                self._pools[key] = pool
            return pool

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        key = args[0] if args and isinstance(args[0], str) else None
        context = contextvars.copy_context()
        return self._pool(key).submit(context.run, fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            pools = list(self._pools.values())
        for pool in pools:
            pool.shutdown(wait=wait, cancel_futures=cancel_futures)
