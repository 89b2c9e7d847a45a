"""The GPU preflight: vLLM's own CUDA attention selector, asked from any host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pd_mooncake import staging
from pdstack import config, cuda_selector, kv_layout, preflight, preflight_cli, serve

GPUS = {gpu: cap for gpu, (cap, _) in preflight.GPUS.items()}
SM90 = {"sm90": (9, 0)}


@pytest.fixture(scope="module")
def tiny() -> list[preflight.Check]:
    return preflight.run(["tiny"], GPUS)


def set_gpu_flag(configs: Path, key: str, value: Any) -> None:
    path = configs / "profiles" / "tiny.yaml"
    data = yaml.safe_load(path.read_text())
    data.setdefault("targets", {}).setdefault("gpu", {})[key] = value
    path.write_text(yaml.safe_dump(data))


def tiny_configs() -> tuple[dict[str, Any], dict[str, Any]]:
    flags = config.vllm_flags("prefill", "tiny", "gpu")
    subs = preflight.profile_substitutions("tiny")
    target, draft = preflight.models(config.substituted(flags, subs))
    assert draft is not None
    return target, draft


def test_tiny_gpu_configuration_is_accepted_on_sm80_sm90_sm100(
    tiny: list[preflight.Check],
) -> None:
    assert sorted((c.role, c.gpu) for c in tiny) == sorted(
        (r, g) for r in config.ROLES for g in GPUS
    )
    for c in tiny:
        assert c.status == "accepted", (c.gpu, c.problems)
        assert c.dtype == "bfloat16"  # configs/profiles/tiny.yaml targets.gpu
        assert [(la.model, la.kind) for la in c.layers] == [
            ("target", "MLA"),
            ("draft", "GQA"),
        ]
        assert all(la.pick for la in c.layers)


def test_vllm_itself_finds_a_valid_backend_for_the_tiny_gpu_layers() -> None:
    """Not through the preflight's reading: vLLM's get_valid_backends returns
    a valid candidate, so get_attn_backend_cls would not raise."""
    v = cuda_selector.vllm()
    target, draft = tiny_configs()
    for head, mla in ((kv_layout.mla_head_size(target), True), (64, False)):
        assert mla or head == kv_layout.head_dim(draft)
        sel = v.selector_config(
            head_size=head,
            dtype=v.torch_dtype("bfloat16"),
            kv_cache_dtype="auto",
            block_size=None,
            use_mla=mla,
            use_kv_connector=True,
        )
        for cap in GPUS.values():
            with cuda_selector._asking(v):
                valid, _ = v.cuda.CudaPlatform.get_valid_backends(
                    v.capability(*cap), sel, num_heads=target["num_attention_heads"]
                )
            assert valid, (cap, mla)


def test_block_sizes_and_region_bytes_follow_the_picked_backends(
    tiny: list[preflight.Check],
) -> None:
    v = cuda_selector.vllm()
    target = tiny_configs()[0]
    for c in tiny:
        for layer in c.layers:
            backend = cuda_selector.original_class(v, layer.pick)
            # The kernel block size is one the picked kernel takes, and the
            # engine's block a whole number of kernel blocks.
            assert backend.supports_block_size(c.kernel_block_size), layer.pick
            assert c.block_size % c.kernel_block_size == 0
        mla, gqa = c.regions
        assert (mla["layout"], mla["layers"]) == (kv_layout.MLA, 8)
        latent = target["kv_lora_rank"] + target["qk_rope_head_dim"]
        assert mla["bytes_per_block"] == latent * 2 * c.kernel_block_size
        # K and V of 2 KV heads of 64, bfloat16, one layer.
        assert (gqa["layout"], gqa["layers"]) == (kv_layout.GQA, 1)
        assert gqa["bytes_per_block"] == 2 * 2 * 64 * 2 * c.kernel_block_size
        assert c.bytes_per_token == 8 * latent * 2 + 2 * 2 * 64 * 2


def test_batch_invariance_is_reported_with_backends_that_support_it(
    tiny: list[preflight.Check],
) -> None:
    v = cuda_selector.vllm()
    for c in tiny:
        assert c.batch_invariant is True
        for layer in c.layers:
            cls = cuda_selector.original_class(v, layer.batch_invariant_pick)
            assert cls.supports_batch_invariance(), layer.batch_invariant_pick


def test_float32_on_gpu_is_rejected_naming_dtype(configs: Path) -> None:
    """Negative control: today's CPU dtype rendered for the GPU target."""
    set_gpu_flag(configs, "dtype", "float32")
    checks = preflight.run(["tiny"], GPUS)
    assert {c.status for c in checks} == {"rejected"}
    for c in checks:
        (problem,) = c.problems  # the MLA target; the GQA draft takes float32
        assert "target MLA layers" in problem
        assert "dtype not supported" in problem
        assert "Change `dtype` in configs/profiles/tiny.yaml" in problem
        assert "dtype bfloat16" in problem  # what vLLM would take instead
    assert "rejected" in preflight.table(checks)


def test_a_block_size_no_kernel_takes_is_rejected_naming_block_size(
    configs: Path,
) -> None:
    set_gpu_flag(configs, "block-size", 8)
    (c,) = preflight.run(["tiny"], SM90, roles=["decode"])
    assert c.status == "rejected"
    for p in c.problems:
        assert "block_size not supported" in p
        assert "Change `block-size` in configs/profiles/tiny.yaml" in p


def test_a_block_size_can_change_the_pick() -> None:
    """32 is no multiple of FlashMLA's kernel block: vLLM falls back."""
    (default,) = preflight.run(["tiny"], SM90, roles=["prefill"])
    (c,) = preflight.run(
        ["tiny"], SM90, roles=["prefill"], overrides={"block-size": 32}
    )
    assert c.status == "accepted"
    assert (c.block_size, c.kernel_block_size) == (32, 32)
    assert "block_size not supported" in c.layers[0].reasons[default.layers[0].pick]


@pytest.fixture
def no_excerpts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No shipped config excerpts, an empty Hugging Face cache, offline."""
    monkeypatch.setattr(preflight, "EXCERPTS", tmp_path / "data")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    return tmp_path


def test_hub_profile_without_a_config_is_unknown_and_downloads_nothing(
    no_excerpts: Path,
) -> None:
    checks = preflight.run(["kimi-k2.5"], GPUS)
    assert {c.status for c in checks} == {"unknown"}
    for c in checks:
        (note,) = c.notes
        # The option to pass, and where the shipped profiles keep theirs.
        assert "pass --target-config" in note and "tests/data/<profile>/" in note
    assert not (no_excerpts / "empty").exists()


def test_unknown_fails_the_command_unless_allowed(
    no_excerpts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A preflight that can only say unknown must not pass a CI step."""
    args = ["--profile", "kimi-k2.5", "--capability", "9.0", "--role", "decode"]
    assert preflight.main(args) == preflight_cli.UNKNOWN
    out, err = capsys.readouterr()
    assert "unknown" in out.splitlines()[1] and "--allow-unknown" in err
    assert preflight.main([*args, "--allow-unknown"]) == 0
    capsys.readouterr()
    assert preflight.main([*args, "--json"]) == preflight_cli.UNKNOWN
    assert json.loads(capsys.readouterr().out)["ok"] is False


def test_a_hub_profile_reads_its_shipped_excerpt() -> None:
    (c,) = preflight.run(["kimi-k2.5"], SM90, roles=["decode"])
    assert c.status == "accepted", c.notes
    assert "config.json read from tests/data/kimi-k2.5/" in c.notes
    assert preflight.excerpt("kimi-k2.5", preflight.DRAFT_EXCERPT) == (
        KIMI_LIKE / "draft_config.json"
    )


def test_the_legend_only_where_a_pick_is_marked(no_excerpts: Path) -> None:
    legend = "*: see the notes"
    unknown = preflight.run(["kimi-k2.5"], SM90)
    assert unknown[0].notes and legend not in preflight.table(unknown)
    (marked,) = preflight.run(["tiny"], SM90, roles=["prefill"])
    assert marked.layers[0].pick_unbuilt  # FLASHMLA: no kernels on a CPU host
    assert legend in preflight.table([marked])


def test_the_command_prints_no_vllm_log_lines(tmp_path: Path) -> None:
    """vLLM's warnings about this host (no Triton) are not the preflight's."""
    args = ["--profile", "tiny", "--capability", "9.0", "--role", "prefill"]
    command = [sys.executable, "-m", "pdstack.preflight", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith("profile ")
    verbose = subprocess.run(
        [*command, "--verbose"], capture_output=True, text=True, timeout=600
    )
    assert "Triton" in verbose.stderr  # the negative control: they exist


# Kimi-K2.5's shapes (a text_config nested in a multimodal wrapper) and its
# Eagle draft's.
KIMI_LIKE = Path(__file__).parent / "data" / "kimi-k2.5"
KIMI = dict(
    model_config=KIMI_LIKE / "config.json", draft_config=KIMI_LIKE / "draft_config.json"
)
KIMI_KV = config.vllm_flags("decode", "kimi-k2.5", "gpu")["kv-transfer-config"]


def test_hub_profile_with_given_configs_is_checked() -> None:
    checks = preflight.run(["kimi-k2.5"], GPUS, **KIMI)
    for c in checks:
        assert c.status == "accepted", c.problems
        assert c.dtype == "bfloat16"  # the checkpoint's: no dtype flag
        # tensor-parallel-size 8: 64 heads are 8 per rank.
        assert [la.num_heads for la in c.layers] == [8, 8]
        assert c.regions[0]["layers"] == 61


def _kimi(staging_mib: int | None = None, **extra: Any) -> list[preflight.Check]:
    overrides = {}
    if staging_mib is not None:
        extra[staging.KEY] = staging_mib
    if extra:
        extra = {**KIMI_KV["kv_connector_extra_config"], **extra}
        overrides["kv-transfer-config"] = KIMI_KV | {"kv_connector_extra_config": extra}
    return preflight.run(["kimi-k2.5"], SM90, ("decode",), overrides, **KIMI)


def test_a_staging_buffer_in_device_memory_says_what_to_lower() -> None:
    """Over RDMA the buffer is device memory vLLM did not budget for; over
    TCP (configs/vllm) pinned host memory, and no note."""
    (rdma,) = _kimi(mooncake_protocol="rdma")
    (note,) = [n for n in rdma.notes if staging.KEY in n]
    assert "256 MiB" in note and "gpu-memory-utilization" in note
    (tcp,) = _kimi()
    assert KIMI_KV["kv_connector_extra_config"]["mooncake_protocol"] == "tcp"
    assert not [n for n in tcp.notes if staging.KEY in n]


def test_the_staging_buffer_names_the_tokens_one_chunk_carries() -> None:
    """Kimi-K2.5's 70 KB a token on each rank: 256 MiB carry a few thousand
    tokens a chunk; the figure is the plugin's own span bound, and a prompt
    longer than it is no problem (it crosses in chunks)."""
    (c,) = _kimi()
    assert c.status == "accepted" and c.kernel_block_size and c.chunk_tokens
    block_bytes = [r["bytes_per_block"] for r in c.regions for _ in range(r["layers"])]
    capacity = KIMI_KV["kv_connector_extra_config"][staging.KEY] << 20
    blocks = c.chunk_tokens // c.kernel_block_size
    assert staging.span_bound([blocks], block_bytes) <= capacity
    assert staging.span_bound([blocks + 1], block_bytes) > capacity
    assert c.chunk_tokens < 131072  # max-model-len: several chunks, still staged
    assert not [n for n in c.notes + c.problems if staging.KEY in n]


def test_a_staging_buffer_without_room_for_one_block_is_a_problem(
    tiny: list[preflight.Check],
) -> None:
    (off,) = _kimi(staging_mib=0)
    assert off.chunk_tokens is None
    assert all(c.chunk_tokens >= 8192 for c in tiny)  # the tiny pair's max-model-len
    # 1 MiB: less than one of Kimi-K2.5's blocks over its 61 layers.
    (small,) = _kimi(staging_mib=1)
    assert small.chunk_tokens == 0
    (problem,) = [p for p in small.problems if staging.KEY in p]
    assert "holds no whole KV block" in problem


def test_cli_prints_batch_invariance_and_fails_a_rejection(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--profile", "tiny", "--capability", "9.0", "--role", "prefill"]
    assert preflight.main([*args, "--print", "batch-invariant"]) == 0
    assert capsys.readouterr().out == "1\n"
    assert preflight.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["checks"][0]["capability"] == "9.0"
    assert preflight.main([*args, "--set", "dtype=float32"]) == 1
    assert "`dtype`" in capsys.readouterr().out


def test_reasons_for_missing_kernels_are_not_rejections() -> None:
    assert cuda_selector.is_availability("ModuleNotFoundError: No module named 'x'")
    assert cuda_selector.is_availability(
        "vllm._flashmla_C is not available, likely was not compiled"
    )
    for reason in preflight.FIXES:
        assert not cuda_selector.is_availability(reason)


def test_serve_runs_the_preflight_before_exec_on_gpu(
    configs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    execs: list[list[str]] = []
    monkeypatch.setattr(serve.os, "execvpe", lambda _f, argv, _e: execs.append(argv))
    monkeypatch.setattr(preflight, "device_gpus", lambda: SM90)
    serve.main(["--role", "prefill", "--target", "gpu", "--profile", "tiny"])
    assert len(execs) == 1
    set_gpu_flag(configs, "dtype", "float32")
    with pytest.raises(SystemExit) as stop:
        serve.main(["--role", "prefill", "--target", "gpu", "--profile", "tiny"])
    assert stop.value.code == 2 and len(execs) == 1
    monkeypatch.setenv("PD_PREFLIGHT", "0")  # the kill switch
    serve.main(["--role", "prefill", "--target", "gpu", "--profile", "tiny"])
    assert len(execs) == 2


@pytest.mark.parametrize("profile", config.profile_names())
def test_every_shipped_profile_is_accepted_on_sm90(profile: str) -> None:
    """Not vacuously: each reads its model's shapes (tests/data/<profile>/ or
    the generated pair), and an unknown is a failure here too."""
    checks = preflight.run([profile], SM90)
    assert {c.status for c in checks} == {"accepted"}, [c.notes for c in checks]
    assert all(c.regions and c.kernel_block_size for c in checks)


def _tp_pair(profile: str, p: int, d: int, checksum: bool) -> list[str]:
    """The pair's problems on sm90 (``checksum``: kv_checksum on both roles)."""
    pair = {}
    for role, size in (("prefill", p), ("decode", d)):
        kv = config.vllm_flags(role, profile, "gpu")["kv-transfer-config"]
        extra = {**kv["kv_connector_extra_config"], "kv_checksum": checksum}
        pair[role] = {
            "tensor-parallel-size": size,
            "kv-transfer-config": kv | {"kv_connector_extra_config": extra},
        }
    checks = preflight.run([profile], SM90, role_overrides=pair)
    assert len(checks) == 2
    return [p for c in checks for p in c.problems if "TP" in p]


def test_tp_pairs_upstream_serves_are_accepted() -> None:
    """The same width (checksum on), and an MLA model without a GQA layer
    (DeepSeek-V3 with its MTP layer) at widths that divide, checksum off."""
    assert _tp_pair("tiny", 2, 2, checksum=True) == []
    assert _tp_pair("deepseek-v3", 8, 4, checksum=False) == []
    assert _tp_pair("deepseek-v3", 4, 8, checksum=False) == []


def test_tp_pairs_upstream_cannot_serve_are_refused_by_name() -> None:
    (why,) = set(_tp_pair("tiny", 2, 1, checksum=False))
    assert why.startswith("prefill TP 2 -> decode TP 1") and "draft (2 KV heads" in why
    (why,) = set(_tp_pair("tiny", 1, 2, checksum=True))
    assert why.startswith("prefill TP 1 -> decode TP 2") and "kv_checksum" in why
    (why,) = set(_tp_pair("deepseek-v3", 8, 3, checksum=False))
    assert why.startswith("prefill TP 8 -> decode TP 3") and "divide" in why


def test_cli_refuses_a_tp_pair_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--profile", "tiny", "--capability", "9.0"]
    assert preflight.main([*args, "--tp-pair", "2:2"]) == 0
    capsys.readouterr()
    assert preflight.main([*args, "--tp-pair", "1:2"]) == 1
    assert "prefill TP 1 -> decode TP 2" in capsys.readouterr().out
