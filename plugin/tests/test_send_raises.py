"""Prefill: a send that raises leaves nothing held.

Upstream's send_kv_to_decode counts a send in ``SendBlockMeta.sending``
before ``_send_blocks`` and uncounts it only on its normal path
(mooncake_connector.py), and its expiry frees a request's blocks only while
that count is 0 (``fetch_finished_sending_reqs``). The plugin's additions
can raise inside ``_send_blocks`` (the staging gather re-raises a range
outside registered memory), and building the descriptors can raise in
between too. Here a pull runs through upstream's sender task
(``_sender_worker``: decode, send_kv_to_decode, its error answer) on a
PDMooncakeConnectorWorker that registered real KV caches with a real
TransferEngine, the gather or the build made to raise; then the request's
abort timeout passes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import msgspec
import pytest
import torch
from test_transfer import (
    DEADLINE_S,
    PREFILL_BLOCKS,
    SHAPES,
    Decode,
    connector_worker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from bench.loopback import Peer
from pd_mooncake.connector import PDMooncakeConnectorWorker

TRANSFER_ID = "xfer-1"
P_REQ = "p-req"


class Answers:
    """The ROUTER socket's send side: what prefill answered."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.arrived = asyncio.Event()

    async def send_multipart(self, parts: Any, *args: Any, **kwargs: Any) -> None:
        decoder = msgspec.msgpack.Decoder(upstream.MooncakeXferResponse)
        self.sent.append(decoder.decode(parts[1]))
        self.arrived.set()


def prefill() -> Any:
    caches = {n: torch.randn(s) for n, s in SHAPES.items()}
    worker, engine = connector_worker(caches, consumer=False, backport=False)
    worker.engine = engine.engine
    worker.caches = caches  # registered: kept alive with the worker
    worker.randomized_ids = False
    worker.reqs_need_send = {}
    worker.finished_sending_reqs = set()
    worker._encoder = msgspec.msgpack.Encoder()
    worker._xfer_meta_decoder = msgspec.msgpack.Decoder(upstream.MooncakeXferMetadata)
    worker.transfer_topo.handshake_target_ranks = lambda remote_tp_size: [0]
    worker._install_checksum({})
    worker._install_staging({})
    worker.sender_worker_queue = asyncio.Queue()
    return worker


BAD_RANGE = "65536 bytes at 0x1000 are not registered memory"


def raises(*args: Any) -> None:
    raise ValueError(BAD_RANGE)


async def raises_async(*args: Any) -> None:
    raise ValueError(BAD_RANGE)


# Where the send raises, between upstream's count and uncount of it, and the
# plugin's method that guards it (removed for the negative control).
WHERE = {
    # _send_blocks: the staging gather.
    "send": "_send_blocks",
    # Building the descriptors: upstream's, under the checksum's override.
    "build": "_build_transfer_params",
}


def pull_then_expire(
    metadata: bytes, where: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Any, Any, set[str]]:
    """Prefill finishes request P_REQ, decode pulls it, the send raises; then
    its abort timeout passes. (the answer, the send's meta, the exception the
    sender task logged, what the expiry freed)."""
    worker = prefill()
    if where == "send":
        worker._stage_send = raises
    else:
        monkeypatch.setattr(
            upstream.MooncakeConnectorWorker, "_build_transfer_params", raises_async
        )
    logged: list[Any] = []

    async def go() -> tuple[Any, Any, set[str]]:
        worker.sender_loop = asyncio.get_running_loop()
        worker._sender_executor = concurrent.futures.ThreadPoolExecutor(1)
        # The scheduler's two notices: the request allocated, then finished
        # (upstream's update_state_after_alloc, request_finished).
        for blocks in ([], [PREFILL_BLOCKS, PREFILL_BLOCKS]):
            notice = upstream.MooncakeConnectorMetadata()
            notice.reqs_to_send[P_REQ] = (TRANSFER_ID, blocks)
            await worker.record_send_reqs(notice)
        send_meta = worker.reqs_need_send[TRANSFER_ID]
        sock = Answers()
        task = asyncio.ensure_future(worker._sender_worker(sock))
        worker.sender_worker_queue.put_nowait((b"decode", metadata))
        await asyncio.wait_for(sock.arrived.wait(), DEADLINE_S)
        await asyncio.wait_for(worker.sender_worker_queue.join(), DEADLINE_S)
        task.cancel()
        # The abort timeout has passed (upstream sets it at request_finished).
        send_meta.expire_time = 0.0
        freed = await worker.fetch_finished_sending_reqs()
        worker._sender_executor.shutdown()
        return sock.sent[0], send_meta, freed

    original = upstream.logger.error
    upstream.logger.error = lambda msg, *args: logged.append(msg % args)
    try:
        answer, send_meta, freed = asyncio.run(go())
    finally:
        upstream.logger.error = original
    return answer, send_meta, logged, freed


@pytest.fixture(scope="module")
def metadata() -> Any:
    with Peer(Decode, False, deadline_s=DEADLINE_S) as decode:
        yield decode.call("metadata")


@pytest.mark.parametrize("where", WHERE)
def test_a_raising_send_is_reported_failed_and_its_blocks_expire(
    metadata: bytes, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    answer, send_meta, logged, freed = pull_then_expire(metadata, where, monkeypatch)
    assert logged == []
    print(f"answer {answer}; sending {send_meta.sending}; freed {freed}")
    assert answer.status == upstream.MooncakeXferResponseStatus.FINISH
    assert answer.err_reqs == ["d-req"] and not answer.ok_reqs
    assert send_meta.sending == 0
    assert freed == {P_REQ}


@pytest.mark.parametrize("where", WHERE)
def test_negative_control_a_raise_pins_the_request_for_good(
    metadata: bytes, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard removed: the exception reaches upstream's sender task."""
    worker_cls = PDMooncakeConnectorWorker
    if where == "send":
        monkeypatch.setattr(worker_cls, "_send_blocks", worker_cls._write_blocks)
    else:
        monkeypatch.delattr(worker_cls, WHERE[where])
    answer, send_meta, logged, freed = pull_then_expire(metadata, where, monkeypatch)
    print(f"control: answer {answer}; sending {send_meta.sending}; logged {logged}")
    assert answer.status == upstream.MooncakeXferResponseStatus.ERROR
    assert any(BAD_RANGE in line for line in logged)
    assert send_meta.sending == 1
    assert freed == set(), "the expiry freed the request anyway"
