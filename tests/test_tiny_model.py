"""The tiny model pair: layout vLLM expects, determinism, and the fitted draft.

Most tests share one real generation (1-2 minutes on 2 cores, reused from the
model cache afterwards). The byte-for-byte reproducibility check generates twice
more and only runs with PD_TINY_MODEL_REPRO=1.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdstack import kv_layout
from pdstack import tiny_model as tm

SPECIALS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}


def _small_draft(path: Path, drop: str | None = None, extra: str | None = None) -> None:
    """A draft checkpoint with a 16-token vocab, optionally damaged."""
    config = tm.draft.draft_config(16, SPECIALS)
    weights = tm.draft.init_draft_weights(config)
    if drop:
        del weights[drop]
    if extra:
        weights[extra] = torch.zeros(1)
    path.mkdir(parents=True)
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


# --- no generation needed ---------------------------------------------------------
def test_draft_check_accepts_the_full_layout(tmp_path: Path) -> None:
    _small_draft(tmp_path / "draft")
    tm.verify_draft_checkpoint(tmp_path / "draft")


def test_draft_check_names_a_missing_key(tmp_path: Path) -> None:
    """Negative control: vLLM itself would load this silently."""
    _small_draft(tmp_path / "draft", drop="midlayer.self_attn.k_proj.weight")
    with pytest.raises(tm.DraftCheckpointError, match=r"missing=.*k_proj"):
        tm.verify_draft_checkpoint(tmp_path / "draft")


def test_draft_check_names_unexpected_keys_and_wrong_shapes(tmp_path: Path) -> None:
    _small_draft(tmp_path / "draft", extra="embed_tokens.weight")
    with pytest.raises(tm.DraftCheckpointError, match=r"unexpected=.*embed_tokens"):
        tm.verify_draft_checkpoint(tmp_path / "draft")
    config = tm.draft.draft_config(16, SPECIALS)
    shapes = tm.draft.expected_draft_shapes(config) | {"fc.weight": (256, 256)}
    with pytest.raises(tm.DraftCheckpointError, match=r"wrong_shape=.*fc\.weight"):
        tm.draft.check_draft_weights(shapes, config)


def test_stamp_changes_with_any_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    before = tm.generator_stamp()
    assert tm.generator_stamp() == before
    monkeypatch.setattr(tm.params, "DRAFT_FC_STD", tm.params.DRAFT_FC_STD * 2)
    assert tm.generator_stamp() != before


def _fake_generate(calls: list[Path], fail: bool = False) -> Callable[..., dict]:
    def generate(out_dir: Path, progress: Callable[[str], None]) -> dict:
        calls.append(out_dir)
        (out_dir / "target").mkdir(parents=True)
        (out_dir / "target" / "model.safetensors").write_bytes(b"")
        if fail:
            raise KeyboardInterrupt  # as if the generation were killed
        _small_draft(out_dir / "draft")
        (out_dir / "draft" / tm.params.PROBE_FILE).write_text("{}")
        return {}

    return generate


def test_ensure_models_generates_once_then_reuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(tm.cache, "generate", _fake_generate(calls))
    first = tm.ensure_models(tmp_path, progress=lambda _: None)
    assert tm.ensure_models(tmp_path, progress=lambda _: None) == first
    assert len(calls) == 1
    assert first.target.parent.name.endswith(tm.generator_stamp()[:16])
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.target.parent.name]


def test_killed_generation_leaves_nothing_that_looks_valid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(tm.cache, "generate", _fake_generate(calls, fail=True))
    with pytest.raises(KeyboardInterrupt):
        tm.ensure_models(tmp_path, progress=lambda _: None)
    assert list(tmp_path.iterdir()) == []
    # A temp dir really left behind by a SIGKILL is cleared once it is stale.
    orphan = tmp_path / f".pd-tiny-dsv2-eagle3-{tm.generator_stamp()[:16]}.tmp-orphan"
    orphan.mkdir()
    old = time.time() - 2 * tm.cache.STALE_TEMP_S
    os.utime(orphan, (old, old))
    monkeypatch.setattr(tm.cache, "generate", _fake_generate(calls))
    tm.ensure_models(tmp_path, progress=lambda _: None)
    assert not orphan.exists()


def test_generated_names_only_a_finished_run_of_this_generator(tmp_path: Path) -> None:
    assert tm.cache.generated(tmp_path) is None
    final = tmp_path / f"pd-tiny-dsv2-eagle3-{tm.generator_stamp()[:16]}"
    (final / "draft").mkdir(parents=True)
    (final / "draft" / tm.params.PROBE_FILE).write_text("{}")
    assert tm.cache.generated(tmp_path) is None  # no stamp yet: still running
    stamp = final / tm.cache.STAMP_FILE
    stamp.write_text(json.dumps({"stamp": "another generator"}))
    assert tm.cache.generated(tmp_path) is None
    stamp.write_text(json.dumps({"stamp": tm.generator_stamp()}))
    assert tm.cache.generated(tmp_path) == tm.TinyModels(
        final / "target", final / "draft"
    )


# --- on the real generated pair -----------------------------------------------------
def test_target_config_is_deepseek_mla_with_yarn(models: tm.TinyModels) -> None:
    config = json.loads((models.target / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV2ForCausalLM"]
    assert config["num_hidden_layers"] == tm.params.TARGET_NUM_LAYERS
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576
    assert config["q_lora_rank"] is None
    assert config["first_k_dense_replace"] == config["num_hidden_layers"]
    assert config["max_position_embeddings"] >= 4096 + tm.params.PROBE_MAX_TOKENS
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "yarn"
    assert "attention_factor" not in rope  # vLLM would then pick llama scaling
    assert (rope["factor"], rope["original_max_position_embeddings"]) == (40.0, 4096)
    assert (rope["mscale"], rope["mscale_all_dim"]) == (0.707, 0.707)
    generation = json.loads((models.target / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]
    assert set(generation) <= {*SPECIALS, "transformers_version"}


def test_layout_configs_are_the_generated_files_but_the_tokenizer(
    models: tm.TinyModels,
) -> None:
    """What a client venv reads instead of generating the pair (no torch):
    every field of the files, the tokenizer's aside, and so the same layout."""
    pure = tm.layout_configs()
    for path, fields in zip((models.target, models.draft), pure, strict=True):
        files = json.loads((path / "config.json").read_text())
        tokenizer_fields = {"vocab_size", "draft_vocab_size", *SPECIALS}
        assert {k: files.get(k) for k in fields if k not in tokenizer_fields} == {
            k: v for k, v in fields.items() if k not in tokenizer_fields
        }, path
    for dtype, block in (("float32", 16), ("bfloat16", 64)):
        generated = kv_layout.layout(
            kv_layout.read_config(models.target),
            kv_layout.read_config(models.draft),
            dtype,
            block,
        )
        assert kv_layout.layout(*pure, dtype, block) == generated


def test_draft_is_a_complete_eagle3_llama(
    models: tm.TinyModels, weights: dict[str, torch.Tensor]
) -> None:
    tm.verify_draft_checkpoint(models.draft)
    config = json.loads((models.draft / "config.json").read_text())
    target = json.loads((models.target / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == target["vocab_size"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert weights["fc.weight"].shape[1] == 3 * target["hidden_size"]


def test_tokenizer_is_byte_level_with_bos(models: tm.TinyModels) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models.target)
    text = "The decode server received the cache of a 4096-token prompt. Ça va?"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert 10 <= len(ids) <= len(text) // 2  # ~2.5 characters per token
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.eos_token == tm.params.EOS_TOKEN and tok.eos_token_id is not None


def test_probes_are_the_targets_greedy_continuations(
    models: tm.TinyModels, target: torch.nn.Module
) -> None:
    probes = tm.load_probes(models)
    assert len(probes) == sum(count for _, count in tm.params.PROBE_GROUPS)
    # Random weights still give every prompt its own continuation.
    assert len({tuple(p.greedy[:8]) for p in probes}) == len(probes)
    for probe in probes[:2] + probes[8:10]:
        with torch.no_grad():
            out = target.generate(
                torch.tensor([probe.prompt]),
                max_new_tokens=12,
                do_sample=False,
                attention_mask=torch.ones(1, len(probe.prompt), dtype=torch.long),
            )
        assert out[0, len(probe.prompt) :].tolist() == probe.greedy[:12]


def test_draft_predicts_probes_only_with_its_own_prompt_kv(
    models: tm.TinyModels,
    target: torch.nn.Module,
    weights: dict[str, torch.Tensor],
    embed: torch.Tensor,
) -> None:
    """The detector property, on the plain-PyTorch copy of vLLM's Eagle3
    forward: ~100% on the probes, far less once the draft's KV of the prompt
    is lost."""
    prompts = torch.tensor([p.prompt for p in tm.load_probes(models)[16:24]])
    assert prompts.shape[1] == 48  # one probe group: equal lengths
    start = prompts.shape[1] - 1
    with tm.cache.deterministic_torch(), torch.no_grad():
        trace = tm.target.greedy_trace(target, prompts, tm.params.PROBE_MAX_TOKENS)
        kept = tm.eagle3.draft_first_pass(weights, embed, trace, start)
        lost = tm.eagle3.draft_first_pass(
            weights, embed, trace, start, lose_prompt_kv=True
        )

    def accuracy(normed: torch.Tensor) -> float:
        guess = (normed[:, :-1] @ weights["lm_head.weight"].T).argmax(-1)
        return (guess == trace.greedy[:, start + 1 :]).float().mean().item()

    assert accuracy(kept.normed) >= 0.99
    assert accuracy(lost.normed) < 0.8


def test_cli_prints_the_two_paths_last(models: tm.TinyModels) -> None:
    cache = models.target.parent.parent
    out = subprocess.run(
        [sys.executable, "-m", "pdstack.tiny_model", "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert out.stdout.splitlines()[-2:] == [
        f"target={models.target}",
        f"draft={models.draft}",
    ]


@pytest.mark.skipif(
    os.environ.get("PD_TINY_MODEL_REPRO") != "1",
    reason="generates twice (minutes); set PD_TINY_MODEL_REPRO=1",
)
def test_generation_is_byte_identical(tmp_path: Path) -> None:
    def digests(root: Path) -> dict[str, str]:
        return {
            str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != tm.cache.STAMP_FILE  # holds timings
        }

    a = tm.ensure_models(tmp_path / "a", progress=lambda _: None)
    b = tm.ensure_models(tmp_path / "b", progress=lambda _: None)
    assert digests(a.target.parent) == digests(b.target.parent)
