"""With staging on, no write goes into decode's KV blocks directly.

A direct write lands in decode's blocks, and one that lands late (after a
failed pull, TCP retransmits: late_writes) lands in blocks decode gave to
another request. Staged, it lands in a span decode holds back. So where
staging cannot take a pull or a send, it fails with a reason:

- decode, no room in its staging buffer (spans held back for late writes):
  the pull waits up to ``room_wait_s`` for one, then fails unsent; upstream's
  pull runs over real ZMQ against a recording side channel;
- prefill, a record that does not fit decode's span: the send fails; the
  plugin's real ``_send_blocks`` writes through a real Mooncake
  TransferEngine to decode's registered blocks in its own process, compared
  byte for byte.

Each with a negative control: the guard removed (today's fallback to the
direct path), the unprotected write happens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from decode_peer import BLOCK, DEADLINE_S, SENT, Decode
from test_pull_failures import decode_worker

from conftest import RecordingEngine, pull_meta
from pd_mooncake import late_writes, send_deadline, staging, stall_guard, wire
from pd_mooncake.connector import PDMooncakeConnectorWorker
from pd_mooncake.metrics import PDMooncakeStats
from pd_mooncake.staging_worker import StagingWorker

# Decode's KV block in the pull tests (the pull names blocks 4 and 5).
KV_BLOCK = 4096 + 512
ROOM_WAIT_S = 0.5


def direct_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard removed on decode: what _staging_offer did before, the pull
    sent without a span when there is no room."""

    async def offer(self: Any, pull_metas: dict) -> staging.Offer | None:
        if self._arena is None or not self._staging_need(pull_metas):
            return None
        try:
            return self._staging_reserve(pull_metas)
        except staging.NoRoomError:
            return None

    monkeypatch.setattr(StagingWorker, "_staging_offer", offer)


class RecordingSideChannel:
    """Prefill's side channel: records the pull it receives and answers it
    FINISH with every request done, having sent nothing (as a prefill rank
    that upstream's plan gives no bytes answers a staged pull)."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.pulls: list[wire.XferMetadata] = []

    async def serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(wire.XferMetadata)
        while True:
            identity, message = await self.sock.recv_multipart()
            pull = decoder.decode(message)
            self.pulls.append(pull)
            answer = wire.XferResponse(
                status=wire.upstream.MooncakeXferResponseStatus.FINISH,
                ok_reqs=list(pull.req_blocks),
                pd_staging_empty=pull.pd_staging is not None,
            )
            await self.sock.send_multipart(
                [identity, msgspec.msgpack.Encoder().encode(answer)]
            )


def staging_decode() -> PDMooncakeConnectorWorker:
    """decode_worker's pull state with a 1 MiB staging buffer, installed and
    registered as the connector does (the encoder adds the offered span)."""
    worker = decode_worker(interval=0)
    worker._install_staging({staging.KEY: 1})
    worker._hold = late_writes.DecodeHold(
        decode_wait_s=60.0,
        prefill_abort_s=60.0,
        tcp_give_up_s=0.0,
        room_wait_s=ROOM_WAIT_S,
    )
    worker.device_kv_caches = {"layer": torch.zeros(64 * KV_BLOCK, dtype=torch.uint8)}
    worker.engine = SimpleNamespace(register_memory=lambda ptr, n: 0)
    worker.block_len_per_layer = [KV_BLOCK]
    worker._logical_to_kernel_block_ids = lambda ids: ids
    worker._register_staging()
    return worker


def pull_with_buffer(
    worker: PDMooncakeConnectorWorker, free_after_s: float | None, notice: bool = False
) -> tuple[dict, list[wire.XferMetadata], float]:
    """Decode's pull of d-1 with its whole staging buffer taken: held back
    for late writes (``free_after_s`` None), or by a pull in flight that ends
    after ``free_after_s``; with ``notice``, a rejected request's release
    notice in the same pull. (pull_metas, the pulls prefill received, the
    pull's seconds)."""
    arena = worker._arena
    taken = arena.reserve(arena.size)
    assert taken == 0
    if free_after_s is None:
        arena.release(taken, arena.size, hold_s=3600.0)
    pulls = pull_meta("127.0.0.1:1", tasks=1)
    if notice:
        (meta,) = pull_meta("127.0.0.1:1", tasks=1).values()
        meta.d_req_id, meta.transfer_id, meta.local_block_ids = "d-notice", "x-2", []
        pulls["d-notice"] = meta

    async def scenario() -> float:
        prefill = RecordingSideChannel(worker.async_zmq_ctx)
        serving = asyncio.ensure_future(prefill.serve())
        if free_after_s is not None:
            asyncio.get_running_loop().call_later(
                free_after_s, arena.release, taken, arena.size
            )
        start = time.monotonic()
        try:
            await asyncio.wait_for(
                worker.receive_kv_from_single_worker(
                    f"tcp://127.0.0.1:{prefill.port}", pulls
                ),
                DEADLINE_S,
            )
        finally:
            serving.cancel()
            prefill.sock.close()
        recorded.extend(prefill.pulls)
        return time.monotonic() - start

    recorded: list[wire.XferMetadata] = []
    try:
        took = asyncio.run(scenario())
    finally:
        worker.async_zmq_ctx.destroy(linger=0)
    return pulls, recorded, took


def test_a_pull_with_no_room_fails_unsent_after_its_wait() -> None:
    worker = staging_decode()
    pulls, sent, took = pull_with_buffer(worker, free_after_s=None)
    print(f"pull failed after {took:.2f}s; prefill received {len(sent)} pulls")
    assert sent == []  # nothing asked of prefill, so nothing written
    assert pulls["d-1"].failed
    assert {4, 5} <= set().union(*worker._invalid_block_ids.queue)
    assert ROOM_WAIT_S <= took < ROOM_WAIT_S + 2.0


def test_a_pull_waits_for_room_and_goes_staged() -> None:
    worker = staging_decode()
    pulls, sent, took = pull_with_buffer(worker, free_after_s=ROOM_WAIT_S / 3)
    print(f"pull done after {took:.2f}s; its span {sent[0].pd_staging}")
    assert len(sent) == 1 and sent[0].pd_staging is not None
    assert not pulls["d-1"].failed
    assert took >= ROOM_WAIT_S / 3


def test_negative_control_a_pull_with_no_room_went_direct(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    direct_when_full(monkeypatch)
    worker = staging_decode()
    _, sent, _ = pull_with_buffer(worker, free_after_s=None)
    print(f"control: prefill received {len(sent)} pulls, span {sent[0].pd_staging}")
    # Sent without a span: prefill writes into decode's blocks directly.
    assert len(sent) == 1 and sent[0].pd_staging is None


def test_a_release_notice_in_a_pull_with_no_room_still_reaches_prefill() -> None:
    """A rejected request's notice (no blocks: prefill only frees its own)
    rides in the same pull as requests with blocks: those fail unsent, the
    notice still goes."""
    worker = staging_decode()
    pulls, sent, _ = pull_with_buffer(worker, free_after_s=None, notice=True)
    print(f"prefill received {[list(p.req_blocks) for p in sent]}")
    assert [list(p.req_blocks) for p in sent] == [["d-notice"]]
    assert sent[0].pd_staging is None  # nothing to write, no span
    assert pulls["d-1"].failed and not pulls["d-notice"].failed


def fail_whole_pull(self: Any, pull_metas: dict, exc: Exception) -> dict:
    """The split removed: every request of a pull with no room failed."""
    self._handle_failed_recv(pull_metas, list(pull_metas), str(exc))
    return {}


def test_negative_control_without_the_split_the_notice_is_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(PDMooncakeConnectorWorker, "_fail_unstaged", fail_whole_pull)
    worker = staging_decode()
    _, sent, _ = pull_with_buffer(worker, free_after_s=None, notice=True)
    assert sent == []  # prefill holds the rejected request until its timeout


def test_a_pull_larger_than_the_whole_buffer_is_pulled_in_chunks_that_fit() -> None:
    """No wait for room that can never come, and no direct pull: chunks of
    the request, each within the buffer, covering every block once."""
    worker = staging_decode()
    pulls = pull_meta("127.0.0.1:1", tasks=1)
    blocks = list(range(300))  # 300 blocks > 1 MiB
    pulls["d-1"].local_block_ids = [blocks]
    assert worker._staging_need(pulls) > worker._arena.size
    parts, long = worker._staging_parts(pulls)
    assert (parts, long) == ([], ["d-1"])
    chunks = worker._staging_chunks("d-1", [blocks])
    per_chunk = staging.chunk_blocks(worker._arena.size, [KV_BLOCK])
    print(f"{len(chunks)} chunks of at most {per_chunk} blocks")
    assert len(chunks) == -(-300 // per_chunk)
    assert [c.start for c in chunks] == [0, *(c.stop for c in chunks[:-1])]
    assert chunks[-1].stop == 300 and [c.last for c in chunks].count(True) == 1
    for chunk in chunks:
        part = worker._chunk_blocks([blocks], chunk, [False])
        assert worker._groups_need([part]) <= worker._arena.size
    assert worker._arena.held() == 0


def test_a_pull_of_many_requests_over_the_buffer_goes_as_pulls_that_fit() -> None:
    """Requests that each fit, together not: pulls of whole requests, every
    one once and in order (a release notice too), each within the buffer."""
    worker = staging_decode()
    pulls: dict = {}
    for i in range(5):
        (meta,) = pull_meta("127.0.0.1:1", tasks=1).values()
        meta.d_req_id = f"d-{i}"
        meta.local_block_ids = [list(range(80 * i, 80 * i + 80))]
        pulls[meta.d_req_id] = meta
    (notice,) = pull_meta("127.0.0.1:1", tasks=1).values()
    notice.local_block_ids = []
    pulls["d-notice"] = notice
    assert worker._staging_need(pulls) > worker._arena.size
    parts, long = worker._staging_parts(pulls)
    print(f"parts {[list(p) for p in parts]}")
    assert long == [] and len(parts) > 1
    assert [r for p in parts for r in p] == list(pulls)
    assert all(worker._staging_need(p) <= worker._arena.size for p in parts)


# -- prefill: a record that does not fit decode's span -----------------------------


@pytest.fixture(scope="module")
def decode() -> Iterator[Decode]:
    peer = Decode()
    yield peer
    peer.close()


# A send of a quarter block: its record (one header page, then the bytes)
# fits decode's block 1, which plays decode's span.
SEND = BLOCK // 4


def fits_or_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard removed on prefill: a record that does not fit the span's
    rest was sent directly (what _stage_send did before)."""
    guarded = StagingWorker._stage_send

    def stage(self: Any, src: Any, dst: Any, lengths: Any, *args: Any) -> Any:
        try:
            return guarded(self, src, dst, lengths, *args)
        except staging.NoRoomError:
            return None

    monkeypatch.setattr(StagingWorker, "_stage_send", stage)


def send_into(decode: Decode, span_bytes: int) -> tuple[int, bytes, bytes]:
    """Prefill's real send of SEND bytes for decode's block 0, decode having
    offered block 1 (``span_bytes`` of it) as the pull's span. (status,
    decode's block 0, its block 1, read once the send returned)."""
    assert decode.ask("zero") == "zeroed"
    real = RecordingEngine()
    source = torch.full((BLOCK,), SENT, dtype=torch.uint8)
    buffer = torch.zeros(4 * BLOCK, dtype=torch.uint8)
    real.batch_register_memory(
        [source.data_ptr(), buffer.data_ptr()], [BLOCK, buffer.numel()]
    )
    worker = object.__new__(PDMooncakeConnectorWorker)
    worker.engine = real.engine
    worker.xfer_stats = PDMooncakeStats()
    worker.stall_s = stall_guard.DEFAULT_STALL_S
    worker.send_timeouts = send_deadline.SendTimeouts(
        prefill_abort_s=0.0, decode_wait_s=60.0, attempt_s=5.0, margin_s=0.5
    )
    worker._arena = staging.Arena(buffer)
    worker._kv_memory = staging.Memory([source])
    worker._staging_memory = staging.Memory([buffer])
    target = staging.Target(decode.base + BLOCK, span_bytes, nonce=7)

    def send() -> int:
        send_deadline.PULL_CLOCK.set(send_deadline.PullClock(time.monotonic()))
        staging.TARGET.set(target)
        return worker._send_blocks(
            decode.session, [source.data_ptr()], [decode.base], [SEND]
        )

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            status = pool.submit(send).result(timeout=DEADLINE_S)
        blocks = decode.ask("read")
    finally:
        for ptrs, _ in real.registered:
            real.batch_unregister_memory(ptrs)
    return status, blocks[:BLOCK], blocks[BLOCK:]


def test_a_record_that_fits_lands_in_the_span_only(decode: Decode) -> None:
    status, block0, span = send_into(decode, span_bytes=BLOCK)
    assert status == 0
    assert block0 == bytes(BLOCK)  # decode's scatter copies it, not prefill
    head = staging.head_bytes(1)
    assert span[head : head + SEND] == bytes([SENT]) * SEND


def test_a_record_larger_than_the_spans_rest_fails_unsent(decode: Decode) -> None:
    status, block0, span = send_into(decode, span_bytes=SEND)
    assert status == -1
    assert block0 == bytes(BLOCK) and span == bytes(BLOCK)


def test_negative_control_a_record_larger_than_the_spans_rest_went_direct(
    decode: Decode, monkeypatch: pytest.MonkeyPatch
) -> None:
    fits_or_direct(monkeypatch)
    status, block0, _ = send_into(decode, span_bytes=SEND)
    assert status == 0
    # Into decode's KV block, by the network: the unprotected path.
    assert block0[:SEND] == bytes([SENT]) * SEND


# -- Mooncake's refusal, as stall_guard reads it -----------------------------------


def test_mooncake_refuses_a_submission_to_a_gone_peer_with_not_submitted() -> None:
    """stall_guard.NOT_SUBMITTED is what the real engine returns when it
    cannot submit (Mooncake 0.3.13's transfer_submit_write: 0, where its
    batch call returns -1); any other value would be polled as a batch id."""
    real = RecordingEngine()
    source = torch.zeros(4096, dtype=torch.uint8)
    real.batch_register_memory([source.data_ptr()], [source.numel()])
    try:
        got = real.engine.transfer_submit_write(
            f"127.0.0.1:{closed_port()}", source.data_ptr(), 0x1000, 64
        )
    finally:
        real.batch_unregister_memory([source.data_ptr()])
    assert got == stall_guard.NOT_SUBMITTED


def closed_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prefill_waits_for_room_in_its_buffer_while_decode_still_waits() -> None:
    """Prefill's buffer full (records of other sends being written): a send
    waits for room while its attempt could still end in decode's wait
    (``may_wait``), else fails; it is never written directly."""
    source = torch.full((BLOCK,), SENT, dtype=torch.uint8)
    worker = StagingWorker()
    worker._arena = staging.Arena(torch.zeros(2 * BLOCK, dtype=torch.uint8))
    worker._kv_memory = staging.Memory([source])
    worker._staging_memory = staging.Memory([worker._arena.buffer])
    worker.xfer_stats = SimpleNamespace(record_staging=lambda phase, seconds: None)
    staging.TARGET.set(staging.Target(0x1000, BLOCK, nonce=7))
    args = ([source.data_ptr()], [0x2000], [SEND])
    taken = worker._arena.reserve(worker._arena.size)
    with pytest.raises(staging.NoRoomError, match="prefill's staging buffer"):
        worker._stage_send(*args, may_wait=lambda now: False)
    threading.Timer(0.2, worker._arena.release, (taken, worker._arena.size)).start()
    start = time.monotonic()
    staged = worker._stage_send(*args, may_wait=lambda now: True)
    assert staged is not None and time.monotonic() - start >= 0.2
