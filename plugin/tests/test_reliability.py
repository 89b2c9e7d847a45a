"""Fault handling: duplicate transfer ids, stray "not processed" ids, and a
stable side-channel address for a restarted prefill.

The duplicate-id tests drive upstream's real prefill scheduler and worker
bookkeeping (``MooncakeConnectorScheduler``, ``record_send_reqs``) and check
one invariant: every request whose blocks the scheduler keeps for a send is
the owner of exactly one pending send in the worker. A request that breaks
it holds its blocks until the process exits.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
from scripted_engine import ScriptedEngine
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)
from vllm.v1.request import RequestStatus

from conftest import BLOCK_SIZE, STALL_S, kv_cache_config, pull_worker, timed_pull
from pd_mooncake import CONNECTOR_NAME, extra_config, reliability, stall_guard
from pd_mooncake import connector as connector_module
from pd_mooncake.connector import PDMooncakeConnector, PDMooncakeConnectorWorker


def prefill_connector(guarded: bool) -> PDMooncakeConnector:
    """Our connector in the prefill scheduler's role, around upstream's real
    scheduler-side object (its constructor needs no engine)."""
    kv = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_role="kv_producer",
        kv_connector_extra_config={"mooncake_protocol": "tcp"},
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=kv,
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
    )
    connector = object.__new__(PDMooncakeConnector)
    connector._kv_cache_config = kv_cache_config()
    connector.connector_scheduler = upstream.MooncakeConnectorScheduler(
        vllm_config, "pd-prefill", connector._kv_cache_config
    )
    connector.connector_worker = None
    connector.transfer_guard = reliability.TransferIdGuard() if guarded else None
    connector.randomized_ids = True
    connector.sibling_ids = True
    return connector


def prefill_request(request_id: str, transfer_id: str) -> SimpleNamespace:
    # What vllm-router sends to prefill; n > 1 children share it.
    params = {"do_remote_decode": True, "do_remote_prefill": False}
    return SimpleNamespace(
        request_id=request_id,
        kv_transfer_params={**params, "transfer_id": transfer_id},
        status=RequestStatus.RUNNING,
    )


def serve(
    connector: PDMooncakeConnector, requests: list[SimpleNamespace]
) -> tuple[dict[str, bool], dict[str, Any]]:
    """Allocate, finish (one token: length-capped) and hand the metadata to
    upstream's worker bookkeeping, as two engine steps would."""
    pending: dict[str, Any] = {}
    worker = SimpleNamespace(reqs_need_send=pending)
    loop = asyncio.new_event_loop()
    try:
        for request in requests:
            connector.update_state_after_alloc(request, None, 0)
        meta = connector.build_connector_meta(SimpleNamespace())
        loop.run_until_complete(
            upstream.MooncakeConnectorWorker.record_send_reqs(worker, meta)
        )
        held = {}
        for index, request in enumerate(requests):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            # Two KV cache groups: the MLA target and the GQA draft.
            blocks = ([10 * index + 1], [10 * index + 2])
            held[request.request_id] = connector.request_finished_all_groups(
                request, blocks
            )[0]
        meta = connector.build_connector_meta(SimpleNamespace())
        loop.run_until_complete(
            upstream.MooncakeConnectorWorker.record_send_reqs(worker, meta)
        )
    finally:
        loop.close()
    return held, pending


def stranded(held: dict[str, bool], pending: dict[str, Any]) -> list[str]:
    """Requests whose blocks are kept but that no pending send will release."""
    owners = {meta.p_req_id for meta in pending.values()}
    return sorted(r for r, kept in held.items() if kept and r not in owners)


def test_n_children_sharing_a_transfer_id_strand_blocks_upstream() -> None:
    """Negative control: upstream alone, four children of one n=4 request."""
    requests = [prefill_request(f"child-{i}", "xfer-1") for i in range(4)]
    held, pending = serve(prefill_connector(guarded=False), requests)
    owners = [m.p_req_id for m in pending.values()]
    print(f"upstream: blocks kept {held}, pending send owners {owners}")
    assert len(stranded(held, pending)) == 3


def test_guard_lets_one_child_own_the_send_and_frees_the_others() -> None:
    connector = prefill_connector(guarded=True)
    requests = [prefill_request(f"child-{i}", "xfer-1") for i in range(4)]
    held, pending = serve(connector, requests)
    owners = [m.p_req_id for m in pending.values()]
    print(f"guarded: blocks kept {held}, pending send owners {owners}")
    assert stranded(held, pending) == []
    assert held == {
        "child-0": True,
        "child-1": False,
        "child-2": False,
        "child-3": False,
    }
    assert pending["xfer-1"].p_req_id == "child-0"
    assert pending["xfer-1"].local_block_ids == [[1], [2]]
    guard = connector.transfer_guard
    assert guard is not None and guard.refused_total == 3
    # Once the owner's send is done, the id is free again.
    connector.update_connector_output(SimpleNamespace(finished_sending={"child-0"}))
    assert guard.live() == 0


def test_distinct_transfer_ids_are_untouched() -> None:
    requests = [prefill_request(f"req-{i}", f"xfer-{i}") for i in range(3)]
    held, pending = serve(prefill_connector(guarded=True), requests)
    assert held == dict.fromkeys(held, True)
    assert {m.p_req_id for m in pending.values()} == set(held)


def test_a_reused_id_waiting_in_the_queue_cannot_cancel_the_owners_send() -> None:
    """A request with another's live id, aborted before it got blocks: upstream
    would mark the id "not processed" and drop the owner's pending send."""
    connector = prefill_connector(guarded=True)
    owner = prefill_request("owner", "xfer-9")
    connector.update_state_after_alloc(owner, None, 0)
    queued = prefill_request("queued", "xfer-9")
    queued.status = RequestStatus.FINISHED_ABORTED
    assert connector.request_finished_all_groups(queued, ([], [])) == (False, None)
    assert connector.connector_scheduler._reqs_not_processed == set()


# --- sibling transfer ids ---------------------------------------------------------
# Engine request ids as vLLM 0.32 makes them from vllm-router's API request id:
# "[<child>_]<api id>[-<prompt>]-<8 random hex>" (completions add the prompt
# index; chat does not; n > 1 adds the child index).
API_ID = "cmpl-___prefill_addr_10.0.0.1:8100___decode_addr_10.0.0.2:8200_42e4"


@pytest.mark.parametrize(
    ("request_id", "own"),
    [
        (f"{API_ID}-0-1a2b3c4d", "xfer"),
        (f"1_{API_ID}-0-1a2b3c4d", "xfer~1.0"),
        (f"{API_ID}-2-1a2b3c4d", "xfer~0.2"),
        (f"3_{API_ID}-2-deadbeef", "xfer~3.2"),
        # Chat: no prompt index; a random suffix of digits only.
        ("chatcmpl-abc-12345678", "xfer"),
        ("2_chatcmpl-abc-12345678", "xfer~2.0"),
        # Decode's rejection notice: the API id itself, no random suffix.
        (API_ID, "xfer"),
        ("cmpl-7", "xfer"),
    ],
)
def test_each_engine_request_gets_its_own_transfer_id(
    request_id: str, own: str
) -> None:
    assert reliability.sibling_transfer_id("xfer", request_id) == own


def test_without_random_suffixes_the_indexes_are_read_at_the_end() -> None:
    derive = reliability.sibling_transfer_id
    assert derive("xfer", f"2_{API_ID}-1", randomized=False) == "xfer~2.1"
    assert derive("xfer", f"{API_ID}-0", randomized=False) == "xfer"


def test_prefill_and_decode_derive_the_same_ids_and_siblings_differ() -> None:
    """The two legs' engine ids differ only in vLLM's random suffix."""
    siblings = [(k, j) for k in range(3) for j in range(2)]

    def ids(suffix: str) -> list[str]:
        return [
            reliability.sibling_transfer_id("xfer", f"{k}_{API_ID}-{j}-{suffix}")
            for k, j in siblings
        ]

    prefill, decode = ids("0badcafe"), ids("f00dbabe")
    assert prefill == decode
    assert len(set(prefill)) == len(siblings)


def engine_request(request_id: str, transfer_id: str) -> SimpleNamespace:
    return prefill_request(request_id, transfer_id)


def test_n_children_and_batch_prompts_each_own_a_send() -> None:
    """n=2 over a batch of 2 prompts: four engine requests, one API transfer
    id. Each keeps its blocks for a send of its own; the guard refuses none."""
    connector = prefill_connector(guarded=True)
    requests = [
        engine_request(f"{k}_{API_ID}-{j}-0badcafe", "xfer-1")
        for k in range(2)
        for j in range(2)
    ]
    for request in requests:
        connector.on_new_request(request)
    held, pending = serve(connector, requests)
    print(f"siblings: blocks kept {held}, pending sends {sorted(pending)}")
    assert held == dict.fromkeys(held, True)
    assert stranded(held, pending) == []
    assert sorted(pending) == ["xfer-1", "xfer-1~0.1", "xfer-1~1.0", "xfer-1~1.1"]
    guard = connector.transfer_guard
    assert guard is not None and guard.refused_total == 0


def test_negative_control_shared_ids_leave_one_send_for_four_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same four engine requests with the derivation off (upstream's
    behaviour): one pending send, so decode's four pulls share one prompt's
    KV (wrong tokens for the other prompt) and three find it gone."""
    monkeypatch.setattr(reliability, "sibling_transfer_id", lambda t, r, **_: t)
    connector = prefill_connector(guarded=True)
    requests = [
        engine_request(f"{k}_{API_ID}-{j}-0badcafe", "xfer-1")
        for k in range(2)
        for j in range(2)
    ]
    _, pending = serve(connector, requests)
    assert sorted(pending) == ["xfer-1"]


def test_the_derivation_happens_once_and_keeps_the_api_id() -> None:
    connector = prefill_connector(guarded=False)
    request = engine_request(f"1_{API_ID}-0-0badcafe", "xfer-1")
    shared = request.kv_transfer_params
    connector.on_new_request(request)
    connector.on_new_request(request)
    assert request.kv_transfer_params["transfer_id"] == "xfer-1~1.0"
    assert request.kv_transfer_params[connector_module.SIBLING_BASE] == "xfer-1"
    # A sibling holding the same dict is not changed under it.
    assert shared["transfer_id"] == "xfer-1"


def pending_send(p_req_id: str, sending: int = 0) -> SimpleNamespace:
    return SimpleNamespace(p_req_id=p_req_id, sending=sending)


def test_a_rejection_notice_releases_the_siblings_sends() -> None:
    """Decode refused an n > 1 or batch request before its engine saw it: the
    notice names the API request and carries no blocks."""
    pending = {
        "xfer-1": pending_send("p0"),
        "xfer-1~1.0": pending_send("p1"),
        "xfer-1~0.1": pending_send("p2"),
        "xfer-1~1.1": pending_send("p3", sending=1),  # being sent: left alone
        "xfer-10~1.0": pending_send("other"),
        "xfer-2~1.0": pending_send("other"),
    }
    released = reliability.api_release({API_ID: ("xfer-1", [[], []])}, pending)
    assert sorted(released) == ["xfer-1~0.1", "xfer-1~1.0"]


@pytest.mark.parametrize(
    "req_blocks",
    [
        # An engine request's own release (aborted before it was scheduled).
        {f"{API_ID}-0-0badcafe": ("xfer-1", [[], []])},
        # A real pull.
        {API_ID: ("xfer-1", [[3], [4]])},
    ],
    ids=["engine-request release", "pull with blocks"],
)
def test_other_pulls_release_no_siblings(req_blocks: dict) -> None:
    pending = {"xfer-1~1.0": pending_send("p1")}
    assert reliability.api_release(req_blocks, pending) == []


def test_stray_not_processed_ids_do_not_stop_the_batch() -> None:
    """Upstream raises KeyError on an id it never registered (a request aborted
    while queued) and skips the ids after it; the plugin drops the unknown."""
    pending = {"known": object()}
    assert reliability.known_not_processed(["never", "known"], pending) == {"known"}
    worker = object.__new__(PDMooncakeConnectorWorker)
    worker.reqs_need_send = {
        "known": upstream.SendBlockMeta("p", "known", [], asyncio.Event())
    }
    meta = upstream.MooncakeConnectorMetadata()
    meta.reqs_not_processed = {"never-registered", "known"}
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(worker.record_send_reqs(meta))
        with pytest.raises(KeyError):
            loop.run_until_complete(
                upstream.MooncakeConnectorWorker.record_send_reqs(
                    SimpleNamespace(reqs_need_send={}),
                    SimpleNamespace(
                        reqs_to_send={}, reqs_not_processed={"never-registered"}
                    ),
                )
            )
    finally:
        loop.close()
    assert worker.reqs_need_send == {}


# -- a stable side channel ------------------------------------------------------


def free_port_pair() -> int:
    """A port p with p + 1 free (the bootstrap port and its side channel)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            with socket.socket() as other:
                other.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        ({"dp_rank": 0, "pp_rank": 0, "tp_rank": 0}, 9001),
        ({"dp_rank": 0, "pp_rank": 0, "tp_rank": 3}, 9004),
        ({"dp_rank": 0, "pp_rank": 1, "tp_rank": 2}, 9007),
        ({"dp_rank": 1, "pp_rank": 0, "tp_rank": 0}, 9009),
    ],
)
def test_side_channel_ports_are_distinct_per_rank(
    ranks: dict[str, int], expected: int
) -> None:
    port = reliability.side_channel_port(9000, 1, pp_size=2, tp_size=4, **ranks)
    assert port == expected


def test_side_channel_port_must_be_valid() -> None:
    with pytest.raises(ValueError, match="not a valid port"):
        reliability.side_channel_port(
            65535, 1, dp_rank=0, pp_rank=0, tp_rank=0, pp_size=1, tp_size=1
        )


# A prefill's side channel in its own process (pd_mooncake.reliability needs
# only pyzmq): bound the way upstream binds it, answering with its name.
LISTENER = """
import asyncio, sys, zmq
from pd_mooncake import reliability

async def main():
    ctx = reliability.SideChannelContext()
    ctx.side_channel_port = int(sys.argv[1])
    sock = ctx.socket(zmq.ROUTER)
    print(sock.bind_to_random_port("tcp://127.0.0.1"), flush=True)
    while True:
        identity, _ = await sock.recv_multipart()
        await sock.send_multipart([identity, sys.argv[2].encode()])

asyncio.run(main())
"""


def answers_at_the_cached_address(fixed_port: int) -> list[str | None]:
    """Start a listener, cache its address in a decode-side socket, SIGKILL it
    (a crash), start another: what does the same, never-told socket hear?
    ``fixed_port`` 0 is upstream's random port."""
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.RCVTIMEO, 3_000 if fixed_port == 0 else 20_000)
    peer.setsockopt(zmq.LINGER, 0)
    answers: list[str | None] = []
    try:
        for name in ("first", "restarted"):
            proc = subprocess.Popen(
                [sys.executable, "-c", LISTENER, str(fixed_port), name],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert proc.stdout is not None
                bound = int(proc.stdout.readline())
                if not answers:
                    peer.connect(f"tcp://127.0.0.1:{bound}")
                peer.send(b"pull")
                try:
                    answers.append(peer.recv().decode())
                except zmq.Again:
                    answers.append(None)
            finally:
                proc.kill()
                proc.wait(timeout=10)
    finally:
        ctx.destroy(linger=0)
    return answers


def test_a_killed_and_restarted_prefill_answers_at_the_cached_address() -> None:
    port = free_port_pair() + 1
    answers = answers_at_the_cached_address(port)
    print(f"fixed side channel {port}: answers {answers}")
    assert answers == ["first", "restarted"]


def test_with_a_random_port_the_cached_address_is_dead_after_a_restart() -> None:
    """Negative control: upstream's random port."""
    answers = answers_at_the_cached_address(0)
    print(f"random side channel: answers {answers}")
    assert answers == ["first", None]


def test_without_a_port_the_context_binds_at_random() -> None:
    ctx = reliability.SideChannelContext()
    try:
        sock = ctx.socket(zmq.ROUTER)
        assert sock.bind_to_random_port("tcp://127.0.0.1") > 0
    finally:
        ctx.destroy(linger=0)


def test_side_channel_offset_is_validated() -> None:
    extra_config.validate({"side_channel_port_offset": 1})
    with pytest.raises(extra_config.ExtraConfigError, match="must be >= 1"):
        extra_config.validate({"side_channel_port_offset": 0})
    with pytest.raises(extra_config.ExtraConfigError, match="must be int"):
        extra_config.validate({"side_channel_port_offset": "1"})


# -- decode: a pull whose prefill is gone ----------------------------------------


@pytest.mark.usefixtures("pull_never_answers")
def test_a_pull_from_a_dead_prefill_fails_within_seconds() -> None:
    dead = f"http://127.0.0.1:{free_port_pair()}"  # nothing listens there
    worker = pull_worker(interval=0.2)
    finished, took = timed_pull(worker, dead, limit_s=10)
    print(f"pull from a dead prefill failed after {took:.2f}s")
    assert finished and took < 2
    assert worker.finished_recving_reqs == {"d-1"}
    assert worker._invalid_block_ids.get_nowait() == {4, 5}


@pytest.mark.usefixtures("pull_never_answers")
def test_a_pull_from_a_live_prefill_is_left_alone() -> None:
    """Negative control: the bootstrap port answers, so a slow pull waits."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        alive = f"http://127.0.0.1:{listener.getsockname()[1]}"
        worker = pull_worker(interval=0.2)
        finished, _ = timed_pull(worker, alive, limit_s=1.5)
    assert not finished
    assert worker.finished_recving_reqs == set()


def test_liveness_probe_sees_a_refusal() -> None:
    """A silent host and a busy prefill: test_pull_failures.py (loopback only)."""
    dead = f"http://127.0.0.1:{free_port_pair()}"
    assert asyncio.run(reliability.refuses_connections(dead))
    assert not asyncio.run(reliability.refuses_connections("not a url"))


def test_liveness_interval_is_validated() -> None:
    extra_config.validate({"prefill_liveness_interval_s": 0})
    extra_config.validate({"prefill_liveness_interval_s": 2.5})
    for bad in (-1, True, "2"):
        with pytest.raises(extra_config.ExtraConfigError, match="liveness"):
            extra_config.validate({"prefill_liveness_interval_s": bad})


# --- a stalled send is sent again ---------------------------------------------------


def sending_worker(results: list[tuple[int, float]]) -> PDMooncakeConnectorWorker:
    from pd_mooncake.metrics import PDMooncakeStats

    worker = object.__new__(PDMooncakeConnectorWorker)
    worker.engine = ScriptedEngine(results)
    worker.xfer_stats = PDMooncakeStats()
    worker.stall_s = STALL_S
    return worker


def send(worker: Any, sender: Any) -> int:
    return sender(worker, "127.0.0.1:1", [4096, 8192], [0, 4096], [4096, 4096])


@pytest.mark.usefixtures("short_stalls")
def test_a_stalled_send_is_sent_again_until_it_goes_through() -> None:
    worker = sending_worker([(-1, STALL_S), (-1, STALL_S), (0, 0.0)])
    assert send(worker, PDMooncakeConnectorWorker._send_blocks) == 0
    assert worker.engine.rounds == 3
    data = worker.xfer_stats.data
    assert len(data["transfer_duration"]) == 1
    # Failed counts transfers that stay failed; these were sent again.
    assert data["num_failed_transfers"] == []
    assert data["num_retried_transfers"] == [1, 1]


@pytest.mark.usefixtures("short_stalls")
def test_negative_control_upstream_fails_the_stalled_send() -> None:
    """The same script (a stall, then a send that would go through): the
    plugin's send rides it out, upstream's fails and counts the failure, so
    the retry is what saves the transfer."""
    script = [(-1, STALL_S), (0, 0.0)]
    ours, theirs = sending_worker(script), sending_worker(script)
    assert send(ours, PDMooncakeConnectorWorker._send_blocks) == 0
    assert send(theirs, upstream.MooncakeConnectorWorker._send_blocks) == -1
    assert ours.xfer_stats.data["num_failed_transfers"] == []
    assert len(ours.xfer_stats.data["transfer_duration"]) == 1
    assert theirs.xfer_stats.data["num_failed_transfers"] == [1]
    assert theirs.xfer_stats.data["transfer_duration"] == []


@pytest.mark.usefixtures("short_stalls")
def test_a_fast_failure_is_not_retried() -> None:
    """A peer that is gone refuses at once: not a stall, no retry."""
    worker = sending_worker([(-1, 0.0), (0, 0.0)])
    assert send(worker, PDMooncakeConnectorWorker._send_blocks) == -1
    assert worker.engine.rounds == 1
    assert worker.xfer_stats.data["num_failed_transfers"] == [1]


@pytest.mark.usefixtures("short_stalls")
def test_retries_end_with_their_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connector_module, "SEND_RETRY_BUDGET_S", 4 * STALL_S)
    worker = sending_worker([])  # stalls for ever
    start = time.monotonic()
    assert send(worker, PDMooncakeConnectorWorker._send_blocks) == -1
    assert time.monotonic() - start < 10 * STALL_S
    data = worker.xfer_stats.data
    assert 2 <= worker.engine.rounds <= 6
    assert len(data["num_failed_transfers"]) == 1
    assert len(data["num_retried_transfers"]) == worker.engine.rounds - 1


def test_resends_back_off_while_nothing_completes() -> None:
    """A send that never progresses is resent after 1, 2, 4, 8 s (stall_s
    doubling), not every second: a host too loaded to answer gets a bounded
    number of copies."""
    now = [0.0]
    resent_at: list[float] = []
    engine = ScriptedEngine([])  # every round stalls

    def sleep(seconds: float) -> None:
        now[0] += max(seconds, 0.05)

    outcome = stall_guard.write(
        engine,
        "127.0.0.1:1",
        [4096],
        [0],
        [4096],
        stall_s=1.0,
        may_resend=lambda t: t < 20.0,
        orphans=stall_guard.Orphans(),
        on_resend=lambda pending: resent_at.append(now[0]),
        clock=lambda: now[0],
        sleep=sleep,
    )
    assert outcome.status == -1 and outcome.resends == len(resent_at)
    gaps = [
        round(b - a) for a, b in zip([0.0, *resent_at[:-1]], resent_at, strict=True)
    ]
    assert gaps == [1, 2, 4, 8], gaps
