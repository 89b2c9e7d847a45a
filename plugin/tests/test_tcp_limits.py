"""Mooncake's TCP per-peer queue against a scattered long prompt's transfer.

Two real TransferEngines in two processes: 2304 non-adjacent 36 KiB
descriptors (a 4096-token prompt: 256 blocks x 9 regions, nothing coalesced)
fail with Mooncake's default queue of 1024 and arrive intact with the limits
the plugin sets.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from typing import Any

import pytest
import torch

from conftest import RecordingEngine
from pd_mooncake import tcp_limits

DESCRIPTORS = 256 * 9
DESCRIPTOR_BYTES = 36864
DEADLINE_S = 60.0


def receiver(to_sender: Any, from_sender: Any, nbytes: int) -> None:
    engine = RecordingEngine()
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    engine.batch_register_memory([buf.data_ptr()], [nbytes])
    to_sender.put((engine.engine.get_rpc_port(), buf.data_ptr()))
    from_sender.get(timeout=DEADLINE_S)
    to_sender.put(buf.numpy().tobytes())


def scattered_write(environ: dict[str, str]) -> tuple[int, bytes, torch.Tensor]:
    """Every other descriptor-sized slot, under ``environ`` in both processes."""
    nbytes = 2 * DESCRIPTORS * DESCRIPTOR_BYTES
    saved = dict(os.environ)
    os.environ.update(environ)
    ctx = mp.get_context("spawn")
    to_sender, from_sender = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(
        target=receiver, args=(to_sender, from_sender, nbytes), daemon=True
    )
    try:
        proc.start()
        port, remote = to_sender.get(timeout=DEADLINE_S)
        engine = RecordingEngine()
        source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        engine.batch_register_memory([source.data_ptr()], [nbytes])
        offsets = [2 * i * DESCRIPTOR_BYTES for i in range(DESCRIPTORS)]
        status = engine.engine.batch_transfer_sync_write(
            f"127.0.0.1:{port}",
            [source.data_ptr() + o for o in offsets],
            [remote + o for o in offsets],
            [DESCRIPTOR_BYTES] * DESCRIPTORS,
        )
        from_sender.put("done")
        received = to_sender.get(timeout=DEADLINE_S)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    return status, received, source


def mooncake_default() -> dict[str, str]:
    return {name: "1024" for name in tcp_limits.QUEUE_LIMIT_ENV}


def test_default_queue_rejects_a_scattered_long_prompt() -> None:
    """Negative control: the limit is real in the installed Mooncake."""
    status, _, _ = scattered_write(mooncake_default())
    assert status != 0


def test_raised_limits_carry_it_intact() -> None:
    environ: dict[str, str] = {}
    assert tcp_limits.raise_queue_limits("tcp", environ) == {
        name: "65535" for name in tcp_limits.QUEUE_LIMIT_ENV
    }
    status, received, source = scattered_write(environ)
    assert status == 0
    view = torch.frombuffer(bytearray(received), dtype=torch.uint8)
    slots = view.view(DESCRIPTORS, 2, DESCRIPTOR_BYTES)
    expected = source.view(DESCRIPTORS, 2, DESCRIPTOR_BYTES)
    assert torch.equal(slots[:, 0], expected[:, 0])
    assert not slots[:, 1].any()  # the gaps stay untouched


def test_operator_settings_win_and_rdma_is_left_alone() -> None:
    environ = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "4096"}
    applied = tcp_limits.raise_queue_limits("tcp", environ)
    assert applied == {"MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535"}
    assert environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] == "4096"
    assert tcp_limits.raise_queue_limits("rdma", {}) == {}


@pytest.mark.parametrize(
    ("max_model_len", "warned"), [(8192, False), (131072 * 8, True)]
)
def test_warns_when_a_maximal_prompt_can_overflow(
    caplog: pytest.LogCaptureFixture, max_model_len: int, warned: bool
) -> None:
    environ = {name: "65535" for name in tcp_limits.QUEUE_LIMIT_ENV}
    with caplog.at_level(logging.WARNING, logger="vllm.pd_mooncake"):
        worst = tcp_limits.warn_if_prompt_can_overflow(
            "tcp", max_model_len, 16, 9, environ
        )
    assert worst == max_model_len // 16 * 9
    assert ("per-peer queue" in caplog.text) is warned
