"""The CPU twin: prefill, decode and vllm-router as local processes.

    python -m pdstack.twin up      # returns when all three answer /health
    python -m pdstack.twin down    # stops exactly the processes `up` started
    python -m pdstack.twin status

State (pids, logs) lives in ``$PD_RUN_DIR`` (default ``run/twin``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pdstack import config, wait

RUN_DIR = Path(
    os.environ.get(
        "PD_RUN_DIR", Path(__file__).resolve().parent.parent / "run" / "twin"
    )
)
HOST = "127.0.0.1"
# A cold start on 2 cores takes about a minute per server; leave room.
SERVER_DEADLINE_S = float(os.environ.get("PD_SERVER_DEADLINE_S", "600"))
ROUTER_DEADLINE_S = 120.0
STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class Urls:
    router: str
    prefill: str
    decode: str
    bootstrap_port: int


def urls() -> Urls:
    p = config.ports()
    return Urls(
        router=f"http://{HOST}:{p.router}",
        prefill=f"http://{HOST}:{p.prefill}",
        decode=f"http://{HOST}:{p.decode}",
        bootstrap_port=p.bootstrap,
    )


def _start_time(pid: int) -> str | None:
    """The live process's start time (a reused pid is never mistaken for
    ours); None once it has exited, zombies included."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    if fields is None:
        return None
    if fields[0] == "Z":
        # Exited; reap it if it is our child (`up` and `down` in one process).
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return None
    return fields[19]


def _state_file(run_dir: Path) -> Path:
    return run_dir / "processes.json"


def launch(
    name: str, argv: list[str], env: Mapping[str, str], run_dir: Path, mode: str = "wb"
) -> subprocess.Popen:
    """Start ``argv`` in its own session, output to ``run_dir/<name>.log``."""
    log = (run_dir / f"{name}.log").open(mode)
    # Own session: `down` signals the whole group (vLLM forks its engine core).
    return subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )


def _record(run_dir: Path, procs: dict[str, subprocess.Popen]) -> None:
    state = {
        name: {"pid": p.pid, "start": _start_time(p.pid)} for name, p in procs.items()
    }
    _state_file(run_dir).write_text(json.dumps(state, indent=1))


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
    run_dir.mkdir(parents=True, exist_ok=True)
    if running(run_dir):
        raise wait.WaitError(
            f"a twin is already running (state in {run_dir}); run `down` first"
        )
    u = urls()
    for name, url in (
        ("router", u.router),
        ("prefill", u.prefill),
        ("decode", u.decode),
    ):
        if wait.healthy(url):
            raise wait.WaitError(
                f"port of {name} ({url}) is already in use by another server"
            )
    from pdstack.serve import command
    from pdstack.tiny_model import ensure_models

    if config.profile(profile).get("generate") == "tiny":
        ensure_models(progress=progress)
    procs: dict[str, subprocess.Popen] = {}
    try:
        for role in config.ROLES:
            argv, env = command(role, profile, "cpu", HOST)
            env = {**env, **(role_env or {}).get(role, {})}
            procs[role] = launch(role, argv, env, run_dir)
            _record(run_dir, procs)
            log = run_dir / f"{role}.log"
            progress(f"started {role} (pid {procs[role].pid}), log {log}")
        for role in config.ROLES:
            url = u.prefill if role == "prefill" else u.decode
            took = wait.until_healthy(
                role,
                url,
                SERVER_DEADLINE_S,
                procs[role],
                run_dir / f"{role}.log",
                progress,
            )
            progress(f"{role} healthy at {url} ({took:.0f}s)")
        procs["router"] = launch("router", router_command(u, router_extra), {}, run_dir)
        _record(run_dir, procs)
        took = wait.until_healthy(
            "router",
            u.router,
            ROUTER_DEADLINE_S,
            procs["router"],
            run_dir / "router.log",
            progress,
        )
        progress(f"router healthy at {u.router} ({took:.0f}s)")
    except BaseException:
        down(run_dir, progress)
        raise
    return u


def router_command(u: Urls, extra: list[str] | None = None) -> list[str]:
    """vllm-router's argv for the twin; ``extra`` flags win (argparse: last wins)."""
    argv = [
        "vllm-router",
        *config.router_args(
            u.prefill,
            u.bootstrap_port,
            u.decode,
            HOST,
            int(u.router.rsplit(":", 1)[1]),
        ),
        *(extra or []),
    ]
    router_bin = Path(sys.executable).parent / "vllm-router"
    if router_bin.exists():
        argv[0] = str(router_bin)
    return argv


def running(run_dir: Path = RUN_DIR) -> dict[str, int]:
    """Processes of the recorded twin that are still alive (and still ours)."""
    path = _state_file(run_dir)
    if not path.exists():
        return {}
    alive = {}
    for name, entry in json.loads(path.read_text()).items():
        if entry["start"] is not None and _start_time(entry["pid"]) == entry["start"]:
            alive[name] = entry["pid"]
    return alive


def down(run_dir: Path = RUN_DIR, progress=print) -> None:
    alive = running(run_dir)
    for name, pid in alive.items():
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        progress(f"stopping {name} (pid {pid})")
    deadline = time.monotonic() + STOP_GRACE_S
    while running(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    for name, pid in running(run_dir).items():
        progress(f"{name} (pid {pid}) ignored SIGTERM for {STOP_GRACE_S:.0f}s; killing")
    # Also whatever a leader left behind in its group (vLLM's engine core).
    for pid in alive.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    # SIGKILL is delivered asynchronously: return only once the groups are gone.
    deadline = time.monotonic() + STOP_GRACE_S
    while any(_group_alive(pid) for pid in alive.values()):
        if time.monotonic() > deadline:
            progress("some processes outlived SIGKILL; see `ps -eo pid,pgid,cmd`")
            break
        time.sleep(0.05)
    _state_file(run_dir).unlink(missing_ok=True)


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is in process group ``pgid``."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _stat_fields(stat: Path) -> list[str] | None:
    """/proc/<pid>/stat after the command name (state, ppid, pgrp, ...);
    None once the process is gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


# --- One role at a time: what a supervisor (compose `restart:`, Kubernetes)
# does to a crashed server, for the fault tests.
ROLE_NAMES = (*config.ROLES, "router")


def _update_record(run_dir: Path, name: str, proc: subprocess.Popen) -> None:
    path = _state_file(run_dir)
    state = json.loads(path.read_text()) if path.exists() else {}
    state[name] = {"pid": proc.pid, "start": _start_time(proc.pid)}
    path.write_text(json.dumps(state, indent=1))


def kill(
    role: str, run_dir: Path = RUN_DIR, progress=print, deadline_s: float = 30.0
) -> float:
    """SIGKILL one role and its process group, as a crash would (no graceful
    shutdown, no goodbye to peers). Returns the seconds until it was gone."""
    if role not in ROLE_NAMES:
        raise ValueError(f"unknown role {role!r}; known: {', '.join(ROLE_NAMES)}")
    pid = running(run_dir).get(role)
    if pid is None:
        raise wait.WaitError(f"{role} is not running (state in {run_dir})")
    start = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    while role in running(run_dir):
        if time.monotonic() - start > deadline_s:
            raise wait.WaitError(f"{role} (pid {pid}) survived SIGKILL")
        time.sleep(0.1)
    took = time.monotonic() - start
    progress(f"killed {role} (pid {pid})")
    return took


def start_role(
    role: str,
    run_dir: Path = RUN_DIR,
    profile: str = "tiny",
    env: dict[str, str] | None = None,
    router_extra: list[str] | None = None,
    progress=print,
) -> float:
    """Start one role of a recorded twin again (same ports, same flags) and
    wait until it answers /health; returns the seconds that took.

    ``env`` adds environment (e.g. the role's ``role_env`` given to ``up``);
    ``router_extra`` adds vllm-router flags. The log is appended to.
    """
    if role not in ROLE_NAMES:
        raise ValueError(f"unknown role {role!r}; known: {', '.join(ROLE_NAMES)}")
    if role in running(run_dir):
        raise wait.WaitError(f"{role} is already running (state in {run_dir})")
    u = urls()
    if role == "router":
        argv, role_env = router_command(u, router_extra), {}
        url, deadline = u.router, ROUTER_DEADLINE_S
    else:
        from pdstack.serve import command

        argv, role_env = command(role, profile, "cpu", HOST)
        url = u.prefill if role == "prefill" else u.decode
        deadline = SERVER_DEADLINE_S
    proc = launch(role, argv, {**role_env, **(env or {})}, run_dir, mode="ab")
    _update_record(run_dir, role, proc)
    log = run_dir / f"{role}.log"
    progress(f"started {role} again (pid {proc.pid}), log {log}")
    took = wait.until_healthy(role, url, deadline, proc, log, progress)
    progress(f"{role} healthy at {url} ({took:.0f}s)")
    return took


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
