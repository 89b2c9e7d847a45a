"""Decode's half of the late-write rule: no write lands in memory decode
has moved on with (prefill's half, and the timeouts it relies on, are in
``send_deadline``).

The invariant, stated here once (``staging_worker`` keeps it;
``DecodeHold.check`` verifies the order of its timeouts at start-up):

    With staging on, prefill writes a pull's KV only into the span decode
    offered for it, never into decode's KV blocks: decode copies a record
    into its blocks itself, on the answer that names it, after checking
    it. A pull that finds no room waits for some (``room_wait_s``) or
    fails with a reason; it is never sent directly. A span whose pull
    failed, or whose sends were resent, is held back ``span_hold_s`` past
    the pull's end: every write prefill made for it has landed or been
    given up by then.

Why the hold is long enough: prefill starts a submission only if it ends
``margin_s`` before decode's wait for the pull does (``decode_wait_s``
after decode's last message from prefill; ``send_deadline``), and decode's
pull ends no earlier than that message. Bytes Mooncake handed to the
kernel before the submission ended can still arrive while TCP
retransmits, which the kernel gives up after ``tcp_give_up_s``
(``tcp_retries2``: measured on the multi-host twin, 4 of 9 descriptors
landed 38 s after decode had failed the pull). So
``span_hold_s >= decode_wait_s + tcp_give_up_s``.

Why the wait for room is short enough: prefill frees a request's blocks
``prefill_abort_s`` after it finished without a pull (upstream's expiry),
so a pull delayed longer finds nothing to pull;
``room_wait_s + margin_s <= prefill_abort_s``.

The invariant for a pull sent directly (staging off, or a pull staging
does not take; ``block_hold`` and ``pull`` keep it):

    A direct pull that fails after decode asked prefill for it keeps its
    requests' KV blocks allocated ``span_hold_s`` past the pull's end (the
    same hold, for the same reason, as a span's: prefill writes into those
    blocks directly); the request fails at once (how vLLM is made to keep
    them: ``block_hold``). Under ``kv_load_failure_policy: fail`` (vLLM's
    default) the client gets its error at once and the blocks come back
    after the hold. Under ``recompute`` the request stays waiting for its
    KV until the hold has passed and is recomputed only then: recomputing
    earlier, into its own blocks or blocks freed for it, is what a late
    write corrupts (a resend's orphan can carry another request's KV,
    issue 26), and a connector cannot give it other blocks; so recompute
    costs a failed direct pull the hold (use ``fail``, or staging, where
    that is too long).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pd_mooncake import send_deadline

# Linux's bounds on the retransmission timeout (include/net/tcp.h: TCP_RTO_MIN
# 200 ms, TCP_RTO_MAX 120 s); the timeout doubles after each retransmission.
RTO_MIN_S = 0.2
RTO_MAX_S = 120.0
# The kernel's default (Documentation/networking/ip-sysctl.rst), used where
# the sysctl cannot be read.
DEFAULT_TCP_RETRIES2 = 15
TCP_RETRIES2 = Path("/proc/sys/net/ipv4/tcp_retries2")
# Decode: how long a pull waits for room in the staging buffer before it
# fails (spans of pulls in flight come back within seconds; held-back ones
# take span_hold_s).
ROOM_WAIT_S = 30.0


def tcp_give_up_s(retries2: int) -> float:
    """Seconds from a segment's first transmission until the kernel gives up
    retransmitting it on an established connection (924.6 s at 15)."""
    return sum(min(RTO_MIN_S * 2**i, RTO_MAX_S) for i in range(retries2 + 1))


def read_tcp_retries2(path: Path = TCP_RETRIES2) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return DEFAULT_TCP_RETRIES2


class HoldOrderError(ValueError):
    """Decode's timeouts let a write land in memory it moved on with."""


@dataclass(frozen=True)
class DecodeHold:
    """Decode's timeouts of the invariant above."""

    decode_wait_s: float
    prefill_abort_s: float
    tcp_give_up_s: float
    room_wait_s: float = ROOM_WAIT_S
    margin_s: float = send_deadline.DEADLINE_MARGIN_S

    @classmethod
    def from_env(
        cls, env: Mapping[str, str], retries2: int | None = None
    ) -> DecodeHold:
        # Decode's own abort timeout sets its wait; prefill's is assumed equal
        # (the one prefill is told decode's through, send_deadline).
        timeouts = send_deadline.SendTimeouts.from_env(env)
        if retries2 is None:
            retries2 = read_tcp_retries2()
        return cls(
            decode_wait_s=timeouts.decode_wait_s,
            prefill_abort_s=timeouts.prefill_abort_s,
            tcp_give_up_s=tcp_give_up_s(retries2),
        )

    @property
    def span_hold_s(self) -> float:
        """How long past a failed pull's end its span, or a direct pull's
        KV blocks, stay out of reuse."""
        return self.decode_wait_s + self.tcp_give_up_s

    def check(self) -> None:
        """Start-up: the wait for room ends before prefill gives the request
        up (the hold is derived, so it covers decode's wait by construction)."""
        need = self.room_wait_s + self.margin_s
        if need > self.prefill_abort_s:
            raise HoldOrderError(
                f"timeouts out of order: decode's wait for staging room "
                f"({self.room_wait_s:g} s) + margin {self.margin_s:g} s exceeds "
                f"prefill's {send_deadline.ABORT_ENV} ({self.prefill_abort_s:g} "
                "s): a pull waiting for room would find its request freed on "
                f"prefill; raise {send_deadline.ABORT_ENV} to at least {need:g}"
            )
