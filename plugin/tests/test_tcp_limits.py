"""Mooncake's TCP per-peer queue against a scattered long prompt's transfer.

Two real TransferEngines in two processes: 2304 non-adjacent 36 KiB
descriptors (a 4096-token prompt: 256 blocks x 9 regions, nothing coalesced)
fail with Mooncake's default queue of 1024 and arrive intact with the limits
the plugin sets.
"""

from __future__ import annotations

import logging
import os
from unittest import mock

import pytest
import torch

from bench.loopback import Endpoint, Peer
from pd_mooncake import tcp_limits

DESCRIPTORS = 256 * 9
DESCRIPTOR_BYTES = 36864


def scattered_write(environ: dict[str, str]) -> tuple[int, bytes, torch.Tensor]:
    """Every other descriptor-sized slot, under ``environ`` in both processes."""
    nbytes = 2 * DESCRIPTORS * DESCRIPTOR_BYTES
    with mock.patch.dict(os.environ, environ), Peer(Endpoint, nbytes) as decode:
        session, remote = decode.call("address")
        sender = Endpoint(nbytes)
        source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        sender.data[:] = source.numpy()
        offsets = [2 * i * DESCRIPTOR_BYTES for i in range(DESCRIPTORS)]
        status = sender.write(
            session,
            [sender.base + o for o in offsets],
            [remote + o for o in offsets],
            [DESCRIPTOR_BYTES] * DESCRIPTORS,
        )
        received = decode.call("read")
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
