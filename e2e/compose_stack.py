"""The compose stack under test, as an operator reaches it: the compose
command (``--compose``, which ``make e2e E2E_COMPOSE_FAULTS=1`` passes) and
the Docker CLI. Only e2e/test_faults_5_compose.py uses it; every other module
judges a stack by its URLs alone.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from pdstack import wait


class ComposeError(RuntimeError):
    pass


@dataclass(frozen=True)
class Compose:
    """``command``: the compose CLI with the stack's project, files and env files."""

    command: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Compose:
        return cls(tuple(shlex.split(text)))

    def run(self, *args: str, timeout: float = 300) -> str:
        return _checked([*self.command, *args], timeout)

    def container(self, service: str) -> str:
        """The service's container id (one replica)."""
        ids = self.run("ps", "--all", "--quiet", service).split()
        if len(ids) != 1:
            raise ComposeError(f"{service}: expected one container, found {ids}")
        return ids[0]

    def inspect(self, service: str) -> dict[str, Any]:
        return json.loads(docker("inspect", self.container(service)))[0]

    def network(self, service: str) -> tuple[str, str, list[str]]:
        """(network, address, aliases) of the service's one network."""
        networks = self.inspect(service)["NetworkSettings"]["Networks"]
        if len(networks) != 1:
            raise ComposeError(f"{service}: expected one network, found {networks}")
        ((name, net),) = networks.items()
        return name, net["IPAddress"], net.get("Aliases") or []

    def env(self, service: str, name: str) -> str | None:
        for entry in self.inspect(service)["Config"]["Env"]:
            key, _, value = entry.partition("=")
            if key == name:
                return value
        return None

    def abort_timeout_s(self) -> float | None:
        """How long prefill keeps KV a dead decode never pulls, as its
        container sets it (None: vLLM's default)."""
        raw = self.env("prefill", "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT")
        return float(raw) if raw else None

    def state(self, service: str) -> tuple[str, str, int]:
        """(status, health, restart count) of the service's container."""
        found = self.inspect(service)
        health = (found["State"].get("Health") or {}).get("Status", "")
        return found["State"]["Status"], health, int(found.get("RestartCount", 0))

    def until_restarted(self, service: str, count: int, deadline_s: float) -> None:
        """Until the restart policy has restarted the service ``count`` times
        (a crashed container is healthy in Docker's eyes until it notices)."""
        wait.poll(
            lambda: self.state(service)[2],
            lambda n: n >= count,
            deadline_s,
            f"{service} restarted by its restart policy",
            interval_s=0.5,
        )

    def until_healthy(self, service: str, deadline_s: float) -> float:
        """Seconds until the service's container reports healthy."""
        start = time.monotonic()
        wait.poll(
            lambda: self.state(service)[:2],
            lambda s: s == ("running", "healthy"),
            deadline_s,
            f"{service} healthy",
            interval_s=1.0,
        )
        return time.monotonic() - start


def docker(*args: str, timeout: float = 120) -> str:
    """The Docker CLI (any client: nothing here builds)."""
    program = shutil.which("docker")
    if program is None:
        raise ComposeError("no docker client on PATH")
    return _checked([program, *args], timeout)


# runc's cgroup v1 freezer gives up ("unable to freeze") when the
# container's threads keep running through its bounded retries: seen on a
# prefill busy with requests (Docker Engine 20.10, 2026-12-03). It thaws what
# it froze, so another try starts clean.
FREEZE_REFUSED = "unable to freeze"
PAUSE_RETRY_S = 0.5


def pause(container: str, deadline_s: float = 30.0) -> int:
    """``docker pause``, tried again while the freezer refuses, until
    ``deadline_s``; returns the tries it took."""
    start, tries = time.monotonic(), 0
    while True:
        tries += 1
        try:
            docker("pause", container)
            return tries
        except ComposeError as exc:
            if FREEZE_REFUSED not in str(exc):
                raise
            if time.monotonic() - start >= deadline_s:
                raise ComposeError(
                    f"docker pause: the freezer refused {tries} times in "
                    f"{deadline_s:g}s: {exc}"
                ) from exc
        time.sleep(PAUSE_RETRY_S)


def _checked(argv: list[str], timeout: float) -> str:
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise ComposeError(f"{shlex.join(argv)}: {result.stderr.strip()[-500:]}")
    return result.stdout
