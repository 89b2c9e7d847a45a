"""A request longer than decode's staging span crosses through staging in
chunks: every byte through the span, none written into KV blocks directly.

Prefill and decode are each a PDMooncakeConnectorWorker that registered real
KV caches (MLA + GQA draft, 32-token logical blocks of two 16-token kernel
blocks) and a staging buffer with its own real Mooncake TransferEngine on
loopback TCP, the KV checksum on. Decode runs its real pull
(``receive_kv_from_single_worker``) against a ZMQ side channel whose pulls
prefill answers with its real ``send_kv_to_decode``. Every descriptor
prefill's engine is asked to write is recorded: each must lie in decode's
staging buffer. With ``chunk_bytes`` lowered, the request needs more than
one span: it must arrive in exactly the predicted number of chunks, byte
for byte, reported received once; a chunk that fails fails the request and
holds its span back. The negative control puts back the old branch (a pull
over the whole buffer went directly): its descriptors land in KV blocks.
"""

from __future__ import annotations

import asyncio
import math
import queue
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from deadlines import SPAWN_DEADLINE_S
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from conftest import DRAFT_LAYER, MLA_LAYER, RecordingEngine, make_worker
from pd_mooncake import late_writes, send_deadline, staging
from pd_mooncake.connector import PDMooncakeConnectorWorker
from pd_mooncake.staging_worker import StagingWorker

RATIO = 2  # a 32-token logical block = two 16-token kernel blocks
LOGICAL_BLOCKS = 40
KERNEL_BLOCKS = LOGICAL_BLOCKS * RATIO
SHAPES = {MLA_LAYER: (KERNEL_BLOCKS, 16, 96), DRAFT_LAYER: (KERNEL_BLOCKS, 16, 8, 64)}
REQUEST_BLOCKS = 24  # logical: 48 kernel blocks, 1.8 MiB of KV
STAGING_MIB = 1  # both roles' buffer: less than the request
CHUNK_BYTES = 256 << 10  # decode's span per chunk (the test hook)
TRANSFER_ID = "xfer-1"
P_REQ, D_REQ = "p-req", "d-req"
DEADLINE_S = SPAWN_DEADLINE_S


class DescriptorLog:
    """Prefill's real engine, recording every descriptor it is asked to write."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.writes: list[tuple[int, int]] = []  # (destination, bytes)

    def transfer_submit_write(self, session: str, src: int, dst: int, n: int) -> Any:
        self.writes.append((dst, n))
        return self.engine.transfer_submit_write(session, src, dst, n)

    def batch_transfer_sync_write(self, session: str, src, dst, lens) -> int:
        self.writes.extend(zip(dst, lens, strict=True))
        return self.engine.batch_transfer_sync_write(session, src, dst, lens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def worker(caches: dict[str, torch.Tensor], *, consumer: bool) -> Any:
    """A registered worker with the KV checksum and a STAGING_MIB buffer."""
    engine = RecordingEngine()
    w = make_worker(
        PDMooncakeConnectorWorker,
        engine.engine,
        backport=False,
        ratio=RATIO,
        consumer=consumer,
        num_blocks=LOGICAL_BLOCKS,
    )
    w.tp_size, w.tp_rank, w.pp_size = 1, 0, 1
    w.transfer_topo = SimpleNamespace(
        local_replicates_kv_cache=False, handshake_target_ranks=lambda size: [0]
    )
    w.hostname = "127.0.0.1"
    w.rpc_port = engine.engine.get_rpc_port()
    w._encoder = msgspec.msgpack.Encoder()
    w._xfer_meta_decoder = msgspec.msgpack.Decoder(upstream.MooncakeXferMetadata)
    w._xfer_resp_decoder = msgspec.msgpack.Decoder(upstream.MooncakeXferResponse)
    w._install_checksum({"kv_checksum": True})
    w._install_staging({staging.KEY: STAGING_MIB})
    w._install_geometry()
    w._hold = late_writes.DecodeHold(
        decode_wait_s=60.0, prefill_abort_s=60.0, tcp_give_up_s=0.0, room_wait_s=1.0
    )
    if not consumer:
        # A producer's registration ends by starting its ZMQ listener (the
        # test serves the side channel), and its shutdown (__del__) by
        # stopping it.
        w.is_kv_consumer = True
    w.register_kv_caches(caches)
    w.caches = caches  # registered: kept alive with the worker
    # Decode's pull state (upstream's constructor sets it).
    w.liveness_interval_s = 0.0
    w._is_hma_required = False
    w._invalid_block_ids = queue.Queue()
    w._failed_recv_reqs = queue.Queue()
    w.finished_recving_reqs = set()
    w._kv_layout_id, w._acked_layout_peers = 0, set()
    # Prefill's send state.
    w.randomized_ids = False
    w.reqs_need_send = {}
    w.finished_sending_reqs = set()
    return w


async def prefill_ready(prefill: Any, blocks: list[int]) -> None:
    """Prefill's request P_REQ ready to send ``blocks`` (both groups), its
    sends on the running loop."""
    prefill.sender_loop = asyncio.get_running_loop()
    # The plugin's pool (connector._bound_sends): the pull's context, and
    # with it decode's span, travels with each send.
    prefill._sender_executor = send_deadline.SessionExecutor(1)
    for groups in ([], [blocks, blocks]):
        notice = upstream.MooncakeConnectorMetadata()
        notice.reqs_to_send[P_REQ] = (TRANSFER_ID, groups)
        await prefill.record_send_reqs(notice)


def side_channel(decode: Any) -> tuple[zmq.asyncio.Socket, int]:
    """A prefill worker's side channel on loopback: (socket, port)."""
    router = decode.async_zmq_ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    return router, router.bind_to_random_port("tcp://127.0.0.1")


def decode_meta(req_id: str, blocks: list[int], peers: int) -> upstream.PullReqMeta:
    """Decode's pull of TRANSFER_ID into ``blocks`` (both groups), from
    ``peers`` prefill workers (upstream's pull_tasks_count)."""
    meta = upstream.PullReqMeta(
        d_req_id=req_id,
        transfer_id=TRANSFER_ID,
        local_block_ids=[blocks, blocks],
        remote_engine_id="pd-prefill",
        remote_bootstrap_addr="http://127.0.0.1:1",
    )
    meta.pull_tasks_count = peers
    return meta


def run_pull(
    chunk_bytes: int | None,
    fail_at: int | None = None,
    set_up: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Prefill's request (REQUEST_BLOCKS random blocks) pulled by decode into
    other random blocks. ``fail_at``: prefill's send of that sub-pull (0 the
    first) fails; ``set_up`` runs once both workers are built. What
    happened, for the assertions."""
    generator = torch.Generator().manual_seed(5)
    sent = {n: torch.randn(s, generator=generator) for n, s in SHAPES.items()}
    received = {n: torch.zeros(s) for n, s in SHAPES.items()}
    prefill = worker(sent, consumer=False)
    decode = worker(received, consumer=True)
    decode.chunk_bytes = chunk_bytes
    set_up()
    log = DescriptorLog(prefill.engine)
    prefill.engine = log
    mine = random.Random(1).sample(range(LOGICAL_BLOCKS), REQUEST_BLOCKS)
    theirs = random.Random(2).sample(range(LOGICAL_BLOCKS), REQUEST_BLOCKS)
    pulls: list[Any] = []
    sends = [0]
    if fail_at is not None:
        guarded = prefill._stage_send

        def stage(*args: Any) -> Any:
            sends[0] += 1
            if sends[0] == fail_at + 1:
                raise staging.NoRoomError("scripted: this chunk's send fails")
            return guarded(*args)

        prefill._stage_send = stage

    async def go() -> tuple[upstream.PullReqMeta, Any]:
        await prefill_ready(prefill, mine)
        send_meta = prefill.reqs_need_send[TRANSFER_ID]
        router, port = side_channel(decode)

        answering: list[asyncio.Future] = []

        async def serve() -> None:
            while True:
                identity, message = await router.recv_multipart()
                meta = prefill._xfer_meta_decoder.decode(message)
                pulls.append(meta)
                answering.append(
                    asyncio.ensure_future(
                        prefill.send_kv_to_decode(identity, router, meta)
                    )
                )

        serving = asyncio.ensure_future(serve())
        meta = decode_meta(D_REQ, theirs, peers=1)
        try:
            await asyncio.wait_for(
                decode.receive_kv_from_single_worker(
                    f"tcp://127.0.0.1:{port}", {D_REQ: meta}
                ),
                DEADLINE_S,
            )
        finally:
            serving.cancel()
            router.close()
            prefill._sender_executor.shutdown()
        return meta, send_meta

    meta, send_meta = asyncio.run(go())
    kv = [(t.data_ptr(), t.numel() * t.element_size()) for t in received.values()]
    span = (decode._arena.base, decode._arena.size)
    return {
        "meta": meta,
        "send_meta": send_meta,
        "pulls": pulls,
        "writes": log.writes,
        "in_kv": [w for w in log.writes if any(a <= w[0] < a + n for a, n in kv)],
        "in_span": [w for w in log.writes if span[0] <= w[0] < sum(span)],
        "sent": sent,
        "received": received,
        "mine": mine,
        "theirs": theirs,
        "decode": decode,
        "prefill": prefill,
    }


def landed_wrong(run: dict[str, Any]) -> list[str]:
    """Decode's block theirs[i] must hold prefill's mine[i], in every region,
    every other block still zero."""
    problems = []
    kernel = {
        t * RATIO + k: m * RATIO + k
        for m, t in zip(run["mine"], run["theirs"], strict=True)
        for k in range(RATIO)
    }
    for name in SHAPES:
        for block in range(KERNEL_BLOCKS):
            got = run["received"][name][block]
            if block in kernel:
                if not torch.equal(got, run["sent"][name][kernel[block]]):
                    problems.append(f"{name} block {block}")
            elif torch.count_nonzero(got):
                problems.append(f"{name} block {block}: touched")
    return problems


def predicted_chunks(decode: Any) -> int:
    bound = min(CHUNK_BYTES, decode._arena.size)
    per_chunk = staging.chunk_blocks(bound, decode.block_len_per_layer) // RATIO
    return math.ceil(REQUEST_BLOCKS / per_chunk)


def test_a_request_over_the_span_crosses_staging_in_chunks() -> None:
    run = run_pull(CHUNK_BYTES)
    decode, meta = run["decode"], run["meta"]
    whole = staging.span_bound([REQUEST_BLOCKS * RATIO], decode.block_len_per_layer)
    chunks = [p.pd_chunk[D_REQ] for p in run["pulls"]]
    print(
        f"{whole} bytes of request through a {CHUNK_BYTES}-byte span: "
        f"{len(chunks)} chunks {chunks}; {len(run['writes'])} descriptors"
    )
    assert whole > decode._arena.size  # more than the whole buffer
    assert len(chunks) == predicted_chunks(decode) == 8
    # Consecutive runs covering every block, only the last marked last.
    assert [c[0] for c in chunks] == [0, *[c[1] for c in chunks[:-1]]]
    assert chunks[-1][1] == REQUEST_BLOCKS
    assert [c[2] for c in chunks] == [0] * (len(chunks) - 1) + [1]
    assert all(p.pd_staging[1] <= CHUNK_BYTES for p in run["pulls"])
    assert run["writes"] and run["in_span"] == run["writes"]
    assert run["in_kv"] == []
    assert landed_wrong(run) == []
    # Reported received once, after the last chunk, the checksum passed.
    assert not meta.failed and meta.pull_tasks_count == 0
    assert decode.finished_recving_reqs == {D_REQ}
    assert decode._invalid_block_ids.empty()
    assert decode.xfer_stats.data.get("kv_checksum_mismatch", []) == []
    assert len(decode.xfer_stats.data.get("kv_checksum_match", [])) == 2
    # Prefill: sent once, after the last chunk; nothing held on decode.
    assert run["prefill"].finished_sending_reqs == {P_REQ}
    assert TRANSFER_ID not in run["prefill"].reqs_need_send
    assert run["send_meta"].sending == 0
    assert decode._arena.held() == 0


def test_without_the_hook_the_whole_buffer_bounds_a_chunk() -> None:
    run = run_pull(None)
    decode = run["decode"]
    need = staging.span_bound([REQUEST_BLOCKS * RATIO], decode.block_len_per_layer)
    # 1.8 MiB over 1 MiB: chunked by the buffer itself, no hook needed.
    assert need > decode._arena.size
    assert len(run["pulls"]) == predicted_for(decode._arena.size, decode) == 2
    assert run["in_kv"] == [] and landed_wrong(run) == []
    assert decode.finished_recving_reqs == {D_REQ}


def predicted_for(bound: int, decode: Any) -> int:
    per_chunk = staging.chunk_blocks(bound, decode.block_len_per_layer) // RATIO
    return math.ceil(REQUEST_BLOCKS / per_chunk)


def test_a_failed_chunk_fails_the_request_and_holds_its_span() -> None:
    run = run_pull(CHUNK_BYTES, fail_at=2)
    decode, meta = run["decode"], run["meta"]
    print(f"{len(run['pulls'])} sub-pulls; {decode._arena.held()} bytes held")
    assert len(run["pulls"]) == 3  # no chunk pulled after the failed one
    assert meta.failed
    invalid = set().union(*decode._invalid_block_ids.queue)
    assert set(run["theirs"]) <= invalid  # every block, not only the chunk's
    assert decode.finished_recving_reqs == {D_REQ}  # reported (failed) once
    assert decode._arena.held() > 0  # the failed chunk's span
    assert run["in_kv"] == []
    # Prefill never counted the request sent: its blocks wait for expiry.
    assert run["prefill"].finished_sending_reqs == set()
    assert run["send_meta"].sending == 0


def test_negative_control_without_chunks_the_long_pull_went_direct(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old branch put back: a pull over the whole buffer got no span."""

    async def old_offer(self: Any, pull_metas: dict) -> staging.Offer | None:
        need = self._staging_need(pull_metas)
        if not need or need > self._arena.size:
            return None  # "pulled directly, without the late-write protection"
        return await self._staging_room(need)

    monkeypatch.setattr(StagingWorker, "_staging_offer", old_offer)
    monkeypatch.setattr(
        StagingWorker, "_staging_parts", lambda self, pulls: ([pulls], [])
    )
    run = run_pull(None)
    print(f"control: {len(run['in_kv'])} of {len(run['writes'])} into KV blocks")
    assert len(run["pulls"]) == 1 and run["pulls"][0].pd_staging is None
    assert run["in_kv"] == run["writes"] and run["writes"]
    assert landed_wrong(run) == []  # right bytes, by the unprotected path


def test_negative_control_a_chunk_counted_as_the_send_frees_prefills_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefill's guard removed (a chunk before the last counted as the
    request's send): upstream frees the request after the first chunk, and
    the second finds nothing to send; it fails after prefill's wait for a
    request it no longer has (shortened here)."""
    monkeypatch.setattr(
        StagingWorker, "_chunk_not_the_send", staticmethod(lambda meta: None)
    )
    # After start-up, whose check refuses so short a wait.
    run = run_pull(
        CHUNK_BYTES,
        set_up=lambda: monkeypatch.setenv("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "1"),
    )
    print(
        f"control: {len(run['pulls'])} sub-pulls, prefill freed "
        f"{run['prefill'].finished_sending_reqs}"
    )
    assert run["prefill"].finished_sending_reqs == {P_REQ}
    assert len(run["pulls"]) == 2 and run["meta"].failed


def test_prefill_pairs_a_chunk_as_upstream_pairs_a_partial_prefix_hit() -> None:
    """Decode lacks only the last blocks of the prompt (a prefix hit): upstream
    reads prefill's last ``len(remote)`` blocks; a chunk's positions count
    from decode's first block, so its blocks pair as the whole pull's do."""
    prefill = StagingWorker()
    local = [list(range(10, 20))]  # prefill's ten blocks
    remote = [[7, 3, 9, 1, 5, 8]]  # decode asks for the last six
    chunks = [[0, 4, 0], [4, 6, 1]]
    pairs = [prefill._chunk_of(local, remote, c) for c in chunks]
    assert pairs == [([[14, 15, 16, 17]], [[7, 3, 9, 1]]), ([[18, 19]], [[5, 8]])]
    # Lists that do not pair are left to upstream, which reports them.
    assert prefill._chunk_of([[1, 2]], remote, chunks[0]) is None
    assert prefill._chunk_of(local, [*remote, []], chunks[0]) is None
