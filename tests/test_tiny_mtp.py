"""The tiny-mtp target: its MTP layer where vLLM's DeepSeekMTP loads it, dense,
and fitted (the e2e suite serves it: PD_PROFILE=tiny-mtp)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from pdstack.tiny_model import mtp, mtp_cache, params
from pdstack.tiny_model.cache import STAMP_FILE


def test_stamp_follows_the_mtp_constants_and_the_tiny_pairs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = mtp.mtp_stamp()
    monkeypatch.setattr(mtp, "MTP_EH_STD", mtp.MTP_EH_STD * 2)
    assert mtp.mtp_stamp() != base
    monkeypatch.undo()
    monkeypatch.setattr(params, "SEED", params.SEED + 1)
    assert mtp.mtp_stamp() != base


def test_the_mtp_layer_is_dense_and_one() -> None:
    # vLLM makes layer i a MoE layer when i >= first_k_dense_replace; the MTP
    # layer is layer num_hidden_layers.
    fields = mtp.mtp_config_fields()
    assert fields["num_nextn_predict_layers"] == mtp.MTP_LAYERS == 1
    assert fields["first_k_dense_replace"] > fields["num_hidden_layers"]


@pytest.fixture(scope="module")
def target() -> Path:
    found = mtp_cache.generated_mtp()
    if found is None:
        pytest.skip("tiny-mtp not generated on this host (make model)")
    return found


def test_checkpoint_has_the_mtp_layer_where_vllm_loads_it(target: Path) -> None:
    config = json.loads((target / "config.json").read_text())
    # vLLM's SpeculativeConfig turns only deepseek_v3 (v32, glm_moe_dsa)
    # into a DeepSeekMTPModel draft.
    assert config["model_type"] == "deepseek_v3"
    layers = config["num_hidden_layers"]
    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    last = {
        k.split(".", 3)[3] for k in keys if k.startswith(f"model.layers.{layers - 1}.")
    }
    mtp_keys = {
        k.split(".", 3)[3] for k in keys if k.startswith(f"model.layers.{layers}.")
    }
    own = {
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
    }
    # A whole decoder layer (vLLM's mtp_block) beside the MTP's own weights.
    assert mtp_keys == last | own
    assert not any(k.startswith(f"model.layers.{layers + 1}.") for k in keys)


def test_the_fit_predicts_the_probes(target: Path) -> None:
    record = json.loads((target.parent / STAMP_FILE).read_text())
    assert record["stamp"] == mtp.mtp_stamp()
    assert record["fit"]["train_acc"] > 0.99
    probes = mtp_cache.load_mtp_probes(target)
    assert len(probes) == sum(n for _, n in params.PROBE_GROUPS)
    assert all(len(p.greedy) == params.PROBE_MAX_TOKENS for p in probes)
