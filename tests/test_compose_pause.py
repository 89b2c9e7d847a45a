"""e2e/compose_stack.pause: runc's freezer refusing a busy container is
tried again, anything else fails at once. The refusal cannot be provoked on
demand (seen once, on a prefill serving requests), so a stand-in `docker`
on PATH answers with Docker's own message for it."""

from __future__ import annotations

import importlib
import stat
import sys
from pathlib import Path
from types import ModuleType

import pytest

REFUSAL = (
    "Error response from daemon: Cannot pause container abc: "
    "OCI runtime pause failed: unable to freeze: unknown"
)


@pytest.fixture
def compose_stack(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "e2e"))
    module = importlib.import_module("compose_stack")
    monkeypatch.setattr(module, "PAUSE_RETRY_S", 0.01)
    return module


def stand_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusals: int, message: str
) -> Path:
    """A `docker` that fails ``refusals`` times with ``message``, then succeeds;
    each call is logged."""
    log = tmp_path / "calls"
    script = tmp_path / "docker"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"log = {str(log)!r}\n"
        "open(log, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        f"if len(open(log).readlines()) <= {refusals}:\n"
        f"    sys.stderr.write({message!r}); sys.exit(1)\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    return log


def test_a_refused_freeze_is_tried_again(
    compose_stack: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = stand_in(tmp_path, monkeypatch, 2, REFUSAL)
    assert compose_stack.pause("abc") == 3
    assert log.read_text().splitlines() == ["pause abc"] * 3


def test_other_errors_fail_at_once(
    compose_stack: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = stand_in(tmp_path, monkeypatch, 5, "Error: No such container: abc")
    with pytest.raises(compose_stack.ComposeError, match="No such container"):
        compose_stack.pause("abc")
    assert len(log.read_text().splitlines()) == 1


def test_refusals_past_the_deadline_fail(
    compose_stack: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in(tmp_path, monkeypatch, 10**6, REFUSAL)
    with pytest.raises(compose_stack.ComposeError, match=r"refused \d+ times"):
        compose_stack.pause("abc", deadline_s=0.2)
