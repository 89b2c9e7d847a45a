"""Fixtures several tests/ modules share: copies of what a test changes, the
generated tiny model pair."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pdstack import config
from pdstack import tiny_model as tm
from tests.shared import SMALL_RUN

if TYPE_CHECKING:
    import torch


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A copy of the small recorded run (bench/fixtures/small-run)."""
    return shutil.copytree(SMALL_RUN, tmp_path / "run")


@pytest.fixture
def configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of configs/ that pdstack.config renders from."""
    copy = shutil.copytree(config.CONFIGS, tmp_path / "configs")
    monkeypatch.setattr(config, "CONFIGS", copy)
    return copy


@pytest.fixture(scope="module")
def models() -> tm.TinyModels:
    return tm.ensure_models(progress=lambda line: print(line, flush=True))


@pytest.fixture(scope="module")
def target(models: tm.TinyModels) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(models.target).eval()


@pytest.fixture(scope="module")
def weights(models: tm.TinyModels) -> dict[str, torch.Tensor]:
    """The draft's."""
    from safetensors.torch import load_file

    return load_file(models.draft / "model.safetensors")


@pytest.fixture(scope="module")
def embed(target: torch.nn.Module) -> torch.Tensor:
    """The target's: vLLM shares it with a draft checkpoint that has none."""
    return target.get_input_embeddings().weight.detach()
