"""Decode: a failed direct pull's KV blocks stay out of reuse until no write
prefill submitted for it can land (late_writes, block_hold), against vLLM's
real scheduler.

Prefill's side channel is scripted (real ZMQ, upstream's message types): it
answers the pull with an error, as a send that failed with submissions still
running does (stall_guard.write). Decode's worker runs upstream's pull; its
reports reach vLLM's own Scheduler through get_finished's coroutine
(fetch_finished_recving_reqs) and the invalid-block queue, as the model
runner hands them over. The hold is shortened (a DecodeHold of 0.5 s).
The last two tests land a real Mooncake write late in decode's blocks (a
process of its own) and compare the next request's block byte for byte,
with the hold and without it (the negative control).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_pull_failures import (
    DEADLINE_S,
    ScriptedSideChannel,
    decode_scheduler,
    decode_worker,
    pulls_from,
    remote_request,
    step_reporting,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from pd_mooncake import block_hold, late_writes, metrics, staging
from pd_mooncake.connector import PDMooncakeConnectorWorker

HOLD = late_writes.DecodeHold(
    decode_wait_s=0.3, prefill_abort_s=60.0, tcp_give_up_s=0.2
)


async def step(scheduler: Any, worker: PDMooncakeConnectorWorker) -> Any:
    """One engine step, the worker's reports taken as get_finished takes them
    (fetch_finished_recving_reqs, on the loop the pulls run on)."""
    finished = await worker.fetch_finished_recving_reqs()
    return step_reporting(scheduler, worker, finished)


def free_blocks(scheduler: Any) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


async def failed_direct_pull(
    scheduler: Any, worker: PDMooncakeConnectorWorker
) -> tuple[Any, int]:
    """One request pulled directly (no staging span), failed by prefill's
    error answer; returns it and the blocks vLLM allocated it."""
    request = remote_request(0, 1, max_tokens=4)
    scheduler.add_request(request)
    free_before = free_blocks(scheduler)
    out = await step(scheduler, worker)
    pulls = out.kv_connector_metadata.reqs_to_recv["pd-prefill"]
    for meta in pulls.values():
        meta.pull_tasks_count = 1  # one prefill worker (upstream receive_kv)
    allocated = free_before - free_blocks(scheduler)
    assert allocated >= 2
    prefill = ScriptedSideChannel(
        worker.async_zmq_ctx, [], status=upstream.MooncakeXferResponseStatus.ERROR
    )
    serving = asyncio.ensure_future(prefill.serve())
    await asyncio.wait_for(
        worker.receive_kv_from_single_worker(f"tcp://127.0.0.1:{prefill.port}", pulls),
        DEADLINE_S,
    )
    serving.cancel()
    prefill.sock.close()
    return request, allocated


async def step_through_hold(
    scheduler: Any,
    worker: PDMooncakeConnectorWorker,
    ended: float,
    during: Callable[[], None],
) -> None:
    """Engine steps until the hold (from ``ended``) is nearly over, ``during``
    checked after each; then one step once it has passed."""
    while time.monotonic() - ended < HOLD.span_hold_s - 0.1:
        await step(scheduler, worker)
        during()
        await asyncio.sleep(0.05)
    await asyncio.sleep(max(0.0, ended + HOLD.span_hold_s - time.monotonic()))
    await step(scheduler, worker)


def run(scenario: Any, worker: PDMooncakeConnectorWorker) -> None:
    try:
        asyncio.run(asyncio.wait_for(scenario(), 3 * DEADLINE_S))
    finally:
        worker.async_zmq_ctx.destroy(linger=0)


def test_a_failed_direct_pull_keeps_its_blocks_until_the_hold_has_passed() -> None:
    """kv_load_failure_policy fail: the client's error at once, the blocks
    back only after the hold (counted from the pull's end)."""
    from vllm.v1.request import RequestStatus

    scheduler = decode_scheduler(1)
    worker = decode_worker(interval=0)
    worker._hold = HOLD

    async def scenario() -> None:
        total = free_blocks(scheduler)
        request, allocated = await failed_direct_pull(scheduler, worker)
        ended = time.monotonic()
        await step(scheduler, worker)
        # The failure reached the scheduler: the request is over (the API
        # answers its error now) ...
        assert request.status == RequestStatus.FINISHED_ERROR
        # ... and its blocks are not in the free pool, through the hold.
        assert free_blocks(scheduler) == total - allocated

        def held() -> None:
            assert free_blocks(scheduler) == total - allocated

        await step_through_hold(scheduler, worker, ended, held)
        assert free_blocks(scheduler) == total
        assert "req-0" not in scheduler.requests
        assert len(worker.block_holds) == 0
        # Counted: one hold started, one ended (none left behind).
        counts = worker.xfer_stats.data
        assert counts[metrics.BLOCK_HOLDS] == [1]
        assert counts[metrics.BLOCK_HOLDS_ENDED] == [1]

    run(scenario, worker)


def test_under_recompute_the_request_waits_out_the_hold() -> None:
    """kv_load_failure_policy recompute: recomputing into the request's own
    blocks (or blocks freed for it) before the hold is what a late write
    corrupts; the request stays waiting for its KV, blocks allocated, and
    runs once the hold has passed."""
    from vllm.v1.request import RequestStatus

    scheduler = decode_scheduler(1, policy="recompute")
    worker = decode_worker(interval=0)
    worker._hold = HOLD

    async def scenario() -> None:
        total = free_blocks(scheduler)
        request, allocated = await failed_direct_pull(scheduler, worker)
        ended = time.monotonic()

        def waiting() -> None:
            assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            assert free_blocks(scheduler) == total - allocated

        await step_through_hold(scheduler, worker, ended, waiting)
        await step(scheduler, worker)
        assert request.status == RequestStatus.RUNNING
        assert len(worker.block_holds) == 0

    run(scenario, worker)


def test_a_staged_pull_or_an_unsent_one_holds_no_blocks() -> None:
    """Only a direct pull decode asked prefill for is held: a staged one's
    writes land in its span (held instead), an unsent one has none."""
    worker = decode_worker(interval=0)
    worker._hold = HOLD
    pulls = pulls_from(1, 1)
    offer_token = staging.OFFER.set(staging.Offer(0, 4096, 0))
    try:
        worker._handle_failed_recv(pulls, ["req-0"], "staged")
    finally:
        staging.OFFER.reset(offer_token)
    worker._handle_failed_recv(pulls_from(1, 1), ["req-0"], "never sent")
    assert len(worker.block_holds) == 0
    assert worker.finished_recving_reqs == {"req-0"}


def test_the_table_reports_a_held_request_once_after_upstream_and_the_hold() -> None:
    holds = block_hold.BlockHolds(limit=4)
    holds.hold(["a", "b"], 0.2)
    # Upstream's report of a held request waits; another passes.
    assert holds.filter({"a", "c"}) == ({"c"}, set())
    time.sleep(0.25)
    # Due: "a" (reported) goes, "b" stays until upstream reports it (vLLM
    # 0.33 reports a split pull's request after its last peer settled).
    assert holds.filter(set()) == ({"a"}, {"a"})
    assert holds.filter(set()) == (set(), set())
    assert holds.filter({"b"}) == ({"b"}, {"b"})
    assert len(holds) == 0


def test_a_later_end_only_extends_a_hold() -> None:
    holds = block_hold.BlockHolds(limit=4)
    holds.hold(["a"], 0.3)
    holds.hold(["a"], 0.0)
    assert holds.filter({"a"}) == (set(), set())
    time.sleep(0.35)
    assert holds.filter(set()) == ({"a"}, {"a"})


def test_a_table_past_its_limit_is_logged_not_released(
    caplog: pytest.LogCaptureFixture,
) -> None:
    holds = block_hold.BlockHolds(limit=1)
    holds.hold(["a", "b"], 60.0)
    assert "a hold leaks" in caplog.text
    assert holds.filter({"a", "b"}) == (set(), set())


def test_decode_without_staging_states_the_hold_at_start_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from types import SimpleNamespace

    worker = decode_worker(interval=0)
    # Upstream's default timeouts, the kernel's default retransmits.
    worker._hold = late_writes.DecodeHold.from_env({}, retries2=15)
    for policy in ("fail", "recompute"):
        config = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_load_failure_policy=policy)
        )
        with caplog.at_level("INFO", logger="vllm.pd_mooncake"):
            worker._state_block_hold(config)
    fail, recompute = (r.getMessage() for r in caplog.records[-2:])
    assert "keeps its KV blocks from reuse 1465s" in fail
    assert "recomputed" not in fail
    assert "waits that long before it is recomputed" in recompute
    worker.async_zmq_ctx.destroy(linger=0)


# -- a real Mooncake write landing late ---------------------------------------
# Decode's KV cache is two registered blocks in a process of its own behind a
# real TransferEngine (decode_peer; vLLM's scheduler ids 1 and 2 are its
# blocks 0 and 1); prefill's submission, made before decode failed the pull,
# lands LATE_S after it, through a real TransferEngine from this process.
# The cache has room for one request: the next one gets the failed one's
# blocks as soon as vLLM frees them.

LATE_S = 0.2


def local_request() -> Any:
    """Another request, computed on decode (its prefill writes its blocks)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id="local",
        prompt_token_ids=list(range(100, 120)),  # two blocks, no prefix hit
        sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
        pooling_params=None,
    )


def late_write_into_reused_blocks() -> bytes:
    """Decode's block 0 (the failed request's first block) once the late
    write landed and the next request, whenever vLLM gave it blocks, wrote
    its KV there (decode_peer's canary)."""
    from decode_peer import BLOCK, SENT, Decode

    from conftest import RecordingEngine

    scheduler = decode_scheduler(1, num_blocks=3)
    worker = decode_worker(interval=0)
    worker._hold = HOLD
    decode = Decode()
    prefill = RecordingEngine()
    source = torch.full((BLOCK,), SENT, dtype=torch.uint8)
    prefill.batch_register_memory([source.data_ptr()], [BLOCK])
    other = local_request()

    def owner_writes() -> bool:
        # The forward that computes the other request's prompt writes its
        # blocks: block id 1 is decode's block 0.
        (ids,) = scheduler.kv_cache_manager.get_block_ids(other.request_id)
        if 1 in ids:
            assert decode.ask("reuse") == "reused"
        return bool(ids)

    async def scenario() -> None:
        await failed_direct_pull(scheduler, worker)
        failed = time.monotonic()
        await step(scheduler, worker)  # the failure reaches the scheduler
        scheduler.add_request(other)
        await step(scheduler, worker)
        written = bool(scheduler.kv_cache_manager.get_block_ids("local")[0])
        if written:
            owner_writes()
        await asyncio.sleep(max(0.0, failed + LATE_S - time.monotonic()))
        status = prefill.engine.batch_transfer_sync_write(
            decode.session, [source.data_ptr()], [decode.base], [BLOCK]
        )
        assert status == 0, "the late write did not go through"
        if not written:
            # Held: the late write landed in the failed request's block.
            assert decode.ask("read")[:BLOCK] == bytes([SENT]) * BLOCK
        deadline = time.monotonic() + DEADLINE_S
        while not written:
            assert time.monotonic() < deadline, "never given blocks"
            await asyncio.sleep(0.05)
            await step(scheduler, worker)
            if scheduler.kv_cache_manager.get_block_ids("local")[0]:
                written = owner_writes()

    try:
        run(scenario, worker)
        return decode.ask("read")[:BLOCK]
    finally:
        for ptrs, _ in prefill.registered:
            prefill.batch_unregister_memory(ptrs)
        decode.close()


def test_a_late_write_lands_in_held_blocks_not_in_the_next_requests() -> None:
    from decode_peer import BLOCK, CANARY

    block0 = late_write_into_reused_blocks()
    assert block0 == bytes([CANARY]) * BLOCK


def test_negative_control_without_the_hold_the_late_write_corrupts_the_next_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from decode_peer import BLOCK, SENT

    monkeypatch.setattr(PDMooncakeConnectorWorker, "_hold_blocks", lambda *a: None)
    block0 = late_write_into_reused_blocks()
    assert block0 == bytes([SENT]) * BLOCK, "the late write did not land there"


def test_a_split_pulls_hold_runs_from_its_last_peers_end() -> None:
    """Two prefill workers serve the pull (TP): the first fails it, the
    second's pull ends later and may have written until then; the blocks
    are held from that later end."""
    worker = decode_worker(interval=0)
    worker._hold = HOLD
    pulls = pulls_from(1, 1, peers=2)
    later_s = 0.3
    reported: list[tuple[float, set[str]]] = []

    async def peer_fails() -> None:
        prefill = ScriptedSideChannel(
            worker.async_zmq_ctx, [], status=upstream.MooncakeXferResponseStatus.ERROR
        )
        serving = asyncio.ensure_future(prefill.serve())
        await asyncio.wait_for(
            worker.receive_kv_from_single_worker(
                f"tcp://127.0.0.1:{prefill.port}", pulls
            ),
            DEADLINE_S,
        )
        serving.cancel()
        prefill.sock.close()

    async def scenario() -> None:
        await peer_fails()
        await asyncio.sleep(later_s)
        await peer_fails()
        ended = time.monotonic()
        while time.monotonic() - ended < HOLD.span_hold_s + 0.3:
            finished = await worker.fetch_finished_recving_reqs()
            reported.append((time.monotonic() - ended, finished))
            await asyncio.sleep(0.02)

    run(scenario, worker)
    released = [at for at, finished in reported if "req-0" in finished]
    print(f"released {released} s after the second peer's end")
    assert len(released) == 1
    assert released[0] >= HOLD.span_hold_s
