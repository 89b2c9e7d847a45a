"""A split pull: decode at TP 1 pulls one request from both ranks of a TP 2
prefill (an MLA model: upstream's planner, PR #36869, has rank 0 send the
whole latent and rank 1 send nothing, yet both answer). Each peer's pull
has a span of its own; the rank that sends nothing answers first or last.

What must hold: the KV lands byte for byte through staging, the request is
reported received once, and neither span is held back, whichever rank
answers first: a span is held only where a write to it may still land
(this peer's pull failed, was resent, or got no answer), never because
the request still waits for the other peer. Held, every split pull would
take its spans out of the buffer for the whole hold (1,465 s) and the
buffer would fill after a few dozen requests (measured 2026-12-02 on the
twin, prefill TP 2 -> decode TP 1: 235 of 256 MiB held after ~20 requests,
then pulls failed for room). Also in chunks (a request longer than one
span), where the rank with no bytes answers each chunk without a record.

Prefill's ranks and decode are the chunked-pull test's workers (real
engines, real caches, the checksum off: it needs the same TP on both
sides), with upstream's own TransferTopology for their ranks.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import test_chunked_pull
import torch
from test_chunked_pull import (
    CHUNK_BYTES,
    LOGICAL_BLOCKS,
    P_REQ,
    REQUEST_BLOCKS,
    SHAPES,
    DescriptorLog,
    decode_meta,
    landed_wrong,
    prefill_ready,
    side_channel,
    worker,
)
from test_tp_pairs import topology
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from pd_mooncake.staging_worker import StagingWorker

D_REQ = "d-req"
PREFILL_TP = 2
# Every pull here is in-process on loopback: seconds at most.
DEADLINE_S = 60.0


def prefill_rank(rank: int, caches: dict[str, torch.Tensor]) -> Any:
    w = worker(caches, consumer=False)
    w.tp_rank, w.tp_size = rank, PREFILL_TP
    w.transfer_topo = topology(rank, PREFILL_TP)
    # The checksum compares per-rank digests: it needs the same TP on both
    # sides (tp_pairs), as the geometry does; this test is about spans.
    w.kv_checksum = False
    w.geometry = None
    w.engine = DescriptorLog(w.engine)
    return w


def run_split(
    chunk_bytes: int | None, first: int, refusing: int | None = None
) -> dict[str, Any]:
    """Decode pulls from both prefill ranks at once; ``first``: the rank
    whose answer decode reads first (the other's serving waits for it);
    ``refusing``: a rank that refuses the pull (its answer an error)."""
    generator = torch.Generator().manual_seed(5)
    sent = [
        {n: torch.randn(s, generator=generator) for n, s in SHAPES.items()}
        for _ in range(PREFILL_TP)
    ]
    received = {n: torch.zeros(s) for n, s in SHAPES.items()}
    prefills = [prefill_rank(r, c) for r, c in enumerate(sent)]
    if refusing is not None:
        prefills[refusing]._staging_refusal = lambda meta: "scripted: refused"
    decode = worker(received, consumer=True)
    decode.kv_checksum = False
    decode.geometry = None
    decode.chunk_bytes = chunk_bytes
    mine = random.Random(1).sample(range(LOGICAL_BLOCKS), REQUEST_BLOCKS)
    theirs = random.Random(2).sample(range(LOGICAL_BLOCKS), REQUEST_BLOCKS)
    pulls: list[list[Any]] = [[] for _ in prefills]

    async def go() -> upstream.PullReqMeta:
        routers = []
        # The k-th answer of the other rank waits for the first's k-th.
        answered = asyncio.Semaphore(0)
        for prefill in prefills:
            await prefill_ready(prefill, mine)
            routers.append(side_channel(decode))

        async def serve(rank: int) -> None:
            prefill, (router, _) = prefills[rank], routers[rank]
            while True:
                identity, message = await router.recv_multipart()
                meta = prefill._xfer_meta_decoder.decode(message)
                pulls[rank].append(meta)
                if rank != first:
                    await answered.acquire()
                await prefill.send_kv_to_decode(identity, router, meta)
                if rank == first:
                    answered.release()

        serving = [asyncio.ensure_future(serve(r)) for r in range(PREFILL_TP)]
        meta = decode_meta(D_REQ, theirs, peers=PREFILL_TP)
        shared = {D_REQ: meta}
        tasks = [
            decode.receive_kv_from_single_worker(f"tcp://127.0.0.1:{port}", shared)
            for _, port in routers
        ]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)
        finally:
            for task in serving:
                task.cancel()
            for router, _ in routers:
                router.close()
            for prefill in prefills:
                prefill._sender_executor.shutdown()
        return meta

    meta = asyncio.run(go())
    return {
        "meta": meta,
        "decode": decode,
        "prefills": prefills,
        "pulls": pulls,
        "writes": [p.engine.writes for p in prefills],
        # landed_wrong's view: rank 0's blocks are what must land.
        "sent": sent[0],
        "received": received,
        "mine": mine,
        "theirs": theirs,
    }


# Each peer's pull takes a span of its own at once: with one span each the
# buffer holds two requests' KV (1.8 MiB each); in chunks, two chunks.
LAYOUTS = {"one span": (None, 4), "chunks": (CHUNK_BYTES, 1)}


@pytest.mark.parametrize("first", [0, 1], ids=["sender first", "empty rank first"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_split_pull_lands_once_and_holds_no_span(
    layout: str, first: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunk_bytes, mib = LAYOUTS[layout]
    monkeypatch.setattr(test_chunked_pull, "STAGING_MIB", mib)
    run = run_split(chunk_bytes, first)
    decode, meta = run["decode"], run["meta"]
    print(
        f"pulls per rank {[len(p) for p in run['pulls']]}, descriptors per "
        f"rank {[len(w) for w in run['writes']]}, {decode._arena.held()} bytes "
        f"held, failed={meta.failed}"
    )
    assert run["writes"][0] and run["writes"][1] == []  # rank 1 sends nothing
    assert len(run["pulls"][0]) == len(run["pulls"][1]) > (chunk_bytes is not None)
    assert not meta.failed and meta.pull_tasks_count == 0
    assert landed_wrong(run) == []
    assert decode.finished_recving_reqs == {D_REQ}
    assert decode._invalid_block_ids.empty()
    assert decode._arena.held() == 0
    for prefill in run["prefills"]:
        assert prefill.finished_sending_reqs == {P_REQ}


@pytest.fixture
def one_span(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(test_chunked_pull, "STAGING_MIB", LAYOUTS["one span"][1])


@pytest.mark.usefixtures("one_span")
def test_a_record_is_not_scattered_for_a_request_another_rank_failed() -> None:
    """Rank 1 refuses first (decode fails the request, and vLLM may give its
    blocks to another request at once); rank 0's record then arrives: it
    must not be scattered into those blocks."""
    run = run_split(None, first=1, refusing=1)
    touched = sum(int(torch.count_nonzero(t)) for t in run["received"].values())
    print(f"failed={run['meta'].failed}; {touched} nonzero values in decode's KV")
    assert run["writes"][0]  # rank 0 still wrote its record into its span
    assert run["meta"].failed
    assert touched == 0


@pytest.mark.usefixtures("one_span")
def test_negative_control_without_the_check_the_record_lands_in_failed_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scatter = StagingWorker._staging_scatter

    def unchecked(self: Any, response: Any, pull_metas: dict) -> None:
        failed = [m for m in pull_metas.values() if m.failed]
        for meta in failed:
            meta.failed = False
        try:
            scatter(self, response, pull_metas)
        finally:
            for meta in failed:
                meta.failed = True

    monkeypatch.setattr(StagingWorker, "_staging_scatter", unchecked)
    run = run_split(None, first=1, refusing=1)
    assert run["meta"].failed
    assert landed_wrong(run) == []  # all of rank 0's KV, in the failed blocks
