"""Fixtures several tests/ modules share: copies of what a test changes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pdstack import config
from tests.shared import SMALL_RUN


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A copy of the small recorded run (bench/fixtures/small-run)."""
    target = tmp_path / "run"
    shutil.copytree(SMALL_RUN, target)
    return target


@pytest.fixture
def configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of configs/ that pdstack.config renders from."""
    copy = tmp_path / "configs"
    shutil.copytree(config.CONFIGS, copy)
    monkeypatch.setattr(config, "CONFIGS", copy)
    return copy
