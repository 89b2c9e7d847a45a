"""get_finished after every engine step (finished_rounds): upstream's
rounds to the worker's event loops run only when a loop recorded something,
else once per SWEEP_S, and what finishes is still reported at once.

The worker's loops are real asyncio loops on their own threads, run by
upstream's ``_async_loop`` as its constructor starts them; get_finished,
fetch_finished_recving_reqs (with block_hold's filter) and
fetch_finished_sending_reqs (with upstream's expiry) are the real ones.
The full constructor needs a running vLLM, so the worker holds only what
those read.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq.asyncio
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from pd_mooncake import finished_rounds
from pd_mooncake.connector import PDMooncakeConnectorWorker
from pd_mooncake.metrics import PDMooncakeStats

STEPS = 2000


class CountingWorker(PDMooncakeConnectorWorker):
    """The connector's worker, its rounds counted where they arrive."""

    rounds = 0

    async def fetch_finished_recving_reqs(self) -> set[str]:
        self.rounds += 1
        return await super().fetch_finished_recving_reqs()

    async def fetch_finished_sending_reqs(self) -> set[str]:
        self.rounds += 1
        return await super().fetch_finished_sending_reqs()


@pytest.fixture(params=["decode", "prefill"])
def worker(request: Any) -> Iterator[CountingWorker]:
    worker = object.__new__(CountingWorker)
    worker.is_kv_consumer = request.param == "decode"
    worker.is_kv_producer = not worker.is_kv_consumer
    worker.tp_rank = 0
    worker.finished_recving_reqs = set()
    worker.finished_sending_reqs = set()
    worker.reqs_need_send = {}
    worker.xfer_stats = PDMooncakeStats()
    # What shutdown() (run by __del__) touches.
    worker.async_zmq_ctx = zmq.asyncio.Context()
    loop = asyncio.new_event_loop()
    worker.receiver_loop = worker.sender_loop = loop
    thread = threading.Thread(target=upstream._async_loop, args=(loop,), daemon=True)
    thread.start()
    yield worker
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def on_loop(worker: CountingWorker, fn: Any, *args: Any) -> None:
    """``fn(*args)`` on the worker's loop thread, as a pull or send records."""
    done = threading.Event()

    def run() -> None:
        fn(*args)
        done.set()

    worker.receiver_loop.call_soon_threadsafe(run)
    assert done.wait(5)


def test_steps_with_nothing_recorded_make_one_round_per_sweep(
    worker: CountingWorker,
) -> None:
    start = time.monotonic()
    reports = [worker.get_finished() for _ in range(STEPS)]
    elapsed = time.monotonic() - start
    assert reports == [(None, None)] * STEPS
    # One round (a loop or two) per sweep begun, the first at once.
    loops = 1 if worker.is_kv_consumer != worker.is_kv_producer else 2
    assert worker.rounds <= loops * (elapsed / finished_rounds.SWEEP_S + 2)


def test_negative_control_upstreams_get_finished_makes_a_round_per_step(
    worker: CountingWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(finished_rounds.FinishedRounds, "get_finished")
    for _ in range(STEPS):
        worker.get_finished()
    assert worker.rounds == STEPS


def test_what_a_loop_recorded_is_reported_at_the_next_step(
    worker: CountingWorker,
) -> None:
    worker.get_finished()  # a round: the next sweep is SWEEP_S away
    before = worker.rounds
    recorded = (
        worker.finished_recving_reqs
        if worker.is_kv_consumer
        else worker.finished_sending_reqs
    )
    on_loop(worker, recorded.add, "req-1")
    sending, recving = worker.get_finished()
    assert (recving if worker.is_kv_consumer else sending) == {"req-1"}
    assert worker.rounds == before + 1
    assert worker.get_finished() == (None, None)


def test_an_expired_send_is_reported_within_a_sweep(worker: CountingWorker) -> None:
    """Upstream's expiry (a request decode never pulled) is a clock's doing:
    no loop records it, so it waits for the next sweep, no longer."""
    if worker.is_kv_consumer:
        pytest.skip("expiry is prefill's")
    worker.get_finished()
    meta = upstream.SendBlockMeta(
        p_req_id="req-2",
        transfer_id="xfer-2",
        local_block_ids=[[1]],
        ready=asyncio.Event(),
        expire_time=time.perf_counter() - 1.0,
    )
    on_loop(worker, worker.reqs_need_send.__setitem__, "xfer-2", meta)
    start = time.monotonic()
    while (sending := worker.get_finished()[0]) is None:
        assert time.monotonic() - start < 5 * finished_rounds.SWEEP_S + 1.0
    assert sending == {"req-2"}
    assert time.monotonic() - start <= finished_rounds.SWEEP_S + 0.5
