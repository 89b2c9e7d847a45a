"""The Makefile: where its knobs come from, and what `make help` lists.

Every knob follows one precedence, for make's own recipes and for what it
hands compose and the e2e suite: the command line, then the shell, then .env
(compose's file), then the default. A recipe run by make sees the values make
resolved and exported, exactly as compose and pytest do in `make up` and
`make e2e`.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from pdstack.compose import ROOT

KNOBS = ("PD_PROFILE", "ROUTER_PORT", "TARGET")
# The Makefile before the precedence was fixed: `PROFILE ?= tiny` and an
# `include configs/ports.env` that beat the shell.
OLD_MAKEFILE_COMMIT = "59dfbe4"


def seen(
    tmp_path: Path,
    env_file: str | None,
    shell: dict[str, str],
    args: list[str] = (),
    makefile: Path = ROOT / "Makefile",
) -> dict[str, str]:
    """The knobs as a recipe of ``makefile`` sees them in its environment."""
    dotenv = tmp_path / "dot.env"
    dotenv.write_text(env_file or "")
    probe = 'probe: ; @echo "' + " ".join(f"{k}=$${{{k}-}}" for k in KNOBS) + '"'
    clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/")}
    argv = ["make", "-s", "-f", str(makefile), f"ENV_FILE={dotenv}", *args]
    result = subprocess.run(
        [*argv, "--eval", probe, "probe"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**clean, **shell},
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return dict(word.split("=", 1) for word in result.stdout.split())


@pytest.mark.parametrize(
    ("dotenv", "shell", "args", "expected"),
    [
        ("", {}, [], {"PD_PROFILE": "tiny", "ROUTER_PORT": "8000", "TARGET": "gpu"}),
        (
            "PD_PROFILE=kimi-k2.5\nROUTER_PORT=9100\nTARGET=cpu\n",
            {},
            [],
            {"PD_PROFILE": "kimi-k2.5", "ROUTER_PORT": "9100", "TARGET": "cpu"},
        ),
        (
            'PD_PROFILE="kimi-k2.5"  # quoted, commented\nROUTER_PORT=9100\n',
            {"ROUTER_PORT": "9000"},
            [],
            {"PD_PROFILE": "kimi-k2.5", "ROUTER_PORT": "9000", "TARGET": "gpu"},
        ),
        (
            "PD_PROFILE=kimi-k2.5\n",
            {"PD_PROFILE": "shell-profile"},
            ["PD_PROFILE=cli-profile", "ROUTER_PORT=7000"],
            {"PD_PROFILE": "cli-profile", "ROUTER_PORT": "7000", "TARGET": "gpu"},
        ),
    ],
    ids=["defaults", "dotenv", "shell-beats-dotenv", "command-line-beats-all"],
)
def test_knobs_take_command_line_then_shell_then_dotenv_then_default(
    tmp_path: Path,
    dotenv: str,
    shell: dict[str, str],
    args: list[str],
    expected: dict[str, str],
) -> None:
    assert seen(tmp_path, dotenv, shell, args) == expected


def test_negative_control_the_old_makefile_ignored_the_shell_and_dotenv(
    tmp_path: Path,
) -> None:
    old = tmp_path / "Makefile.old"
    shown = subprocess.run(
        ["git", "show", f"{OLD_MAKEFILE_COMMIT}:Makefile"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if shown.returncode != 0:
        pytest.skip(f"no {OLD_MAKEFILE_COMMIT} in this clone's history")
    old.write_text(shown.stdout)
    found = seen(
        tmp_path,
        "PD_PROFILE=kimi-k2.5\n",
        {"PD_PROFILE": "kimi-k2.5", "ROUTER_PORT": "9000"},
        makefile=old,
    )
    # What users met: the tiny pair, and configs/ports.env over the shell.
    assert found["PD_PROFILE"] == "tiny"
    assert found["ROUTER_PORT"] == "8000"


def test_what_compose_and_the_suite_are_given_follows_the_knobs(tmp_path: Path) -> None:
    dotenv = tmp_path / "dot.env"
    dotenv.write_text("PD_PROFILE=kimi-k2.5\n")
    env = {"PATH": os.environ["PATH"], "ROUTER_PORT": "9000"}
    lines = {}
    for target in ("up-e2e", "e2e"):
        result = subprocess.run(
            ["make", "-n", f"ENV_FILE={dotenv}", target, "TARGET=cpu"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            check=False,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        lines[target] = result.stdout
    assert "PD_PROFILE=kimi-k2.5" in lines["up-e2e"]
    assert "-f docker/compose.cpu.yaml" in lines["up-e2e"]
    assert "PD_PROFILE=kimi-k2.5" in lines["e2e"]
    assert "--router-url http://localhost:9000" in lines["e2e"]


def help_text() -> str:
    return subprocess.run(
        ["make", "-s", "help"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout


def test_help_lists_every_target_the_docs_name() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {
        target
        for doc in docs
        for target in re.findall(r"`make ([a-z0-9-]+)", doc.read_text())
    }
    listed = set(re.findall(r"^  ([a-z0-9-]+) ", help_text(), re.MULTILINE))
    assert named, "no `make <target>` found in the docs"
    missing = named - listed
    assert missing == set(), f"documented but not in `make help`: {missing}"


def test_help_prints_no_make_syntax() -> None:
    assert "$(" not in help_text()
