"""pdstack.twin.role_cpus: the TP twin's roles on CPUs of their own (issue 28)."""

from __future__ import annotations

import pytest

from pdstack import twin


@pytest.fixture
def tp2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_TENSOR_PARALLEL_SIZE", "2")


def test_tp1_leaves_every_role_unpinned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PD_TENSOR_PARALLEL_SIZE", raising=False)
    for role in ("prefill", "decode", "router"):
        assert twin.role_cpus(role, "tiny", {0, 1}) is None


@pytest.mark.usefixtures("tp2")
def test_tp2_puts_prefill_and_decode_on_halves_of_the_cpus() -> None:
    assert twin.role_cpus("prefill", "tiny", {0, 1}) == [0]
    assert twin.role_cpus("decode", "tiny", {0, 1}) == [1]
    assert twin.role_cpus("prefill", "tiny", {4, 5, 6, 7}) == [4, 5]
    assert twin.role_cpus("decode", "tiny", {4, 5, 6, 7}) == [6, 7]
    # An odd count: decode, which computes and receives, gets the extra one.
    assert twin.role_cpus("decode", "tiny", {0, 1, 2}) == [1, 2]


@pytest.mark.usefixtures("tp2")
def test_tp2_leaves_the_router_and_a_single_cpu_alone() -> None:
    assert twin.role_cpus("router", "tiny", {0, 1}) is None
    assert twin.role_cpus("prefill", "tiny", {3}) is None
