"""Mooncake's transfer engine alone, over TCP on loopback, against this machine's
ceilings measured in the same run (or between two hosts: bench.hosts_link
gives ``run`` the hosts' addresses and the receiver's network namespace);
docs/bench.md ("What runs", step 1) says what each of ``METHODS`` sends.

Two processes (bench.loopback): this one writes, a spawned receiver owns the
destination buffer. Mooncake acknowledges a TCP write once the receiver has
it, so one ``batch_transfer_sync_write`` is one delivered copy; the socket's
sender waits for a one-byte acknowledgement per transfer (the same rule).
``engine_kv_blocks`` has a direct send's shape (a descriptor per block run).
Every delivered copy is checked: the receiver's bytes must hash like the
sender's (the buffer is cleared first), so a method that moved nothing cannot
report a throughput.
"""

from __future__ import annotations

import os
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any
from unittest import mock

import numpy as np

from bench import loopback
from bench.loopback import HOST, digest
from pd_mooncake import stall_guard
from pd_mooncake.staging import CHUNK_BYTES, chunks

DEADLINE_S = 120.0
# Bytes of one tiny-profile MLA block (16 tokens x 576 float32 values).
KV_BLOCK_BYTES = 36864
# Per timing sample, at least this many bytes (small sizes repeat the transfer).
SAMPLE_BYTES = 8 << 20
# Above this many descriptors the KV-shaped series is skipped (slow on TCP).
MAX_KV_DESCRIPTORS = 4096
CHUNKED_METHOD = "engine_chunked"
METHODS = ("engine", "engine_kv_blocks", CHUNKED_METHOD, "socket", "memcpy")
# The tuned series: Mooncake's TCP transport with larger slices, measured after
# the defaults (the setting is read when an engine is created).
TUNED_METHOD = "engine_tuned"
TUNED_ENV = {"MC_TCP_SLICE_SIZE": str(1 << 20)}
TUNED_MIN_BYTES = 1 << 20


class TransferBenchError(RuntimeError):
    pass


class Receiver(loopback.Endpoint):
    """The receiving process: a registered buffer that a socket server (on
    ``host`` too) also writes into."""

    def __init__(self, capacity: int, host: str = HOST) -> None:
        super().__init__(capacity, host)
        self.listener = socket.create_server((host, 0))
        threading.Thread(target=self._serve_socket, daemon=True).start()

    def socket_port(self) -> int:
        return self.listener.getsockname()[1]

    def _serve_socket(self) -> None:
        """Per transfer: 8-byte length, the bytes (into ``data``), a 1-byte ack;
        the sender's end closed stops it."""
        conn, _ = self.listener.accept()
        with conn:
            header, view = bytearray(8), memoryview(self.data)
            while conn.recv_into(header, 8, socket.MSG_WAITALL) == 8:
                (size,) = struct.unpack("<Q", header)
                if conn.recv_into(view[:size], size, socket.MSG_WAITALL) != size:
                    raise ConnectionError("sender closed the socket mid-transfer")
                conn.sendall(b"\x01")


@dataclass
class Sample:
    method: str
    size: int
    repeats_per_sample: int
    seconds: list[float] = field(default_factory=list)
    descriptors: int = 1
    verified: bool | None = None
    # Mooncake settings of this sample's engines (the tuned series).
    env: dict[str, str] = field(default_factory=dict)

    def throughputs(self) -> list[float]:
        """Bytes per second of each sample."""
        return [self.size * self.repeats_per_sample / s for s in self.seconds if s > 0]

    def median_bps(self) -> float:
        return statistics.median(self.throughputs() or [0.0])


def kv_descriptors(
    size: int, base_src: int, base_dst: int, block: int = KV_BLOCK_BYTES
) -> tuple[list[int], list[int], list[int]]:
    """``size`` bytes as block-sized descriptors (the last one may be shorter)."""
    offsets = range(0, size, block)
    return (
        [base_src + o for o in offsets],
        [base_dst + o for o in offsets],
        [min(block, size - o) for o in offsets],
    )


def run(
    sizes: Sequence[int],
    repeats: int = 5,
    env: Mapping[str, str] | None = None,
    progress: Callable[[str], None] = print,
    methods: Sequence[str] = METHODS,
    misaddress: int = 0,
    sender_host: str = HOST,
    receiver_host: str = HOST,
    netns: str | None = None,
) -> list[Sample]:
    """Measure every method at every size; raises if any copy arrives wrong.

    ``misaddress`` shifts the engine's destination by that many bytes: a test's
    negative control, showing that the arrival check catches misplaced bytes.
    Between hosts, the receiver runs in network namespace ``netns`` at
    ``receiver_host`` and this process sends from ``sender_host`` (its
    address on the link there); by default both are on loopback.
    """
    env = dict(env or {})
    capacity = max(sizes)
    samples: list[Sample] = []
    # Both processes under ``env``: the receiver inherits it when spawned.
    receiver = (Receiver, capacity + misaddress, receiver_host)
    with (
        mock.patch.dict(os.environ, env),
        loopback.Peer(*receiver, deadline_s=DEADLINE_S, netns=netns) as peer,
    ):
        session, remote_addr = peer.call("address")
        remote_addr += misaddress
        sender = loopback.Endpoint(capacity, sender_host)
        source, source_addr = sender.data, sender.base
        source[:] = np.random.default_rng(0).integers(0, 256, capacity, dtype=np.uint8)
        scratch = np.empty(capacity, dtype=np.uint8)
        sock = socket.create_connection((receiver_host, peer.call("socket_port")),
                                        DEADLINE_S, (sender_host, 0))  # fmt: skip
        source_view = memoryview(source)

        def engine_write(src: list[int], dst: list[int], lens: list[int]) -> None:
            if (code := sender.write(session, src, dst, lens)) != 0:
                raise TransferBenchError(f"batch_transfer_sync_write returned {code}")

        orphans = stall_guard.Orphans()

        def chunked_write(src: list[int], dst: list[int], lens: list[int]) -> None:
            outcome = stall_guard.write(sender.engine, session, src, dst, lens,
                                        stall_s=stall_guard.DEFAULT_STALL_S,
                                        may_resend=lambda now: True,
                                        orphans=orphans)  # fmt: skip
            if outcome.status != 0:
                raise TransferBenchError(f"stall_guard.write returned {outcome}")

        def socket_write(size: int) -> None:
            sock.sendall(struct.pack("<Q", size))
            sock.sendall(source_view[:size])
            if sock.recv(1) != b"\x01":
                raise TransferBenchError("socket receiver did not acknowledge")

        # Connection set-up and handshakes are not part of any sample.
        engine_write([source_addr], [remote_addr], [min(sizes)])
        socket_write(min(sizes))

        for size in sorted(sizes):
            want = digest(source, size)
            whole = ([source_addr], [remote_addr], [size])
            kv = kv_descriptors(size, source_addr, remote_addr)
            pieces = chunks(source_addr, remote_addr, size)
            # Per method: its descriptors and one transfer; a method left out
            # does not run at this size.
            ways: dict[str, tuple[int, Callable[[], Any]]] = {
                "engine": (1, partial(engine_write, *whole)),
                "socket": (1, partial(socket_write, size)),
                "memcpy": (1, partial(np.copyto, scratch[:size], source[:size])),
            }
            if len(kv[0]) <= MAX_KV_DESCRIPTORS:
                ways["engine_kv_blocks"] = (len(kv[0]), partial(engine_write, *kv))
            if size >= CHUNK_BYTES:
                ways[CHUNKED_METHOD] = (len(pieces[0]), partial(chunked_write, *pieces))
            plans = [
                (Sample(m, size, max(1, SAMPLE_BYTES // size), descriptors=ways[m][0],
                        env=dict(env) if m == "engine" else {}), ways[m][1])
                for m in methods if m in ways
            ]  # fmt: skip
            # Methods take turns, so a change in the machine's load touches
            # every method alike instead of skewing one ratio.
            for _ in range(repeats):
                for sample, once in plans:
                    memcpy = sample.method == "memcpy"
                    if memcpy:
                        scratch[:size] = 0
                    else:
                        peer.call("clear", size)
                    start = time.perf_counter()
                    for _ in range(sample.repeats_per_sample):
                        once()
                    sample.seconds.append(time.perf_counter() - start)
                    got = digest(scratch, size) if memcpy else peer.call("digest", size)
                    if got != want:
                        raise TransferBenchError(
                            f"{sample.method} at {size} bytes: the receiver's "
                            "bytes differ"
                        )
                    sample.verified = True
            for sample, _ in plans:
                samples.append(sample)
                gbps = sample.median_bps() / 1e9
                n = sample.descriptors
                many = f" ({n} descriptors)" if n > 1 else ""
                progress(f"  {sample.method:<17} {size:>11} B: {gbps:6.2f} GB/s{many}")
        sock.close()
    return samples


def run_tuned(
    sizes: Sequence[int],
    repeats: int = 5,
    progress: Callable[[str], None] = print,
) -> list[Sample]:
    """The engine with ``TUNED_ENV``, for sizes from ``TUNED_MIN_BYTES``."""
    chosen = [size for size in sizes if size >= TUNED_MIN_BYTES]
    if not chosen:
        return []
    samples = run(chosen, repeats, TUNED_ENV, progress, methods=("engine",))
    return [replace(sample, method=TUNED_METHOD) for sample in samples]


@dataclass(frozen=True)
class Comparison:
    size: int
    engine_bps: float
    socket_bps: float
    memcpy_bps: float
    kv_blocks_bps: float | None
    tuned_bps: float | None = None
    # 1 MiB descriptors through stall_guard (the staged path's submission).
    chunked_bps: float | None = None

    @property
    def vs_socket(self) -> float:
        return self.engine_bps / self.socket_bps if self.socket_bps else 0.0

    @property
    def vs_memcpy(self) -> float:
        return self.engine_bps / self.memcpy_bps if self.memcpy_bps else 0.0


def compare(samples: Sequence[Sample]) -> list[Comparison]:
    """Per size: the engine against both ceilings (medians of the samples);
    Comparison's fields in order, the first three needed."""
    by_key = {(s.method, s.size): s.median_bps() for s in samples}
    methods = ("engine", "socket", "memcpy", "engine_kv_blocks", TUNED_METHOD,
               CHUNKED_METHOD)  # fmt: skip
    return [
        Comparison(size, *(by_key.get((m, size)) for m in methods))
        for size in sorted({s.size for s in samples})
        if all((m, size) in by_key for m in methods[:3])
    ]


def to_json(samples: Sequence[Any]) -> list[dict[str, Any]]:
    """Samples, or any dataclass records (bench.hosts_link's rates), as JSON."""
    return [asdict(s) for s in samples]


def from_json(data: Sequence[Mapping[str, Any]]) -> list[Sample]:
    return [Sample(**dict(item)) for item in data]
