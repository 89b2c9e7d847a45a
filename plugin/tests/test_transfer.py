"""A real Mooncake transfer of mixed MLA + GQA blocks between two processes.

The receiver process plays decode, this process plays prefill. Each side is a
PDMooncakeConnectorWorker that registered its own KV caches (upstream's
registration, or the backport); decode's side sends the metadata upstream's
decode sends (MooncakeXferMetadata, msgspec-encoded), and prefill's side turns
it into descriptors with the worker's own addressing (region alignment and
coalescing, logical to kernel block ids, block runs) and sends them with the
worker's _send_blocks. Prefill's blocks and decode's have different ids: the
copied blocks must land byte-identical where decode asked, every other block
of the receiver untouched.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
from deadlines import SPAWN_DEADLINE_S
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from bench.loopback import Peer
from conftest import (
    DRAFT_LAYER,
    MLA_LAYER,
    RecordingEngine,
    make_worker,
    pull_fields,
)
from pd_mooncake import registration
from pd_mooncake.connector import PDMooncakeConnectorWorker

LOGICAL_BLOCKS = 4
RATIO = 2  # a 32-token logical block = two 16-token kernel blocks
KERNEL_BLOCKS = LOGICAL_BLOCKS * RATIO
SHAPES = {MLA_LAYER: (KERNEL_BLOCKS, 16, 96), DRAFT_LAYER: (KERNEL_BLOCKS, 16, 8, 64)}
DEADLINE_S = SPAWN_DEADLINE_S
# Prefill's logical blocks of the request and decode's for the same tokens.
PREFILL_BLOCKS = [1, 3]
DECODE_BLOCKS = [0, 2]


def connector_worker(
    caches: dict[str, torch.Tensor], *, consumer: bool, backport: bool
) -> tuple[Any, RecordingEngine]:
    """A PDMooncakeConnectorWorker (TP 1, PP 1) that registered ``caches``
    with a real TransferEngine through its own register_kv_caches."""
    engine = RecordingEngine()
    # 32-token logical blocks (MLA target, Eagle GQA draft), each served by
    # two 16-token kernel blocks.
    worker = make_worker(
        PDMooncakeConnectorWorker,
        engine,
        backport=backport,
        ratio=RATIO,
        consumer=consumer,
        num_blocks=LOGICAL_BLOCKS,
    )
    worker.tp_size, worker.tp_rank, worker.pp_size = 1, 0, 1
    worker.transfer_topo = SimpleNamespace(local_replicates_kv_cache=False)
    worker.hostname = "127.0.0.1"
    worker.rpc_port = engine.engine.get_rpc_port()
    if not consumer:
        # A producer's registration ends by starting its ZMQ sender listener:
        # not needed to compute and send descriptors.
        worker._start_sender_listener = lambda: None
        worker.is_kv_consumer = True  # nor is a producer's shutdown (__del__)
    worker.register_kv_caches(caches)
    return worker, engine


def pull_metadata(
    worker: Any, blocks: list[list[int]]
) -> upstream.MooncakeXferMetadata:
    """The pull metadata decode's registered ``worker`` sends for request
    ``d-req`` into ``blocks`` (one list per KV cache group), as
    MooncakeConnectorWorker.receive_kv_from_single_worker builds it."""
    return upstream.MooncakeXferMetadata(
        **pull_fields(worker, blocks),
        remote_pp_size=worker.pp_size,
        kv_block_lens=worker.kv_block_len_per_layer,
        registered_layer_names=worker.registered_layer_names,
        registered_layer_indices=worker.registered_layer_indices,
        registered_group_indices=worker.registered_group_indices,
        registered_shared_group_ids=[list(g) for g in worker.region_shared_groups],
        registered_row_offsets=worker.region_row_offsets,
    )


class Decode:
    """Decode's side, in a process of its own: zeroed caches registered by its
    connector worker."""

    def __init__(self, backport: bool) -> None:
        self.caches = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
        self.worker, self.engine = connector_worker(
            self.caches, consumer=True, backport=backport
        )

    def metadata(self) -> bytes:
        blocks = [DECODE_BLOCKS, DECODE_BLOCKS]
        return msgspec.msgpack.encode(pull_metadata(self.worker, blocks))

    def read(self) -> dict[str, bytes]:
        # Plain bytes: tensors would travel as shared memory that dies with us.
        return {name: cache.numpy().tobytes() for name, cache in self.caches.items()}


def build_send(
    worker: Any,
    meta: upstream.MooncakeXferMetadata,
    prefill_blocks: list[int],
    request: str = "d-req",
) -> tuple[list[int], list[int], list[int], list[str], str | None]:
    """Upstream's descriptors for sending prefill's ``prefill_blocks`` (in
    both groups) as decode's ``request`` of pull ``meta``: (sources,
    destinations, lengths, failed requests, error)."""
    local, remote, err = worker._prepare_transfer_regions(meta)
    assert err is None, err
    send_meta = upstream.SendBlockMeta(
        p_req_id="p-req",
        transfer_id="xfer-1",
        local_block_ids=[prefill_blocks, prefill_blocks],
        ready=asyncio.Event(),
    )
    return asyncio.run(
        worker._build_transfer_params([(request, send_meta)], meta, local, remote)
    )


def transfer(
    backport: bool, break_ratio: bool = False
) -> tuple[dict, dict, list[int], list[int], Any]:
    """Send PREFILL_BLOCKS into decode's DECODE_BLOCKS; returns (sent caches,
    received caches, prefill kernel ids, decode kernel ids, the worker)."""
    with Peer(Decode, backport, deadline_s=DEADLINE_S) as decode:
        meta = msgspec.msgpack.decode(
            decode.call("metadata"), type=upstream.MooncakeXferMetadata
        )
        generator = torch.Generator().manual_seed(1)
        caches = {n: torch.randn(s, generator=generator) for n, s in SHAPES.items()}
        worker, engine = connector_worker(caches, consumer=False, backport=backport)
        if break_ratio:
            # Negative control: logical block ids used as kernel block ids.
            worker._physical_blocks_per_logical_kv_block = 1
        src, dst, lens, err_reqs, err_msg = build_send(worker, meta, PREFILL_BLOCKS)
        assert (err_reqs, err_msg) == ([], None)
        worker.engine = engine.engine  # the TransferEngine itself sends
        session = f"{meta.remote_hostname}:{meta.remote_port}"
        assert worker._send_blocks(session, src, dst, lens) == 0
        received = {
            name: torch.frombuffer(bytearray(raw), dtype=torch.float32).view(
                SHAPES[name]
            )
            for name, raw in decode.call("read").items()
        }
    return (
        caches,
        received,
        registration.kernel_block_ids(PREFILL_BLOCKS, RATIO),
        registration.kernel_block_ids(DECODE_BLOCKS, RATIO),
        worker,
    )


def mismatches(
    sent: dict, received: dict, sent_blocks: list[int], landed_blocks: list[int]
) -> list[str]:
    """Decode's block landed_blocks[i] must hold prefill's sent_blocks[i];
    every other block of decode's must still be zero."""
    problems = []
    source = dict(zip(landed_blocks, sent_blocks, strict=True))
    for name in SHAPES:
        for block in range(KERNEL_BLOCKS):
            got = received[name][block]
            if block in source:
                if not torch.equal(got, sent[name][source[block]]):
                    problems.append(
                        f"{name} block {block}: not prefill's block {source[block]}"
                    )
            elif torch.count_nonzero(got):
                problems.append(f"{name} block {block}: touched")
    return problems


@pytest.mark.parametrize("backport", [False, True], ids=["upstream", "backport"])
def test_blocks_arrive_byte_identical_and_nothing_else_is_touched(
    backport: bool,
) -> None:
    sent, received, sent_blocks, landed_blocks, worker = transfer(backport)
    assert sent_blocks == [2, 3, 6, 7] and landed_blocks == [0, 1, 4, 5]
    assert mismatches(sent, received, sent_blocks, landed_blocks) == []
    moved = sum(SHAPES_BYTES_PER_BLOCK.values()) * len(sent_blocks)
    stats = worker.xfer_stats.data
    # The worker's own accounting of the send: one transfer of exactly the
    # request's blocks in both regions.
    assert stats["bytes_transferred"] == [moved]
    print(f"moved {moved} bytes in {stats['num_descriptors']} descriptors")


def test_wrong_block_ratio_is_caught() -> None:
    """Negative control: the worker addressing logical ids as kernel ids
    misplaces KV, and the check notices."""
    sent, received, sent_blocks, landed_blocks, _ = transfer(False, break_ratio=True)
    problems = mismatches(sent, received, sent_blocks, landed_blocks)
    assert problems, "the check did not notice misaddressed blocks"


SHAPES_BYTES_PER_BLOCK = {
    name: torch.zeros(shape[1:]).nbytes for name, shape in SHAPES.items()
}
