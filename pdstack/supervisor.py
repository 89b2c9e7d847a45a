"""The servers the stack starts on this host, and stopping them for certain.

Every server runs in its own session, so its process group holds it and all
it forks (vLLM: the API server, its ``VLLM::EngineCore`` and workers). Each
is recorded as (pid, create_time, pgid) in a state file, so that another
process (``twin down``, the next bench) finds it again and a reused pid is
never mistaken for ours.

Stopping goes by the group, not by its leader: an API server killed alone (a
crash, the OOM killer) leaves its engine core and workers running as orphans
of init, holding the model's memory. The group id outlives the leader, and
the kernel does not hand the number out again while any member lives.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from pdstack import config, serve, wait

HOST = "127.0.0.1"
# A cold start on 2 cores takes about a minute per server; leave room.
SERVER_DEADLINE_S = float(os.environ.get("PD_SERVER_DEADLINE_S", "600"))
ROUTER_DEADLINE_S = 120.0
STOP_GRACE_S = 20.0
# psutil's create_time is boot time plus clock ticks: the same for one
# process every time, but a float.
SAME_START_S = 0.01
# The checkout pdstack is imported from (for the router's `python -m`).
ROOT = Path(__file__).resolve().parent.parent
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Urls:
    """Where a P/D stack answers; the bench adds a colocated server."""

    router: str
    prefill: str
    decode: str
    bootstrap_port: int
    colocated: str = ""


def urls(ports: config.Ports | None = None) -> Urls:
    p = config.ports() if ports is None else ports
    return Urls(
        router=f"http://{HOST}:{p.router}",
        prefill=f"http://{HOST}:{p.prefill}",
        decode=f"http://{HOST}:{p.decode}",
        bootstrap_port=p.bootstrap,
    )


def router_command(
    u: Urls,
    extra: Iterable[str] = (),
    metrics_port: int | None = None,
    host: str = HOST,
    internal_port: int | None = None,
) -> list[str]:
    """The stack's router for ``u`` (``pdstack.route``: vllm-router behind
    the front), listening on ``host``; ``extra`` vllm-router flags win
    (argparse: last wins). ``metrics_port`` None: configs/ports.env's
    ROUTER_METRICS_PORT; ``internal_port`` (vllm-router's own, behind the
    front) None: the router's port + 1, which a caller picking the router's
    port with free_port has not checked: it passes one of its own."""
    port = urlsplit(u.router).port
    assert port is not None, u.router
    options = {
        "--prefill": u.prefill,
        "--decode": u.decode,
        "--host": host,
        "--port": port,
        "--bootstrap-port": u.bootstrap_port,
        "--metrics-port": config.ports().router_metrics
        if metrics_port is None
        else metrics_port,
    }
    if internal_port is not None:
        options["--internal-port"] = internal_port
    argv = [sys.executable, "-m", "pdstack.route"]
    argv += [str(word) for item in options.items() for word in item]
    return [*argv, "--", *extra]


def role_command(
    role: str, u: Urls, profile: str, host: str, router_extra: Iterable[str] = ()
) -> tuple[list[str], dict[str, str], float]:
    """On the CPU, listening on ``host``: vllm-router for ``u`` or one server
    of ``profile`` (``pdstack.serve``); its argv, environment, health deadline."""
    if role == "router":
        # pdstack from this checkout, wherever the caller was started.
        path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
        argv = router_command(u, router_extra, host=host)
        return argv, {"PYTHONPATH": path}, ROUTER_DEADLINE_S
    return *serve.command(role, profile, "cpu", host), SERVER_DEADLINE_S


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((HOST, port)) == 0


def describe(proc: psutil.Process) -> str:
    try:
        # cmdline: vLLM's titles (VLLM::EngineCore) are longer than a comm.
        name = (proc.cmdline() or [proc.name()])[0]
    except psutil.Error:
        name = "?"
    return f"{name} (pid {proc.pid})"


@dataclass(frozen=True)
class Record:
    """One started server: its leader's pid and start time, and its group."""

    pid: int
    create_time: float
    pgid: int

    @classmethod
    def of(cls, pid: int) -> Record:
        return cls(pid, psutil.Process(pid).create_time(), os.getpgid(pid))

    def leader(self) -> psutil.Process | None:
        """The recorded process, if it is alive and still the one started."""
        return next((p for p in self.members() if p.pid == self.pid), None)

    def members(self) -> list[psutil.Process]:
        """The group's live processes, the leader's orphans included; none if
        the number names another group now (every member of ours started no
        earlier than the leader, and a live leader is the recorded one)."""
        found = []
        for proc in psutil.process_iter(["create_time", "status"]):
            try:
                if os.getpgid(proc.pid) != self.pgid:
                    continue
            except OSError:
                continue
            started = proc.info["create_time"]
            if started is not None and (
                started < self.create_time - SAME_START_S
                or (proc.pid == self.pid and started > self.create_time + SAME_START_S)
            ):
                return []
            if proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
                continue
            # Exited: collect it if it is our child (a zombie keeps its group).
            with contextlib.suppress(ChildProcessError):
                os.waitpid(proc.pid, os.WNOHANG)
        return found


def _signal(pgid: int, sig: signal.Signals) -> None:
    # The whole group at once: also what it forks while being stopped.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait(
    records: Mapping[str, Record],
    groups: Mapping[str, list[psutil.Process]],
    timeout_s: float,
) -> dict[str, list[psutil.Process]]:
    """Wait up to ``timeout_s`` for ``groups``; what is left of them after."""
    psutil.wait_procs([p for procs in groups.values() for p in procs], timeout_s)
    return {name: left for name in groups if (left := records[name].members())}


def stop(records: Mapping[str, Record], progress: Progress = print) -> None:
    """SIGTERM each recorded group, SIGKILL what is left after STOP_GRACE_S;
    returns when every member is gone, whether or not its leader still was."""
    groups = {name: procs for name, r in records.items() if (procs := r.members())}
    for name, procs in groups.items():
        record = records[name]
        if any(p.pid == record.pid for p in procs):
            progress(f"stopping {name} (pid {record.pid})")
        else:
            left = ", ".join(describe(p) for p in procs)
            progress(
                f"{name} (pid {record.pid}) is gone but left {left} running in "
                "its process group; stopping them"
            )
        _signal(record.pgid, signal.SIGTERM)
    left = _wait(records, groups, STOP_GRACE_S)
    for name in left:
        progress(
            f"{name} (pid {records[name].pid}) ignored SIGTERM for "
            f"{STOP_GRACE_S:.0f}s; killing"
        )
        _signal(records[name].pgid, signal.SIGKILL)
    if left and _wait(records, left, STOP_GRACE_S):
        progress("some processes outlived SIGKILL; see `ps -eo pid,pgid,cmd`")


class Processes:
    """Servers started with their logs in ``run_dir``, recorded in
    ``run_dir/<state>``."""

    def __init__(
        self, run_dir: Path, state: str = "processes.json", progress: Progress = print
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.path = run_dir / state
        self.progress = progress
        # Known only to the process that started them.
        self.popen: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}

    def log(self, name: str) -> Path:
        return self.run_dir / f"{name}.log"

    def records(self) -> dict[str, Record]:
        try:
            state = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        out = {}
        for name, entry in state.items():
            with contextlib.suppress(KeyError, TypeError, ValueError):
                out[name] = Record(
                    int(entry["pid"]), float(entry["create_time"]), int(entry["pgid"])
                )
        return out

    def _write(self, records: Mapping[str, Record]) -> None:
        if records:
            state = {name: asdict(r) for name, r in records.items()}
            self.path.write_text(json.dumps(state, indent=1))
        else:
            self.path.unlink(missing_ok=True)

    def running(self) -> dict[str, int]:
        """Recorded servers whose leader is alive (and still ours): name -> pid."""
        return {name: r.pid for name, r in self.records().items() if r.leader()}

    def launch(
        self,
        name: str,
        argv: list[str],
        env: Mapping[str, str],
        url: str = "",
        again: bool = False,
    ) -> subprocess.Popen:
        """Start ``argv`` in its own session, output to ``<name>.log``
        (appended to ``again``), and record it."""
        log = self.log(name)
        with log.open("ab" if again else "wb") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
        self.popen[name], self.urls[name] = proc, url
        self._write({**self.records(), name: Record.of(proc.pid)})
        self.progress(f"started {name}{' again' * again} (pid {proc.pid}), log {log}")
        return proc

    def wait_healthy(self, name: str, deadline_s: float) -> float:
        """Seconds until ``name`` answered /health (fails early if it exits)."""
        url = self.urls[name]
        took = wait.until_healthy(
            name, url, deadline_s, self.popen.get(name), self.log(name), self.progress
        )
        self.progress(f"{name} healthy at {url} ({took:.0f}s)")
        return took

    def stop(self, names: Iterable[str] | None = None) -> None:
        """Stop the recorded servers (``names``, default all), orphans
        included, and forget them."""
        records = self.records()
        chosen = {
            n: records[n] for n in (records if names is None else names) if n in records
        }
        stop(chosen, self.progress)
        for name in chosen:
            self.popen.pop(name, None)
        self._write({n: r for n, r in self.records().items() if n not in chosen})

    def kill(self, name: str, deadline_s: float = 30.0) -> float:
        """SIGKILL ``name``'s whole group, as a crash would (no graceful
        shutdown, no goodbye to peers); seconds until all of it was gone."""
        record = self.records()[name]
        start = time.monotonic()
        procs = record.members()
        _signal(record.pgid, signal.SIGKILL)
        if _wait({name: record}, {name: procs}, deadline_s):
            raise wait.WaitError(f"{name} (pid {record.pid}) survived SIGKILL")
        return time.monotonic() - start
