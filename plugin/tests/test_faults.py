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


def test_fault_file_switches_on_and_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    switch = tmp_path / "fault"
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    monkeypatch.setenv(faults.FAULT_FILE_ENV, str(switch))
    assert faults.active_fault() is None
    switch.write_text(faults.CORRUPT_RECEIVED_KV)
    assert faults.active_fault() == faults.CORRUPT_RECEIVED_KV
    switch.unlink()
    assert faults.active_fault() is None


def test_corrupts_the_block_dimension_of_kv_first_gpu_layouts() -> None:
    """FlashAttention's cache is (2, num_blocks, block_size, heads, head): the
    blocks are dim 1 (dim 0 would be K/V, and block id 4 out of range)."""
    caches = {"mla": torch.zeros(6, 16, 96), "draft": torch.zeros(2, 6, 16, 2, 8)}
    assert faults.corrupt_blocks(caches, [4, 1], num_blocks=6) == 2
    assert [b for b in range(6) if torch.count_nonzero(caches["mla"][b])] == [1, 4]
    draft = caches["draft"]
    assert [b for b in range(6) if torch.count_nonzero(draft[:, b])] == [1, 4]
    with pytest.raises(ValueError, match="no dimension of 7 blocks"):
        faults.corrupt_blocks({"x": torch.zeros(2, 6, 4)}, [1], num_blocks=7)


def test_lose_draft_kv_picks_only_the_layers_after_the_target() -> None:
    # vLLM's names: an 8-layer target's MLA layers, then an MTP layer (and
    # an Eagle3 draft's attention, numbered the same way).
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(4, 16, 576) for i in range(8)
    }
    caches["model.layers.8.self_attn.attn"] = torch.zeros(4, 16, 576)
    caches["model.layers.18.self_attn.attn"] = torch.zeros(4, 16, 576)
    draft = faults.draft_caches(caches, target_layers=8)
    assert sorted(draft) == [
        "model.layers.18.self_attn.attn",
        "model.layers.8.self_attn.attn",
    ]
    assert faults.corrupt_blocks(draft, [2]) == 1
    assert torch.count_nonzero(caches["model.layers.8.self_attn.attn"][2])
    assert not torch.count_nonzero(caches["model.layers.7.self_attn.attn"])
    assert faults.draft_caches(caches, target_layers=19) == {}
