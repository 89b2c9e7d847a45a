"""KV staging: a send crosses as a few large descriptors, whatever the blocks.

Mooncake's TCP transport (0.3.13) pays per descriptor: measured here
0.41-0.52 GB/s for 36 KiB KV-block descriptors against 2.1-2.2 GB/s for one
large descriptor, and upstream's descriptor count grows as the free block
lists fragment (the same 4000 tokens: 522 descriptors on a fresh stack, 1269
a minute later). A copy in memory runs at 7-18 GB/s. So:

- decode reserves, per pull, a span of its registered staging buffer large
  enough for the pull's blocks and offers it in the pull
  (``wire.XferMetadata.pd_staging``: address, bytes, a nonce); a pull
  longer than the buffer is split into pulls that fit, and a request that
  alone needs more crosses in chunks (``Chunk``: sub-pulls of runs of its
  blocks, one span each, only the last settling the request), so every
  pull is staged whatever its length;
- prefill, for each send of that pull, copies upstream's source descriptors
  into its own registered staging buffer behind a header listing upstream's
  destination descriptors (a record), and writes the record to the next
  free place of decode's span in ``CHUNK_BYTES`` descriptors, and names the
  record's offset in its answer (``wire.XferResponse.pd_staging_record``);
- decode, when that answer arrives, checks the record's nonce, that it lies
  in the span and that every destination lies in its registered KV memory,
  and copies the bytes there, before the KV checksum verifies them and
  before upstream reports the requests received.

With staging on, nothing is sent directly: a pull that finds no room in
decode's buffer waits for some or fails, and so does a send that finds none
in prefill's or in the span's rest (``NoRoomError``; the rule and its timeouts:
``late_writes``). Only with staging off (or no offer: a pull without
blocks) do sends go directly, as upstream's do. The blocks and their
layout are upstream's business throughout: the record replays upstream's
descriptors, so every layout upstream can send, staging can.

Late writes: a submission prefill stopped waiting for can still complete
(measured on the multi-host twin: 4 of 9 descriptors landed 38 s after
decode had failed the pull for a silent prefill and freed the blocks). A
span whose pull failed, or whose sends were resent, is held back
(``late_writes.DecodeHold.span_hold_s``) rather than reused, so such writes
land in the span, never in KV blocks decode has given to another request.

How the bytes are copied (one indexed copy per region, on a stream of the
worker's own ordered after the forward pass's KV writes) and where the
staging buffer lives (pinned host memory over TCP, device memory over RDMA)
is pd_mooncake.device_copy's and staging_worker's; only the CPU path has
been run (no GPU here): ``scripts/gpu-datapath-check`` runs it on one.
"""

from __future__ import annotations

import contextvars
import itertools
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

# How bytes move lives in device_copy; importable from here as before.
from pd_mooncake.device_copy import Memory, copy  # noqa: F401

# numpy and torch inside the functions that touch memory: the record's
# arithmetic below is what the e2e suite imports, from a client venv with
# neither (`make client`).
if TYPE_CHECKING:
    import numpy as np
    import torch

KEY = "kv_staging_mib"
# One descriptor of a staged write: large against Mooncake's per-descriptor
# cost, small enough that one completes well within the stall bound
# (stall_guard.DEFAULT_STALL_S) on a 100 Mbit/s link.
CHUNK_BYTES = 1 << 20
# Spans start on this boundary (page-aligned copies).
ALIGN = 4096
MAGIC = 0x5044_4B56_5354_4731  # "PDKVSTG1"
# Header words before the descriptor table: magic, nonce, count.
HEAD_WORDS = 3


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def head_bytes(count: int) -> int:
    """A record's header for ``count`` descriptors (the data starts after it)."""
    return aligned((HEAD_WORDS + 2 * count) * 8)


def record_bytes(lengths: Sequence[int]) -> int:
    """Header and data of a record for these descriptors."""
    return head_bytes(len(lengths)) + sum(lengths)


def record_descriptors(entries: int, payload: int) -> int:
    """Mooncake descriptors a staged record takes at most: its header for
    ``entries`` upstream descriptors and ``payload`` bytes of KV, written
    in CHUNK_BYTES pieces."""
    return -(-(head_bytes(entries) + payload) // CHUNK_BYTES)


class NoRoomError(ValueError):
    """A pull or a send that staging cannot take (now, or ever): failed with
    this reason, never sent directly."""


class Arena:
    """A registered buffer, handed out in spans (first fit); a released
    span may be held back until a time (quarantine)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.base = buffer.data_ptr()
        self.size = buffer.numel()
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, size)
        self._held: list[tuple[float, int, int]] = []  # (until, offset, size)
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> int | None:
        """Offset of a span of ``nbytes`` (rounded up), or None if none is free."""
        need = aligned(max(nbytes, 1))
        with self._lock:
            self._expire(time.monotonic())
            for i, (offset, size) in enumerate(self._free):
                if size >= need:
                    rest = (offset + need, size - need)
                    self._free[i : i + 1] = [rest] if rest[1] else []
                    return offset
        return None

    def release(self, offset: int, nbytes: int, hold_s: float = 0.0) -> None:
        span = (offset, aligned(max(nbytes, 1)))
        with self._lock:
            if hold_s > 0:
                self._held.append((time.monotonic() + hold_s, *span))
            else:
                self._give_back(span)

    def held(self) -> int:
        with self._lock:
            self._expire(time.monotonic())
            return sum(size for _, _, size in self._held)

    def _expire(self, now: float) -> None:
        due = [h for h in self._held if h[0] <= now]
        self._held = [h for h in self._held if h[0] > now]
        for _, offset, size in due:
            self._give_back((offset, size))

    def _give_back(self, span: tuple[int, int]) -> None:
        spans = sorted([*self._free, span])
        merged: list[tuple[int, int]] = []
        for offset, size in spans:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((offset, size))
        self._free = merged


# -- decode: the span offered in one pull ---------------------------------------
@dataclass
class Offer:
    offset: int
    nbytes: int
    address: int
    nonce: int = field(default_factory=lambda: secrets.randbits(63))
    # No failure and no resend; with every request of the pull in
    # ``answered`` too, the span may be reused at once (_staging_close).
    clean: bool = True
    # The requests this peer's answers named done: their record scattered,
    # or nothing of theirs sent by this peer (``pd_staging_empty``). Prefill
    # answers after its writes settled (stall_guard.write), so an answered
    # request has no write left to land, whatever another peer of a split
    # pull still owes.
    answered: set[str] = field(default_factory=set)

    @property
    def wire(self) -> list[int]:
        return [self.address, self.nbytes, self.nonce]


# -- prefill: decode's span, as one pull's sends fill it -------------------------
@dataclass
class Target:
    address: int
    nbytes: int
    nonce: int
    # Where the next record goes: every staged attempt takes new room (a
    # failed one's submissions may still land).
    cursor: int = 0
    # The offset of the record the next answer announces.
    record: int | None = None
    # Whether a send (staged or not) ran since the last answer: an answer
    # without a record and without a send tells decode nothing was written.
    sent: bool = False
    # A staged send resent descriptors or failed: told to decode in the answer.
    unsettled: bool = False

    @classmethod
    def from_wire(cls, value: Sequence[int] | None) -> Target | None:
        if not value or len(value) != 3:
            return None
        return cls(int(value[0]), int(value[1]), int(value[2]))


# Decode: the offer of the pull being run (its task); prefill: the target of
# the pull being answered (its sender task, copied into the send's thread).
OFFER: contextvars.ContextVar[Offer | None] = contextvars.ContextVar(
    "pd_kv_staging_offer", default=None
)
TARGET: contextvars.ContextVar[Target | None] = contextvars.ContextVar(
    "pd_kv_staging_target", default=None
)


def header(nonce: int, dsts: Sequence[int], lengths: Sequence[int]) -> np.ndarray:
    import numpy as np

    words = np.zeros(head_bytes(len(dsts)) // 8, np.uint64)
    words[:HEAD_WORDS] = (MAGIC, nonce, len(dsts))
    words[HEAD_WORDS : HEAD_WORDS + len(dsts)] = dsts
    words[HEAD_WORDS + len(dsts) : HEAD_WORDS + 2 * len(dsts)] = lengths
    return words


def chunks(src: int, dst: int, nbytes: int) -> tuple[list[int], list[int], list[int]]:
    """One staged write as ``CHUNK_BYTES`` descriptors."""
    starts = range(0, nbytes, CHUNK_BYTES)
    lengths = [min(CHUNK_BYTES, nbytes - s) for s in starts]
    return [src + s for s in starts], [dst + s for s in starts], lengths


def offsets(lengths: Sequence[int]) -> list[int]:
    """Where each descriptor's bytes start in a record's data."""
    return [0, *itertools.accumulate(lengths)][: len(lengths)]


def span_bound(block_counts: Iterable[int], block_bytes: Sequence[int]) -> int:
    """Span bytes that hold a pull's records whichever sends carry them: per
    request a record of its largest group's block count times every region's
    block bytes, with one descriptor per block and region, taking whole
    pages (the cursor moves by aligned records)."""
    return sum(
        aligned(record_bytes([0] * (n * len(block_bytes))) + n * sum(block_bytes))
        for n in block_counts
    )


def chunk_blocks(capacity: int, block_bytes: Sequence[int]) -> int:
    """The most blocks (per KV cache group) of one request a span of
    ``capacity`` bytes holds, by ``span_bound``: one chunk of a pull."""
    blocks = capacity // sum(block_bytes)
    while blocks and span_bound([blocks], block_bytes) > capacity:
        blocks -= 1
    return blocks


# -- a request longer than one span: chunks ---------------------------------------
@dataclass
class Chunk:
    """One sub-pull of a request whose KV needs more than one span: the block
    positions ``[start, stop)`` of each of its KV cache groups (``whole``
    groups, Mamba's state, go entire with the last chunk). Only the last
    chunk settles the request, on both sides: decode reports it received
    (and verifies its checksum over all its blocks), prefill counts it sent."""

    req_id: str
    start: int
    stop: int
    last: bool

    @property
    def wire(self) -> dict[str, list[int]]:
        return {self.req_id: [self.start, self.stop, int(self.last)]}


def chunk_ranges(positions: int, per_chunk: int) -> list[tuple[int, int]]:
    """Block positions ``[0, positions)`` in runs of at most ``per_chunk``."""
    return [
        (start, min(start + per_chunk, positions))
        for start in range(0, positions, per_chunk)
    ]


def chunk_groups(
    groups: Sequence[Sequence[int]],
    start: int,
    stop: int,
    last: bool,
    whole: Sequence[bool],
) -> list[list[int]]:
    """The blocks of one chunk: positions ``[start, stop)`` of each group; a
    ``whole`` group entire in the last chunk, empty before."""
    return [
        (list(group) if last else []) if entire else list(group[start:stop])
        for group, entire in zip(groups, whole, strict=True)
    ]


# Decode: the chunk of the sub-pull being run (its task); prefill: decode's
# chunks of the pull being answered, by request ([start, stop, last]).
CHUNK: contextvars.ContextVar[Chunk | None] = contextvars.ContextVar(
    "pd_kv_staging_chunk", default=None
)
CHUNKS: contextvars.ContextVar[dict[str, list[int]] | None] = contextvars.ContextVar(
    "pd_kv_staging_chunks", default=None
)
