"""The twin as separate hosts: xPyD, each server on a host of its own.

    python -m pdstack.hosts up [--prefills 2 --decodes 2]   # returns when healthy
    python -m pdstack.hosts down

Each prefill, decode and the router run in their own network namespace
(``pdstack.netns``), advertise their own address (``VLLM_HOST_IP``, as the
Kubernetes manifests set the pod IP) and find each other by name, as pods do
through cluster DNS (``prefill-0``, ...): vllm-router is given the names.
Each prefill has its own engine id, its host name (``PD_ENGINE_ID``, the
StatefulSet pod name on Kubernetes). Mooncake's KV traffic crosses a real IP
stack between hosts. Needs root; state in ``run/hosts``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from pdstack import config, netns, supervisor, wait

RUN_DIR = Path(__file__).resolve().parent.parent / "run" / "hosts"
TAG = "mh"
ROUTER = "router"


def role_of(name: str) -> str:
    role = name.rsplit("-", 1)[0]
    if role not in (*config.ROLES, ROUTER):
        raise ValueError(f"no role in host name {name!r}")
    return role


@dataclass
class HostsTwin:
    """Prefills and decodes behind one router, each on its own host."""

    prefills: int = 2
    decodes: int = 2
    profile: str = "tiny"
    run_dir: Path = RUN_DIR
    progress: supervisor.Progress = print
    # Extra environment per role (prefill, decode) and vllm-router flags.
    role_env: Mapping[str, Mapping[str, str]] | None = None
    router_extra: Iterable[str] = ()

    def __post_init__(self) -> None:
        if self.prefills < 1 or self.decodes < 1:
            raise ValueError("at least one prefill and one decode")
        self.names = [
            ROUTER,
            *(f"prefill-{i}" for i in range(self.prefills)),
            *(f"decode-{i}" for i in range(self.decodes)),
        ]
        self.net = netns.Network(TAG, self.names)
        self.procs = supervisor.Processes(self.run_dir, progress=self.progress)
        self.ports = config.ports()

    # --- where things answer ----------------------------------------------

    def servers(self, role: str) -> list[str]:
        return [n for n in self.names if role_of(n) == role]

    def port(self, name: str) -> int:
        return getattr(self.ports, role_of(name))  # Ports: router, prefill, decode

    def url(self, name: str) -> str:
        """``name``'s base URL from this process (its current address)."""
        return f"http://{self.net[name].address}:{self.port(name)}"

    @property
    def router(self) -> str:
        return self.url(ROUTER)

    # --- life cycle --------------------------------------------------------

    def up(self) -> HostsTwin:
        """Build the hosts and start every server, then the router; on any
        failure (Ctrl-C too) stop and remove what was started, and raise."""
        if reason := netns.missing_privileges():
            raise wait.WaitError(f"the multi-host twin cannot start: {reason}")
        self.procs.stop()  # a previous run's servers, if its state survived
        # The tiny pair, generated first if the profile asks for it.
        config.tiny_substitutions(self.profile, self.progress)
        try:
            self.net.create()
            servers = [n for n in self.names if n != ROUTER]
            deadlines = {name: self.start(name, wait_healthy=False) for name in servers}
            for name in servers:
                self.procs.wait_healthy(name, deadlines[name])
            self.procs.wait_healthy(ROUTER, self.start(ROUTER, wait_healthy=False))
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop every server (whole process groups) and remove the hosts."""
        self.procs.stop()
        self.net.remove()

    def start(self, name: str, again: bool = False, wait_healthy: bool = True) -> float:
        """Start ``name`` on its host; the seconds until it answered /health,
        or without ``wait_healthy`` its health deadline (to wait for it later)."""
        host = self.net[name]
        role = role_of(name)
        # The servers by name, as pods' DNS names: what the router holds
        # resolves anew.
        by_name = {
            r: ",".join(f"http://{n}:{self.port(n)}" for n in self.servers(r))
            for r in config.ROLES
        }
        u = supervisor.Urls(
            router=self.router,
            prefill=by_name["prefill"],
            decode=by_name["decode"],
            bootstrap_port=self.ports.bootstrap,
        )
        # serve reads site overrides (PD_ENGINE_ID) from the environment, as
        # inside a container; the router listens on its host's address.
        site = {"PD_ENGINE_ID": name} if role == "prefill" else {}
        bind = host.address if role == ROUTER else "0.0.0.0"
        with mock.patch.dict(os.environ, site):
            argv, env, deadline = supervisor.role_command(
                role, u, self.profile, bind, self.router_extra
            )
        if role != ROUTER:
            # The host's own address, not the twin's loopback pin.
            extra = (self.role_env or {}).get(role, {})
            env = {**env, **extra, "VLLM_HOST_IP": host.address}
        self.procs.launch(
            name, [*host.exec_prefix(), *argv], env, self.url(name), again
        )
        return self.procs.wait_healthy(name, deadline) if wait_healthy else deadline

    def kill(self, name: str) -> float:
        """SIGKILL ``name``'s whole process group, as a crash would."""
        return self.procs.kill(name)

    def recreate(self, name: str) -> float:
        """What Kubernetes does to a deleted pod: the server killed, its host
        back on a new address under the same name (and engine id), the
        server started again there. Returns the seconds until healthy."""
        self.kill(name)
        address = self.net.readdress(name)
        self.progress(f"{name} re-created at {address}")
        return self.start(name, again=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("up", "down"))
    parser.add_argument("--prefills", type=int, default=2)
    parser.add_argument("--decodes", type=int, default=2)
    parser.add_argument("--profile", default="tiny")
    opts = parser.parse_args(argv)
    twin = HostsTwin(opts.prefills, opts.decodes, opts.profile)
    try:
        if opts.action == "down":
            twin.down()
            return 0
        twin.up()
    except (wait.WaitError, netns.NetnsError, config.ConfigError) as exc:
        print(f"hosts {opts.action} failed: {exc}", file=sys.stderr)
        return 1
    for name in twin.names:
        print(f"{name}: {twin.url(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
