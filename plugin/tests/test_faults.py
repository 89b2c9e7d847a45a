"""The test-only fault switch: off by default, exact when on."""

from __future__ import annotations

import pytest
import torch

from pd_mooncake import faults


def test_off_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    assert faults.active_fault() is None


def test_unknown_fault_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.FAULT_ENV, "corrupt_everything")
    with pytest.raises(ValueError, match="not a known fault"):
        faults.active_fault()


def test_corrupts_exactly_the_given_blocks() -> None:
    caches = {"mla": torch.zeros(6, 16, 96), "draft": torch.zeros(6, 16, 8, 64)}
    assert faults.corrupt_blocks(caches, [4, 1, 4]) == 2
    for cache in caches.values():
        touched = [b for b in range(6) if torch.count_nonzero(cache[b])]
        assert touched == [1, 4]
