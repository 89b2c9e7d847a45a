"""Prefill: a retried send never writes into blocks decode has given up on.

Real Mooncake TransferEngines on 127.0.0.1 (decode in its own process), the
plugin's real ``_send_blocks`` and sender executor. Where a stall is needed
on demand, ``HealingEngine`` scripts it in front of the real engine: a
SIGSTOPped receiver stalls a real transfer, but its kernel buffers the bytes
and applies them when it resumes whatever the sender decides (seen here), so
it cannot show which attempts prefill started.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from decode_peer import BLOCK, CANARY, DEADLINE_S, SENT, Decode

from conftest import RecordingEngine
from pd_mooncake import connector as connector_module
from pd_mooncake import send_deadline
from pd_mooncake.connector import PDMooncakeConnectorWorker
from pd_mooncake.metrics import PDMooncakeStats

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture
def decode() -> Any:
    peer = Decode()
    yield peer
    peer.close()


class HealingEngine:
    """The real engine behind a stall that lasts until ``heals_at``:
    submissions before it never complete, as in a Mooncake TCP stall
    (kvcache-ai/Mooncake#4209 family); later ones really write. ``starts``:
    when each round of submissions (the first and every resend) began."""

    def __init__(self, real: RecordingEngine, heals_at: float) -> None:
        self.real, self.heals_at = real, heals_at
        self.starts: list[float] = []
        self._stalled = itertools.count(-1, -1)
        self._polled = True

    def transfer_submit_write(self, *args: Any) -> int:
        now = time.monotonic()
        if self._polled:
            self.starts.append(now)
            self._polled = False
        if now < self.heals_at:
            return next(self._stalled)
        return self.real.engine.transfer_submit_write(*args)

    def transfer_check_status(self, batch_id: int) -> int:
        self._polled = True
        if batch_id < 0:
            return 0
        return self.real.engine.transfer_check_status(batch_id)


ATTEMPT_S = 1.0
DECODE_WAIT_S = 4.0


def prefill_worker(engine: Any, timeouts: Any) -> PDMooncakeConnectorWorker:
    worker = object.__new__(PDMooncakeConnectorWorker)
    worker.engine = engine
    worker.xfer_stats = PDMooncakeStats()
    if timeouts is not None:
        worker.send_timeouts = timeouts
    return worker


def late_write_scenario(
    decode: Decode, monkeypatch: pytest.MonkeyPatch, *, deadline: bool
) -> tuple[bytes, list[float], float]:
    """Decode's Mooncake side stalls; decode gives up at DECODE_WAIT_S and
    reuses block 0; the stall ends just after. (block 0's bytes at the end,
    attempt start times, when decode gave up), times from the pull's arrival."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", str(int(ATTEMPT_S)))
    monkeypatch.setattr(connector_module, "SEND_RETRY_BUDGET_S", 3 * DECODE_WAIT_S)
    real = RecordingEngine()
    source = torch.full((BLOCK,), SENT, dtype=torch.uint8)
    real.batch_register_memory([source.data_ptr()], [BLOCK])
    arrival = time.monotonic()
    engine = HealingEngine(real, heals_at=arrival + DECODE_WAIT_S + 0.3)
    timeouts = send_deadline.SendTimeouts(
        prefill_abort_s=0.0,
        decode_wait_s=DECODE_WAIT_S,
        attempt_s=ATTEMPT_S,
        margin_s=0.5,
    )
    worker = prefill_worker(engine, timeouts)
    worker.stall_s = ATTEMPT_S

    def send() -> int:
        # As send_kv_to_decode sets it for the pull this send answers; today's
        # code (the control) has no clock.
        if deadline:
            send_deadline.PULL_CLOCK.set(send_deadline.PullClock(arrival))
        return worker._send_blocks(
            decode.session, [source.data_ptr()], [decode.base], [BLOCK]
        )

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sending = pool.submit(send)
        time.sleep(max(0.0, arrival + DECODE_WAIT_S - time.monotonic()))
        # Decode's wait ended: it fails the request and reuses the block.
        gave_up = time.monotonic() - arrival
        assert decode.ask("reuse") == "reused"
        sending.result(timeout=DEADLINE_S)
    time.sleep(0.5)  # a write in flight lands within milliseconds on loopback
    block0 = decode.ask("read")[:BLOCK]
    for ptrs, _ in real.registered:
        real.batch_unregister_memory(ptrs)
    return block0, [s - arrival for s in engine.starts], gave_up


def test_no_attempt_outlives_decodes_wait_and_the_canary_survives(
    decode: Decode, monkeypatch: pytest.MonkeyPatch
) -> None:
    block0, starts, gave_up = late_write_scenario(decode, monkeypatch, deadline=True)
    print(
        f"attempts started at {[round(s, 2) for s in starts]} s; decode gave up "
        f"at {gave_up:.2f} s"
    )
    assert all(s + ATTEMPT_S <= gave_up for s in starts)
    assert block0 == bytes([CANARY]) * BLOCK


def test_negative_control_retries_past_decodes_wait_overwrite_the_canary(
    decode: Decode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ordering broken: retries bounded by the budget only (today's
    code), longer than decode's wait."""
    block0, starts, gave_up = late_write_scenario(decode, monkeypatch, deadline=False)
    print(
        f"control: attempts at {[round(s, 2) for s in starts]} s; decode gave up "
        f"at {gave_up:.2f} s"
    )
    assert any(s > gave_up for s in starts)
    assert block0 == bytes([SENT]) * BLOCK, "the late write did not land"


# -- two decodes, one silent ---------------------------------------------------


def wait_stopped(pid: int, deadline_s: float = 10.0) -> None:
    """Until every thread of ``pid`` is stopped (state T in /proc)."""
    tasks = Path(f"/proc/{pid}/task")
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        states = [
            (t / "stat").read_text().rsplit(")", 1)[1].split()[0]
            for t in tasks.iterdir()
        ]
        if all(state in "Tt" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} not stopped after SIGSTOP in {deadline_s}s")


def healthy_send_delay(executor: Any, silent: Decode, healthy: Decode) -> float:
    """Sends to a SIGSTOPped decode (a host gone silent: a real stall) fill
    the executor; then how long does one send to the healthy decode take?"""
    real = RecordingEngine()
    source = torch.full((BLOCK,), SENT, dtype=torch.uint8)
    real.batch_register_memory([source.data_ptr()], [BLOCK])
    worker = prefill_worker(real.engine, None)

    async def go() -> float:
        loop = asyncio.get_running_loop()

        def send(peer: Decode) -> Any:
            # As upstream's send_kv_to_decode runs it (mooncake_connector.py).
            return loop.run_in_executor(
                executor,
                worker._send_blocks,
                peer.session,
                [source.data_ptr()],
                [peer.base],
                [BLOCK],
            )

        # Both sessions known first (Mooncake's handshake), as in service.
        assert await send(silent) == 0 and await send(healthy) == 0
        os.kill(silent.pid, signal.SIGSTOP)
        # A signal stops a process only once each of its threads takes it: a
        # send made before the receiving threads stopped is acknowledged at
        # once (seen in CI: the pool was free again, 0.0015 s).
        wait_stopped(silent.pid)
        stuck = [send(silent) for _ in range(4)]
        await asyncio.sleep(0.3)
        assert not any(f.done() for f in stuck), "a send to the silent decode ended"
        start = time.monotonic()
        assert await asyncio.wait_for(send(healthy), DEADLINE_S) == 0
        took = time.monotonic() - start
        os.kill(silent.pid, signal.SIGCONT)
        await asyncio.wait_for(asyncio.gather(*stuck), DEADLINE_S)
        return took

    try:
        return asyncio.run(go())
    finally:
        executor.shutdown(wait=False)
        for ptrs, _ in real.registered:
            real.batch_unregister_memory(ptrs)


@pytest.fixture
def two_decodes(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "1")
    # One attempt each: the stall, not the retries, is what is measured.
    monkeypatch.setattr(connector_module, "SEND_RETRY_BUDGET_S", 0.0)
    peers = Decode(), Decode()
    yield peers
    for peer in peers:
        peer.close()


WORKERS = 2


def test_a_silent_decode_does_not_delay_sends_to_a_healthy_one(
    two_decodes: Any,
) -> None:
    took = healthy_send_delay(send_deadline.SessionExecutor(WORKERS), *two_decodes)
    print(f"per-decode threads: healthy send took {took:.3f}s")
    assert took < 1.0


def test_negative_control_one_shared_pool_delays_the_healthy_decode(
    two_decodes: Any,
) -> None:
    """Upstream's one pool of num_workers threads."""
    took = healthy_send_delay(
        concurrent.futures.ThreadPoolExecutor(WORKERS), *two_decodes
    )
    print(f"shared pool: healthy send took {took:.3f}s")
    assert took > 1.0


# -- the start-up order check --------------------------------------------------


def fault_stack_env() -> dict[str, dict[str, str]]:
    """Each role's environment on the fault stack, as e2e/faults_stack
    renders it: the CPU target's env, then configs/faults.yaml's per role."""
    target = yaml.safe_load((CONFIGS / "targets" / "cpu.yaml").read_text())
    faults = yaml.safe_load((CONFIGS / "faults.yaml").read_text())
    base = {str(k): str(v) for k, v in target.get("env", {}).items()}
    return {
        role: {**base, **{str(k): str(v) for k, v in values.items()}}
        for role, values in faults["env"].items()
    }


def test_production_defaults_pass_the_order_check() -> None:
    timeouts = send_deadline.SendTimeouts.from_env({})
    timeouts.check()
    assert (timeouts.prefill_abort_s, timeouts.decode_wait_s) == (480, 540)


def test_the_fault_stack_passes_the_order_check() -> None:
    env = fault_stack_env()
    prefill, decode = env["prefill"], env["decode"]
    # Prefill is told decode's value; it must be decode's.
    assert prefill[send_deadline.DECODE_ABORT_ENV] == decode[send_deadline.ABORT_ENV], (
        f"{send_deadline.DECODE_ABORT_ENV} on prefill differs from decode's"
    )
    send_deadline.SendTimeouts.from_env(prefill).check()


def test_negative_control_the_old_fault_values_fail_naming_the_variables() -> None:
    """configs/faults.yaml before: prefill 120 s, decode 60 s (a 120 s wait)."""
    env = {**fault_stack_env()["prefill"], send_deadline.DECODE_ABORT_ENV: "60"}
    with pytest.raises(send_deadline.TimeoutOrderError) as failure:
        send_deadline.SendTimeouts.from_env(env).check()
    message = str(failure.value)
    print(message)
    for name in (
        send_deadline.ABORT_ENV,
        send_deadline.DECODE_ABORT_ENV,
        "MC_TRANSFER_TIMEOUT",
    ):
        assert name in message
