"""Bring your own model: pdstack.profile writes a profile from config.json
files, with its excerpts and Kubernetes overlay, sized by pdstack.sizing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pdstack import config, overlay, preflight, sizing
from pdstack import profile as prof

DATA = Path(__file__).parent / "data"
KIMI = DATA / "kimi-k2.5"
GB = 1e9


@pytest.fixture
def tree(configs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """configs/, tests/data/ and k8s/overlays/ as copies the command writes to."""
    data = tmp_path / "data"
    monkeypatch.setattr(preflight, "EXCERPTS", data)
    monkeypatch.setattr(prof, "DATA", data)
    monkeypatch.setattr(overlay, "OVERLAYS", tmp_path / "overlays")
    monkeypatch.setattr(overlay, "ROOT", tmp_path)
    return tmp_path


def new(*args: str) -> int:
    return prof.main(["new", *args])


def test_an_eagle3_profile_is_written_checked_and_deployable(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = new(
        "my-kimi",
        "--target-config",
        str(KIMI / "config.json"),
        "--draft-config",
        str(KIMI / "draft_config.json"),
        "--model",
        "moonshotai/Kimi-K2.5",
        "--draft-model",
        "lightseekorg/kimi-k2.5-eagle3",
        "--weights-gib",
        "555",  # what the excerpt cannot count: the checkpoint's size
        "--gpu",
        "H200",
    )
    out = capsys.readouterr().out
    assert status == 0, out  # the preflight accepted it
    written = yaml.safe_load(
        (tree / "configs" / "profiles" / "my-kimi.yaml").read_text()
    )
    assert written["gpus_per_role"] == 8  # 555 GiB over 141 GB GPUs
    assert written["vllm"]["speculative-config"] == {
        "method": "eagle3",
        "model": "lightseekorg/kimi-k2.5-eagle3",
        "num_speculative_tokens": 3,
    }
    # It renders like any profile, the connector's config from configs/vllm.
    flags = config.vllm_flags("decode", "my-kimi", "gpu")
    assert flags["tensor-parallel-size"] == 8
    assert flags["kv-transfer-config"]["kv_role"] == "kv_consumer"
    # Both excerpts, shapes only, for the preflight and the tests from now on.
    target = json.loads((tree / "data" / "my-kimi" / "config.json").read_text())
    assert target["text_config"]["kv_lora_rank"] == 512
    assert (tree / "data" / "my-kimi" / "draft_config.json").is_file()
    kustomization = (tree / "overlays" / "my-kimi" / "kustomization.yaml").read_text()
    assert "kubectl apply -k k8s/overlays/my-kimi" in kustomization
    assert "H200: 8 per role (one host)" in out
    # 16 GPUs in all: not one 8-GPU host; where to go instead.
    assert "compose runs both roles on one host: it needs 16 GPUs" in out
    assert "kubectl -n pd apply -k k8s/overlays/my-kimi" in out
    assert "my-kimi  prefill, decode  sm90" in out and "accepted" in out


def test_a_deepseek_mtp_profile_needs_no_draft(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = str(DATA / "glm-4.7-flash" / "config.json")
    assert (
        new("flash", "--target-config", target, "--model", "zai-org/GLM-4.7-Flash") == 0
    )
    written = yaml.safe_load((tree / "configs" / "profiles" / "flash.yaml").read_text())
    assert written["vllm"]["speculative-config"] == {
        "method": "mtp",
        "num_speculative_tokens": 1,
    }
    assert written["gpus_per_role"] == 1  # one 80 GB GPU per role
    assert not (tree / "data" / "flash" / "draft_config.json").exists()
    out = capsys.readouterr().out
    assert "PD_PROFILE=flash  PREFILL_GPUS=0  DECODE_GPUS=1" in out
    assert "docker compose build" in out
    assert 'make e2e PYTEST_ARGS="--target-config tests/data/flash/config.json"' in out
    # The old method name is vLLM's "mtp".
    args = [
        "--target-config",
        target,
        "--model",
        "m/m",
        "--draft-method",
        "deepseek_mtp",
    ]
    assert new("flash2", *args) == 0
    capsys.readouterr()


def test_a_model_too_big_for_one_host_per_role_is_refused(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = str(DATA / "deepseek-v3" / "config.json")
    status = new("v3", "--target-config", target, "--model", "deepseek-ai/DeepSeek-V3")
    err = capsys.readouterr().err
    assert status == 2
    assert "needs 16 H100 80GB GPUs per role: more than one host per role" in err
    assert "H200: 8 per role (one host)" in err  # where to go instead
    assert not (tree / "configs" / "profiles" / "v3.yaml").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--target-config", str(DATA / "deepseek-v2-lite" / "config.json")],
            "--model",
        ),
        (
            [
                "--target-config",
                str(DATA / "deepseek-v2-lite" / "config.json"),
                "--model",
                "a/b",
            ],
            "no MTP layers",
        ),
        (
            [
                "--target-config",
                str(KIMI / "config.json"),
                "--model",
                "a/b",
                "--draft-method",
                "eagle3",
            ],
            "eagle3 needs --draft-config",
        ),
    ],
)
def test_what_is_missing_is_named(
    tree: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    assert new("x", *args) == 2
    assert says in capsys.readouterr().err


def test_an_existing_profile_is_not_overwritten(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = str(DATA / "glm-4.7-flash" / "config.json")
    assert new("tiny", "--target-config", target, "--model", "a/b") == 2
    assert "exists (--force rewrites it)" in capsys.readouterr().err


def test_the_hub_id_comes_from_a_hugging_face_cache_path(tmp_path: Path) -> None:
    snapshot = tmp_path / "hub" / "models--zai-org--GLM-4.7-Flash" / "snapshots" / "abc"
    assert prof.hub_id(snapshot / "config.json") == "zai-org/GLM-4.7-Flash"
    assert prof.hub_id(tmp_path / "config.json") is None


# --- pdstack.sizing against published figures ---------------------------------


@pytest.mark.parametrize(
    ("name", "mtp", "published"),
    [
        # Model cards and Hugging Face's parameter counts.
        ("deepseek-v2-lite", False, 15.7e9),  # "15.7B" (safetensors 31.41 GB)
        ("deepseek-v3", True, 685e9),  # "671B main model + 14B MTP module"
        ("glm-4.7-flash", True, 31e9),  # Hugging Face: "31B params"
    ],
)
def test_parameters_counted_from_config_json_match_the_model_cards(
    name: str, mtp: bool, published: float
) -> None:
    cfg = json.loads((DATA / name / "config.json").read_text())
    counted = sum(sizing.params(cfg, mtp).values())
    assert abs(counted - published) / published < 0.01, counted


def test_weights_bytes_follow_the_checkpoint_types(tmp_path: Path) -> None:
    lite = json.loads((DATA / "deepseek-v2-lite" / "config.json").read_text())
    # bfloat16: 2 bytes a parameter; the four safetensors files hold 31.41 GB.
    assert sizing.weights(tmp_path / "c.json", lite, False, None).bytes / GB == (
        pytest.approx(31.41, rel=0.005)
    )
    v3 = json.loads((DATA / "deepseek-v3" / "config.json").read_text())
    fp8 = sizing.weights(tmp_path / "c.json", v3, True, None).bytes / GB
    assert fp8 == pytest.approx(688.6, rel=0.01)  # fp8 linears, bf16 embeddings
    # The checkpoint's own index, where there is one, is exact.
    index = {"metadata": {"total_size": 123 * 2**30}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    exact = sizing.weights(tmp_path / "config.json", v3, True, None)
    assert (exact.bytes, exact.source) == (
        123 * 2**30,
        "model.safetensors.index.json (exact)",
    )


def test_fits_take_the_fewest_gpus_that_hold_weights_and_one_sequence() -> None:
    weights = 100 * sizing.GIB
    _, h100, h200, b200 = sizing.fits(weights, 70_000, 32768, heads=64)
    assert (h100.width, h200.width, b200.width) == (2, 1, 1)
    # vLLM splits the heads evenly: 8 GPUs would hold 300 GiB, but not 20 heads.
    assert sizing.fits(300 * sizing.GIB, 70_000, 32768, heads=64)[1].width == 8
    assert sizing.fits(300 * sizing.GIB, 70_000, 32768, heads=20)[1].width is None
    assert sizing.fits(10_000 * sizing.GIB, 70_000, 32768, heads=64)[0].width is None


def test_start_budgets_cover_a_cold_download() -> None:
    assert sizing.start_budget_s(600 * 10**9) == 7200  # Kimi-K2.5's 2 h
    assert sizing.start_budget_s(1 * 10**9) == 1800  # compose's default, at least
    assert [sizing.duration(s) for s in (1800, 3600, 9000)] == ["30m", "1h", "2h30m"]
