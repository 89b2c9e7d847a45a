"""Decode: a pull whose prefill goes away, against vLLM's real scheduler.

A pull carries several requests; prefill answers CONTINUE for those that are
ready, then dies. The liveness probe (reliability.prefill_gone) must fail
only the requests still outstanding: one already loaded has been reported
finished, and vLLM's scheduler may have run and freed it since.

The scheduler is vLLM's own (``vllm.v1.core.sched.scheduler.Scheduler`` with
this plugin's connector in the ``kv_consumer`` role, the tiny model's real
config); the decode worker runs upstream's pull coroutine over real ZMQ on
127.0.0.1. Prefill's side channel is scripted (real ZMQ, upstream's message
types): a prefill that answers one CONTINUE and then dies mid-pull cannot be
produced on demand with a real prefill engine in a unit test.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from conftest import REGISTRATION_STATE, pull_worker
from conftest import timed_pull as conftest_timed_pull
from pd_mooncake import reliability
from pd_mooncake.connector import PDMooncakeConnectorWorker
from pd_mooncake.pull import LOADED

MODEL_DIRS = sorted(
    Path.home().glob(".cache/pd-mooncake/models/pd-tiny-dsv2-eagle3-*/target")
)
PROMPT_TOKENS = 32  # two 16-token blocks per request
DEADLINE_S = 20.0


# -- vLLM's scheduler, decode role -----------------------------------------------


def decode_scheduler(
    bootstrap_port: int, policy: str = "fail", num_blocks: int = 64
) -> Any:
    """``policy``: decode's kv_load_failure_policy; ``num_blocks``: its KV
    cache's (one is vLLM's null block)."""
    if not MODEL_DIRS:
        pytest.skip("tiny model not built (python -m pdstack.tiny_model)")
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(
        model=str(MODEL_DIRS[-1]),
        max_model_len=512,
        dtype="float32",
        skip_tokenizer_init=True,
    )
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=16),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=2048,
            max_num_seqs=16,
            max_model_len=512,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PDMooncakeConnector",
            kv_role="kv_consumer",
            kv_connector_extra_config={"mooncake_protocol": "tcp"},
            kv_load_failure_policy=policy,
        ),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    # One group: upstream then reports a failed load as invalid blocks.
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32
    )
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    return Scheduler(config, kv, StructuredOutputManager(config), block_size=16)


def remote_request(index: int, bootstrap_port: int, max_tokens: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "pd-prefill",
        "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap_port}",
        "transfer_id": f"xfer-{index}",
    }
    sampling = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args={"kv_transfer_params": params},
    )
    return Request(
        request_id=f"req-{index}",
        prompt_token_ids=list(range(1, PROMPT_TOKENS + 1)),
        sampling_params=sampling,
        pooling_params=None,
    )


def step(scheduler: Any, worker: PDMooncakeConnectorWorker) -> Any:
    """One engine step: schedule, "run" (one sampled token per scheduled
    request), and hand the worker's transfer results back, as vLLM's model
    runner does (kv_connector_model_runner_mixin)."""
    finished = worker.finished_recving_reqs
    worker.finished_recving_reqs = set()
    return step_reporting(scheduler, worker, finished)


def step_reporting(
    scheduler: Any, worker: PDMooncakeConnectorWorker, finished: set[str]
) -> Any:
    """One engine step with ``finished`` as the requests the worker reports
    received (and its load errors)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    result = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=KVConnectorOutput(
            finished_recving=finished or None,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
        ),
    )
    scheduler.update_from_output(out, result)
    return out


# -- decode worker: upstream's pull, over real ZMQ --------------------------------


def start_pull(
    worker: PDMooncakeConnectorWorker, prefill: ScriptedSideChannel, pulls: dict
) -> tuple[asyncio.Future, asyncio.Future]:
    """The scripted prefill serving, and decode's pull from it under way."""
    serving = asyncio.ensure_future(prefill.serve())
    pull = asyncio.ensure_future(
        worker.receive_kv_from_single_worker(f"tcp://127.0.0.1:{prefill.port}", pulls)
    )
    return serving, pull


def decode_worker(interval: float) -> PDMooncakeConnectorWorker:
    """The state upstream's receive_kv_from_single_worker and its failure
    path read (the full constructor needs a running vLLM)."""
    worker = pull_worker(interval)
    worker.hostname, worker.rpc_port = "127.0.0.1", 1
    worker.tp_size, worker.tp_rank, worker.pp_size = 1, 0, 1
    for name in REGISTRATION_STATE:
        setattr(worker, name, [])
    # vLLM 0.33's layout exchange: 0 is no layout id (the layout is sent).
    worker._kv_layout_id, worker._acked_layout_peers = 0, set()
    worker.async_zmq_ctx = zmq.asyncio.Context()
    worker._encoder = msgspec.msgpack.Encoder()
    worker._xfer_resp_decoder = msgspec.msgpack.Decoder(upstream.MooncakeXferResponse)
    return worker


class ScriptedSideChannel:
    """Prefill's side channel: answers once (CONTINUE unless ``status``) with
    ``ready`` requests sent and ``failed`` ones failed, then never again (the
    process died with the rest)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        ready: list[str],
        failed: list[str] | None = None,
        status: Any = upstream.MooncakeXferResponseStatus.CONTINUE,
    ) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.ready = ready
        self.failed = failed
        self.status = status
        self.answered = asyncio.Event()

    async def serve(self) -> None:
        identity, _ = await self.sock.recv_multipart()
        response = upstream.MooncakeXferResponse(
            status=self.status,
            ok_reqs=self.ready,
            err_reqs=self.failed,
            err_msg="scripted failure" if self.failed else None,
        )
        await self.sock.send_multipart(
            [identity, msgspec.msgpack.Encoder().encode(response)]
        )
        self.answered.set()


@pytest.fixture
def bootstrap() -> Iterator[socket.socket]:
    """Prefill's bootstrap port while prefill lives (a listening socket is all
    the probe sees); the test closes it when prefill dies."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield listener
    listener.close()


async def until(predicate: Any, deadline_s: float, what: str) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"not within {deadline_s}s: {what}")
        await asyncio.sleep(0.02)


def test_a_dead_prefill_fails_only_the_pulls_still_outstanding(
    bootstrap: socket.socket,
) -> None:
    from vllm.v1.request import RequestStatus

    port = bootstrap.getsockname()[1]
    scheduler = decode_scheduler(port)
    worker = decode_worker(interval=0.2)
    # req-0 finishes at its first token, req-1 keeps running, req-2's KV never
    # comes.
    requests = [remote_request(i, port, max_tokens=t) for i, t in enumerate((1, 8, 8))]
    for request in requests:
        scheduler.add_request(request)

    async def scenario() -> None:
        out = step(scheduler, worker)
        pulls = out.kv_connector_metadata.reqs_to_recv["pd-prefill"]
        assert sorted(pulls) == ["req-0", "req-1", "req-2"]
        for meta in pulls.values():
            meta.pull_tasks_count = 1  # one prefill worker (upstream receive_kv)
        prefill = ScriptedSideChannel(worker.async_zmq_ctx, ["req-0", "req-1"])
        serving, pull = start_pull(worker, prefill, pulls)
        await asyncio.wait_for(prefill.answered.wait(), DEADLINE_S)
        await until(
            lambda: worker.finished_recving_reqs == {"req-0", "req-1"},
            DEADLINE_S,
            "CONTINUE processed",
        )
        # The scheduler moves on: req-0 and req-1 run; req-0 finishes.
        for _ in range(3):
            step(scheduler, worker)
        assert "req-0" not in scheduler.requests
        assert requests[1].status == RequestStatus.RUNNING
        # Prefill dies: its bootstrap port refuses from now on.
        bootstrap.close()
        await asyncio.wait_for(pull, DEADLINE_S)
        serving.cancel()
        prefill.sock.close()
        print(
            f"after the refusals: finished {sorted(worker.finished_recving_reqs)}, "
            f"invalid blocks {list(worker._invalid_block_ids.queue)}"
        )
        # The report reaches the scheduler; today's code trips
        # `assert req_id in self.requests` here (req-0 is gone).
        step(scheduler, worker)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 3 * DEADLINE_S))
    finally:
        worker.async_zmq_ctx.destroy(linger=0)
    assert requests[2].status == RequestStatus.FINISHED_ERROR
    assert requests[1].status == RequestStatus.RUNNING
    assert requests[1].num_computed_tokens > PROMPT_TOKENS - 1
    assert worker.xfer_stats.data["num_failed_recvs"] == [1]  # req-2 only


# -- the pull's own bookkeeping, without vLLM's scheduler ------------------------
# These run on vLLM 0.33.0's source too (make test-compat): 0.33 settles each
# peer's pull from a copy of pull_metas, 0.32 from pull_metas itself.


def pulls_from(
    port: int, count: int, peers: int = 1
) -> dict[str, upstream.PullReqMeta]:
    """Decode's pull of ``count`` requests (two blocks each) from ``peers``
    prefill workers (upstream receive_kv sets pull_tasks_count to that)."""
    metas = {}
    for i in range(count):
        meta = upstream.PullReqMeta(
            d_req_id=f"req-{i}",
            transfer_id=f"xfer-{i}",
            local_block_ids=[[2 * i + 1, 2 * i + 2]],
            remote_engine_id="pd-prefill",
            remote_bootstrap_addr=f"http://127.0.0.1:{port}",
        )
        meta.pull_tasks_count = peers
        metas[meta.d_req_id] = meta
    return metas


def test_a_dead_prefill_settles_each_request_once(bootstrap: socket.socket) -> None:
    """Prefill answers req-0 loaded and req-1 failed in one CONTINUE, then
    dies; req-2's KV never comes. Each request is reported finished exactly
    once (a second report of req-1, after an engine step took the first, is
    what 0.33's copy turns the probe's old bookkeeping into), only the failed
    ones' blocks are invalid, req-0 carries the loaded mark the staging span's
    release reads, and the pull_metas every peer shares keeps its requests."""
    port = bootstrap.getsockname()[1]
    worker = decode_worker(interval=0.2)
    pulls = pulls_from(port, 3)
    reported: collections.Counter[str] = collections.Counter()

    async def scenario() -> None:
        prefill = ScriptedSideChannel(worker.async_zmq_ctx, ["req-0"], failed=["req-1"])
        serving, pull = start_pull(worker, prefill, pulls)
        await asyncio.wait_for(prefill.answered.wait(), DEADLINE_S)
        await until(
            lambda: worker.finished_recving_reqs == {"req-0", "req-1"},
            DEADLINE_S,
            "CONTINUE processed",
        )
        # An engine step takes the report.
        reported.update(worker.finished_recving_reqs)
        worker.finished_recving_reqs = set()
        bootstrap.close()  # prefill dies
        await asyncio.wait_for(pull, DEADLINE_S)
        reported.update(worker.finished_recving_reqs)
        serving.cancel()
        prefill.sock.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 3 * DEADLINE_S))
    finally:
        worker.async_zmq_ctx.destroy(linger=0)
    invalid = set().union(*worker._invalid_block_ids.queue)
    print(f"reported finished {dict(reported)}, invalid blocks {sorted(invalid)}")
    assert reported == {"req-0": 1, "req-1": 1, "req-2": 1}
    assert invalid == {3, 4, 5, 6}  # req-1's and req-2's, never req-0's
    assert getattr(pulls["req-0"], LOADED, False)
    assert not pulls["req-0"].failed
    assert list(pulls) == ["req-0", "req-1", "req-2"]


def test_with_two_prefill_workers_a_dead_one_settles_its_part_once(
    bootstrap: socket.socket,
) -> None:
    """The same death with two prefill workers (prefill TP2): only the dead
    worker's pull runs here, so each request must keep the other worker's
    part to settle (pull_tasks_count 1 on 0.33, which counts failures down;
    0.32 counts only loads). A second settlement by the dead worker's pull
    would count it to 0 and report it finished while the other worker may
    still write into its blocks."""
    port = bootstrap.getsockname()[1]
    worker = decode_worker(interval=0.2)
    pulls = pulls_from(port, 3, peers=2)

    async def scenario() -> None:
        prefill = ScriptedSideChannel(worker.async_zmq_ctx, ["req-0"], failed=["req-1"])
        serving, pull = start_pull(worker, prefill, pulls)
        await asyncio.wait_for(prefill.answered.wait(), DEADLINE_S)
        await until(
            lambda: pulls["req-0"].pull_tasks_count == 1, DEADLINE_S, "CONTINUE"
        )
        bootstrap.close()
        await asyncio.wait_for(pull, DEADLINE_S)
        serving.cancel()
        prefill.sock.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 3 * DEADLINE_S))
    finally:
        worker.async_zmq_ctx.destroy(linger=0)
    counts = {r: m.pull_tasks_count for r, m in pulls.items()}
    print(f"left to settle {counts}, finished {worker.finished_recving_reqs}")
    assert all(count >= 1 for count in counts.values())
    assert list(pulls) == ["req-0", "req-1", "req-2"]
    if hasattr(upstream.MooncakeConnectorWorker, "_complete_pull_task"):
        # 0.33: a request is reported once every worker settled its part;
        # 0.32 reports a failure at once (its own bookkeeping, unchanged).
        assert worker.finished_recving_reqs == set()
        assert not pulls["req-0"].failed


def test_a_finished_pull_marks_every_request_loaded(bootstrap: socket.socket) -> None:
    """The marks reach the PullReqMeta objects decode's pull was given (0.33's
    copy of pull_metas is shallow): with every request loaded the staging
    span is released at once, not held back as after a failure."""
    port = bootstrap.getsockname()[1]
    worker = decode_worker(interval=0.2)
    pulls = pulls_from(port, 2)

    async def scenario() -> None:
        prefill = ScriptedSideChannel(
            worker.async_zmq_ctx,
            ["req-0", "req-1"],
            status=upstream.MooncakeXferResponseStatus.FINISH,
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

    try:
        asyncio.run(asyncio.wait_for(scenario(), 3 * DEADLINE_S))
    finally:
        worker.async_zmq_ctx.destroy(linger=0)
    assert worker.finished_recving_reqs == {"req-0", "req-1"}
    assert worker._invalid_block_ids.empty()
    assert all(getattr(m, LOADED, False) for m in pulls.values())


# -- a gone prefill host, not only a refusing port ----------------------------


def silent_port() -> tuple[socket.socket, list[socket.socket], int]:
    """A loopback port whose kernel drops SYNs: a listener with a full
    accept queue (backlog 0 holds one unaccepted connection). To a client
    this is a host that is powered off or partitioned: no SYN-ACK, no RST."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    held = []
    for _ in range(3):
        filler = socket.socket()
        filler.settimeout(0.2)
        with contextlib.suppress(TimeoutError):
            filler.connect(("127.0.0.1", port))
        held.append(filler)
    return listener, held, port


def timed_pull(
    bootstrap_url: str, interval: float, limit_s: float, busy_loop_s: float = 0.0
) -> tuple[bool, float, PDMooncakeConnectorWorker]:
    """conftest.timed_pull on a fresh decode worker, and that worker."""
    worker = decode_worker(interval)
    try:
        failed, took = conftest_timed_pull(
            worker, bootstrap_url, limit_s, busy_loop_s, tasks=1
        )
    finally:
        worker.async_zmq_ctx.destroy(linger=0)
    return failed, took, worker


INTERVAL_S = 0.5


@pytest.mark.usefixtures("pull_never_answers")
def test_a_silent_prefill_host_fails_the_pull_as_fast_as_a_refusing_one() -> None:
    with socket.socket() as nothing:
        nothing.bind(("127.0.0.1", 0))
        refusing = f"http://127.0.0.1:{nothing.getsockname()[1]}"
    failed, refused_s, _ = timed_pull(refusing, INTERVAL_S, limit_s=10)
    assert failed
    listener, held, port = silent_port()
    try:
        failed, silent_s, worker = timed_pull(
            f"http://127.0.0.1:{port}", INTERVAL_S, limit_s=10
        )
    finally:
        for sock in (*held, listener):
            sock.close()
    print(f"pull failed: refusing port {refused_s:.2f}s, silent host {silent_s:.2f}s")
    assert failed, "a silent prefill host kept the pull waiting"
    # Both: REFUSALS_TO_FAIL probes, one interval apart.
    bound = reliability.REFUSALS_TO_FAIL * INTERVAL_S + 0.5
    assert refused_s < bound and silent_s < bound
    assert worker.finished_recving_reqs == {"d-1"}


@pytest.mark.usefixtures("pull_never_answers")
def test_negative_control_a_busy_prefill_is_not_gone() -> None:
    """A prefill whose bootstrap server never accepts (its event loop busy)
    still completes handshakes in its kernel: the pull keeps waiting."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(64)
        failed, _, worker = timed_pull(
            f"http://127.0.0.1:{busy.getsockname()[1]}", INTERVAL_S, limit_s=3
        )
    assert not failed
    assert worker.finished_recving_reqs == set()


@pytest.mark.usefixtures("pull_never_answers")
def test_negative_control_a_busy_decode_loop_does_not_call_prefill_gone() -> None:
    """Decode's receiver loop blocked past the probe's timeout while the
    probe runs: the handshake completed in the kernel, the prefill is alive."""
    with socket.socket() as alive:
        alive.bind(("127.0.0.1", 0))
        alive.listen(64)
        failed, _, _ = timed_pull(
            f"http://127.0.0.1:{alive.getsockname()[1]}",
            INTERVAL_S,
            limit_s=4,
            busy_loop_s=1.5,
        )
    assert not failed


def test_probe_reasons() -> None:
    listener, held, port = silent_port()
    try:
        silent = asyncio.run(reliability.prefill_gone(f"http://127.0.0.1:{port}", 0.3))
    finally:
        for sock in (*held, listener):
            sock.close()
    assert silent is not None and silent.startswith("is silent")
    with socket.socket() as nothing:
        nothing.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{nothing.getsockname()[1]}"
    assert asyncio.run(reliability.prefill_gone(closed)) == "refuses connections"
    assert asyncio.run(reliability.prefill_gone("not a url")) is None


# -- a prefill re-created elsewhere under the same engine id -------------------


@pytest.fixture
def bootstrap_server() -> Iterator[Any]:
    """Upstream's bootstrap server (real HTTP), as a prefill runs it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (
        MooncakeBootstrapServer,
    )

    server = MooncakeBootstrapServer("127.0.0.1", 0)
    server.start()
    yield server
    server.shutdown()


def register(server: Any, worker_addr: str) -> None:
    """What prefill's worker posts at start (upstream's /register)."""
    import httpx

    httpx.post(
        f"http://127.0.0.1:{server.port}/register",
        json={
            "engine_id": "pd-prefill",
            "dp_rank": 0,
            "tp_rank": 0,
            "pp_rank": 0,
            "addr": worker_addr,
        },
        timeout=5,
    ).raise_for_status()


# Where the pull goes (conftest.timed_pull), cached for the engine id.
PULLED_FROM = "tcp://127.0.0.1:1"


def pull_with_registered(
    server: Any, registered: str, limit_s: float
) -> tuple[bool, float, PDMooncakeConnectorWorker]:
    """A pull to PULLED_FROM that is never answered, while ``server`` lists
    the engine at ``registered``: (failed, seconds, the decode worker)."""
    register(server, registered)
    worker = decode_worker(INTERVAL_S)
    worker._remote_agents = {"pd-prefill": {0: {0: PULLED_FROM}}}
    try:
        failed, took = conftest_timed_pull(
            worker, f"http://127.0.0.1:{server.port}", limit_s=limit_s, tasks=1
        )
    finally:
        worker.async_zmq_ctx.destroy(linger=0)
    return failed, took, worker


@pytest.mark.usefixtures("pull_never_answers")
def test_a_prefill_recreated_at_a_new_address_fails_the_stale_pull_at_once(
    bootstrap_server: Any,
) -> None:
    """A rescheduled pod: same name, same engine id, a new IP. Its bootstrap
    answers (the name resolves to the new pod), so it is not gone; but the
    pull went to the address decode cached: it fails at the first probe, and
    the engine id leaves the cache so the next pull asks for the new one."""
    failed, took, worker = pull_with_registered(
        bootstrap_server, "tcp://198.18.0.101:8999", limit_s=10
    )
    print(f"stale pull failed after {took:.2f}s")
    assert failed and took < INTERVAL_S + 0.5
    assert worker.finished_recving_reqs == {"d-1"}
    assert "pd-prefill" not in worker._remote_agents


@pytest.mark.usefixtures("pull_never_answers")
def test_negative_control_a_slow_pull_to_the_registered_address_waits(
    bootstrap_server: Any,
) -> None:
    """The bootstrap lists the address the pull went to: a slow prefill, not
    a moved one; the pull keeps waiting and the cache keeps its entry."""
    failed, _, worker = pull_with_registered(bootstrap_server, PULLED_FROM, limit_s=3)
    assert not failed
    assert worker._remote_agents == {"pd-prefill": {0: {0: PULLED_FROM}}}
