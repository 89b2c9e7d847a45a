"""late_writes.DecodeHold: decode's half of the late-write rule, its
timeouts derived and their order checked at start-up."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest
import torch

from pd_mooncake import late_writes, staging, staging_worker


def test_the_kernel_gives_up_retransmitting_after_924_6_s_by_default() -> None:
    # 0.2 s doubling to 102.4 s, then 120 s caps: Linux's documented figure
    # for tcp_retries2 = 15 (ip-sysctl.rst, "924.6 seconds").
    assert late_writes.tcp_give_up_s(15) == pytest.approx(924.6)
    assert late_writes.tcp_give_up_s(3) == pytest.approx(3.0)


def test_the_span_hold_covers_decodes_wait_and_the_kernels_retransmits() -> None:
    hold = late_writes.DecodeHold.from_env({}, retries2=15)
    # Decode's wait at upstream's defaults: 480 s abort timeout + 60 s.
    assert hold.decode_wait_s == 540.0
    assert hold.span_hold_s == pytest.approx(540.0 + 924.6)
    # The constant it replaces (960 s, the retransmits alone) was shorter: a
    # submission started just inside decode's wait could deliver after it.
    assert hold.span_hold_s > 960.0
    longer = late_writes.DecodeHold.from_env(
        {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "900"}, retries2=15
    )
    assert longer.span_hold_s == pytest.approx(960.0 + 924.6)


def test_start_up_refuses_a_room_wait_prefill_does_not_outlast() -> None:
    late_writes.DecodeHold.from_env({}, retries2=15).check()
    short = late_writes.DecodeHold.from_env(
        {"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "20"}, retries2=15
    )
    with pytest.raises(late_writes.HoldOrderError, match="staging room"):
        short.check()


def test_an_unreadable_sysctl_means_the_kernels_default(tmp_path) -> None:
    assert late_writes.read_tcp_retries2(tmp_path / "absent") == 15
    (tmp_path / "r2").write_text("8\n")
    assert late_writes.read_tcp_retries2(tmp_path / "r2") == 8


def test_a_failed_pulls_span_is_held_for_the_derived_hold() -> None:
    """The span is unavailable for exactly the derived hold: taken at once
    after a clean pull, refused until then after a failed one."""
    worker = staging_worker.StagingWorker()
    worker._arena = staging.Arena(torch.empty(16 * staging.ALIGN, dtype=torch.uint8))
    worker._hold = late_writes.DecodeHold(
        decode_wait_s=0.2, prefill_abort_s=60.0, tcp_give_up_s=0.1
    )
    size = worker._arena.size
    offer = staging.Offer(worker._arena.reserve(size), size, 0)
    # Unanswered: its one request got no answer.
    worker._staging_close(offer, {"r": SimpleNamespace(local_block_ids=[[1]])})
    assert worker._arena.reserve(size) is None
    time.sleep(0.35)
    assert worker._arena.reserve(size) == 0


def test_a_worker_with_staging_refuses_the_order_at_start_up(monkeypatch) -> None:
    """The connector's constructor installs staging (_install_staging): the
    check runs there, in the worker's own environment."""
    monkeypatch.setenv("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "20")
    worker = staging_worker.StagingWorker()
    worker._encoder = object()
    with pytest.raises(late_writes.HoldOrderError):
        worker._install_staging({staging.KEY: 1})
    # Staging off: nothing to hold, nothing refused.
    off = staging_worker.StagingWorker()
    off._encoder = msgspec.msgpack.Encoder()
    off._install_staging({staging.KEY: 0})
