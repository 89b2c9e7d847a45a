"""Prefill: no submission of a send writes after the send was reported.

A stalled Mooncake submission that prefill replaced (a resend) or gave up on
(a failure) can complete later. Once a send is reported, prefill reuses its
source blocks and decode its blocks; such a submission then carries another
request's KV into another request's blocks, after the checksum passed. Here
the plugin's real ``_send_blocks`` writes through a real Mooncake
TransferEngine to decode in its own process; only the stall is scripted
(``ScriptedEngine`` with ``real``: a stalled submission really writes when
it resumes, reading the source then). Decode's block 0 and prefill's source
are reused as soon as the send returns, and block 0 is compared byte for
byte with what its new owner wrote there.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import pytest
import torch
from decode_peer import BLOCK, CANARY, DEADLINE_S, SENT, Decode
from scripted_engine import ScriptedEngine

from conftest import RecordingEngine
from pd_mooncake import connector as connector_module
from pd_mooncake import send_deadline, stall_guard
from pd_mooncake.connector import PDMooncakeConnectorWorker
from pd_mooncake.metrics import PDMooncakeStats

# The next request's KV in prefill's reused source block.
OTHER = 0x22
STALL_S = 0.1
# The first submission resumes this long after it was made: after the
# resend (or the failure) was known, within Mooncake's attempt timeout.
LATE_S = 0.8
ATTEMPT_S = 2.0
DECODE_WAIT_S = 20.0

CASES = {
    # A resend goes through; the first submission resumes later.
    "resent, then done": ([(0, LATE_S), (0, 0.0)], 0),
    # A resend is refused at once (the peer went away); the first resumes.
    "resent, then failed": ([(0, LATE_S), (-1, 0.0)], -1),
    # No resend allowed (decode's wait would end first): failed at the stall.
    "given up": ([(0, LATE_S)], -1),
}


@pytest.fixture(scope="module")
def decode() -> Any:
    # One for the module: each case ends by overwriting block 0.
    peer = Decode()
    yield peer
    peer.close()


def no_settling(
    engine: Any,
    unsettled: dict[int, float],
    settle_s: float,
    orphans: stall_guard.Orphans,
    clock: Any,
    sleep: Any,
) -> tuple[float, int]:
    """The guard removed: what stall_guard.write did before, the replaced and
    abandoned submissions handed to the orphans at once."""
    orphans.adopt(list(unsettled))
    return 0.0, len(unsettled)


def send_then_reuse(
    decode: Decode, case: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, float, bytes, list]:
    """Send prefill's source block into decode's block 0; as soon as the send
    returns, both owners move on (prefill's source holds the next request's
    KV, decode's block 0 its new owner's). (status, seconds the send took,
    block 0 once every scripted write is done, the real writes)."""
    script, _ = CASES[case]
    if case == "given up":
        # The first submission is not held to the budget; a resend is.
        monkeypatch.setattr(connector_module, "SEND_RETRY_BUDGET_S", ATTEMPT_S)
    real = RecordingEngine()
    source = torch.full((BLOCK,), SENT, dtype=torch.uint8)
    real.batch_register_memory([source.data_ptr()], [BLOCK])
    engine = ScriptedEngine(script, real=real.engine)
    worker = object.__new__(PDMooncakeConnectorWorker)
    worker.engine = engine
    worker.xfer_stats = PDMooncakeStats()
    worker.stall_s = STALL_S
    worker.send_timeouts = send_deadline.SendTimeouts(
        prefill_abort_s=0.0,
        decode_wait_s=DECODE_WAIT_S,
        attempt_s=ATTEMPT_S,
        margin_s=0.5,
    )
    arrival = time.monotonic()

    def send() -> int:
        # As send_kv_to_decode sets it for the pull this send answers.
        send_deadline.PULL_CLOCK.set(send_deadline.PullClock(arrival))
        return worker._send_blocks(
            decode.session, [source.data_ptr()], [decode.base], [BLOCK]
        )

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            status = pool.submit(send).result(timeout=DEADLINE_S)
        took = time.monotonic() - arrival
        source.fill_(OTHER)
        assert decode.ask("reuse") == "reused"
        engine.join(DEADLINE_S)
        block0 = decode.ask("read")[:BLOCK]
    finally:
        for ptrs, _ in real.registered:
            real.batch_unregister_memory(ptrs)
    return status, took, block0, engine.landed


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_submission_lands_before_the_send_is_reported(
    decode: Decode, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    status, took, block0, landed = send_then_reuse(decode, case, monkeypatch)
    expected = CASES[case][1]
    print(f"{case}: reported {status} after {took:.2f}s; writes at {landed}")
    assert status == expected
    # The resumed first submission landed while the send held its answer.
    assert took >= LATE_S
    assert block0 == bytes([CANARY]) * BLOCK


@pytest.mark.parametrize("case", CASES)
def test_negative_control_without_the_wait_the_late_write_lands_in_reused_blocks(
    decode: Decode, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stall_guard, "_settle", no_settling)
    status, took, block0, landed = send_then_reuse(decode, case, monkeypatch)
    expected = CASES[case][1]
    print(f"control, {case}: reported {status} after {took:.2f}s; writes {landed}")
    assert status == expected and took < LATE_S
    # The next request's KV, read from prefill's reused source, in the block
    # decode gave to another request.
    assert block0 == bytes([OTHER]) * BLOCK, "the late write did not land"


def test_the_wait_ends_at_mooncakes_attempt_timeout() -> None:
    """A submission Mooncake still reports running past its attempt timeout
    is past the rule's bound (send_deadline): the send is reported then, and
    the submission is left to the orphans."""
    orphans = stall_guard.Orphans()
    engine = ScriptedEngine([(-1, 1.0), (0, 0.0)])  # the first never ends
    start = time.monotonic()
    outcome = stall_guard.write(
        engine,
        "127.0.0.1:1",
        [4096],
        [0],
        [4096],
        stall_s=STALL_S,
        may_resend=lambda now: True,
        orphans=orphans,
        settle_s=0.5,
    )
    took = time.monotonic() - start
    assert outcome.status == 0 and outcome.resends == 1
    assert outcome.unsettled == 1 and len(orphans.ids) == 1
    assert 0.5 <= took < 0.5 + 1.0
