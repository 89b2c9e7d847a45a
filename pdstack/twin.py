"""The CPU twin: prefill, decode and vllm-router as local processes.

    python -m pdstack.twin up      # returns when all three answer /health
    python -m pdstack.twin down    # stops exactly the processes `up` started
    python -m pdstack.twin status

State (pids, logs) lives in ``$PD_RUN_DIR`` (default ``run/twin``); the
processes are kept by ``pdstack.supervisor``, which stops a server's whole
process group, also what a crashed server left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Collection
from pathlib import Path

from pdstack import config, supervisor, wait
from pdstack.compose import ROOT
from pdstack.supervisor import HOST, Urls, urls

RUN_DIR = Path(os.environ.get("PD_RUN_DIR", ROOT / "run" / "twin"))
ROLE_NAMES = (*config.ROLES, "router")


def processes(
    run_dir: Path = RUN_DIR, progress: supervisor.Progress = print
) -> supervisor.Processes:
    return supervisor.Processes(run_dir, progress=progress)


def role_cpus(role: str, profile: str, available: Collection[int]) -> list[int] | None:
    """The CPUs ``role`` runs on: with both roles tensor-parallel, prefill on
    the first half of ``available`` and decode on the rest, as on two hosts;
    None (any CPU) at TP 1, for the router, and with a single CPU.

    Why (issue 28): while prefill holds KV for decode's pulls its engine
    steps continuously and its TP workers yield-spin on vLLM's shared-memory
    queue; on 2 shared cores that took about 90% of both, and decode's TP
    ranks, which meet in a yield-spinning all-reduce, and its Mooncake
    threads got about 5% (a send stalled and was resent for 16 s, a first
    burst took 60 s instead of 10). docs/reliability.md, "TP 2 on 2 cores".
    """
    if role not in config.ROLES or len(available) < 2:
        return None
    flags = config.with_env_overrides(config.vllm_flags(role, profile, "cpu"))
    if int(flags.get("tensor-parallel-size", 1)) < 2:
        return None
    cpus = sorted(available)
    half = len(cpus) // 2
    return cpus[:half] if role == "prefill" else cpus[half:]


def _launch(
    procs: supervisor.Processes,
    role: str,
    profile: str,
    u: Urls,
    env: dict[str, str] | None,
    router_extra: list[str] | None,
    again: bool = False,
) -> float:
    """Start ``role`` on the twin's ports; returns its health deadline."""
    argv, role_env, deadline = supervisor.role_command(
        role, u, profile, HOST, router_extra or ()
    )
    cpus = role_cpus(role, profile, os.sched_getaffinity(0))
    if cpus:
        # taskset execs the server: the same pid, its processes inherit the set.
        argv = ["taskset", "--cpu-list", ",".join(map(str, cpus)), *argv]
    procs.launch(role, argv, {**role_env, **(env or {})}, getattr(u, role), again)
    return deadline


def up(
    profile: str = "tiny",
    run_dir: Path = RUN_DIR,
    progress=print,
    role_env: dict[str, dict[str, str]] | None = None,
    router_extra: list[str] | None = None,
) -> Urls:
    """Start the twin; on any failure, stop what was started and raise.

    ``role_env`` adds environment per role, e.g. a test fault on decode;
    ``router_extra`` adds vllm-router flags (e.g. the fault suite's timeouts).
    """
    procs = processes(run_dir, progress)
    if procs.running():
        raise wait.WaitError(
            f"a twin is already running (state in {run_dir}); run `down` first"
        )
    # What a crashed twin left behind (an engine core whose server died).
    procs.stop()
    u = urls()
    for name in ("router", *config.ROLES):
        url = getattr(u, name)
        if wait.healthy(url):
            raise wait.WaitError(
                f"port of {name} ({url}) is already in use by another server"
            )
    # The tiny pair, generated first if the profile asks for it.
    config.tiny_substitutions(profile, progress)
    try:
        deadlines = {
            role: _launch(procs, role, profile, u, (role_env or {}).get(role), None)
            for role in config.ROLES
        }
        for role in config.ROLES:
            procs.wait_healthy(role, deadlines[role])
        procs.wait_healthy(
            "router", _launch(procs, "router", profile, u, None, router_extra)
        )
    except BaseException:
        procs.stop()
        raise
    return u


def running(run_dir: Path = RUN_DIR) -> dict[str, int]:
    """Processes of the recorded twin that are still alive (and still ours)."""
    return processes(run_dir).running()


def down(run_dir: Path = RUN_DIR, progress=print) -> None:
    """Stop every recorded server, orphans included (``supervisor.stop``)."""
    processes(run_dir, progress).stop()


# --- One role at a time: what a supervisor (compose `restart:`, Kubernetes)
# does to a crashed server, for the fault tests.


def _known(role: str) -> None:
    if role not in ROLE_NAMES:
        raise ValueError(f"unknown role {role!r}; known: {', '.join(ROLE_NAMES)}")


def kill(role: str, run_dir: Path = RUN_DIR, progress=print) -> float:
    """One role's ``supervisor.Processes.kill`` (a crash); the seconds it took."""
    _known(role)
    procs = processes(run_dir, progress)
    pid = procs.running().get(role)
    if pid is None:
        raise wait.WaitError(f"{role} is not running (state in {run_dir})")
    took = procs.kill(role)
    progress(f"killed {role} (pid {pid})")
    return took


def start_role(
    role: str,
    run_dir: Path = RUN_DIR,
    profile: str = "tiny",
    env: dict[str, str] | None = None,
    progress=print,
) -> float:
    """Start one role of a recorded twin again (same ports, same flags, its log
    appended to; ``env`` added, e.g. its ``role_env`` given to ``up``); returns
    the seconds until it answered /health."""
    _known(role)
    procs = processes(run_dir, progress)
    if role in procs.running():
        raise wait.WaitError(f"{role} is already running (state in {run_dir})")
    deadline = _launch(procs, role, profile, urls(), env, None, again=True)
    return procs.wait_healthy(role, deadline)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CPU twin of the P/D stack")
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--profile", default="tiny")
    opts = parser.parse_args(argv)
    try:
        if opts.action == "up":
            u = up(opts.profile)
            print(f"twin up: router {u.router}, prefill {u.prefill}, decode {u.decode}")
        elif opts.action == "down":
            down()
        else:
            alive = running()
            print(json.dumps(alive) if alive else "twin not running")
            return 0 if alive else 1
    except (wait.WaitError, config.ConfigError) as exc:
        print(f"twin {opts.action} failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
