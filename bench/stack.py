"""The servers the bench starts on the CPU twin: the P/D stack and a colocated one.

Built from the same pdstack functions as the twin (``serve.command`` renders
prefill and decode from configs/, ``config.router_args`` the router), with one
difference, logged:

- the router gets a free Prometheus port: vllm-router binds 29000 by default,
  so two twins on one host (CI and a bench) would collide there.

Every process runs in its own session; ``stop`` signals the whole group
(vLLM forks an engine core). Pids and start times are kept in
``<run_dir>/bench-processes.json`` so a killed bench's servers are stopped by
the next one, and a reused pid is never mistaken for ours.
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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from pdstack import config, twin, wait

HOST = "127.0.0.1"
SERVER_DEADLINE_S = float(os.environ.get("PD_SERVER_DEADLINE_S", "600"))
ROUTER_DEADLINE_S = 120.0
STOP_GRACE_S = 20.0
STATE_FILE = "bench-processes.json"
Progress = Callable[[str], None]


@dataclass
class Server:
    name: str
    process: subprocess.Popen
    log: Path
    url: str
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.process.pid


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((HOST, port)) == 0


def _record(run_dir: Path, servers: Mapping[str, Server]) -> None:
    state = {}
    for name, server in servers.items():
        with contextlib.suppress(psutil.Error):
            state[name] = {
                "pid": server.pid,
                "create_time": psutil.Process(server.pid).create_time(),
            }
    (run_dir / STATE_FILE).write_text(json.dumps(state, indent=1))


def _ours(entry: Mapping[str, Any]) -> bool:
    try:
        proc = psutil.Process(int(entry["pid"]))
        return (
            abs(proc.create_time() - float(entry["create_time"])) < 0.01
            and proc.status() != psutil.STATUS_ZOMBIE
        )
    except (psutil.Error, KeyError, ValueError):
        return False


def stop_leftovers(run_dir: Path, progress: Progress = print) -> None:
    """Stop the servers a previous, killed bench left running in ``run_dir``."""
    path = run_dir / STATE_FILE
    if not path.exists():
        return
    for name, entry in json.loads(path.read_text()).items():
        if _ours(entry):
            progress(f"stopping {name} (pid {entry['pid']}) left by an earlier bench")
            _kill_group(int(entry["pid"]))
    path.unlink(missing_ok=True)


def _kill_group(
    pid: int,
    grace_s: float = STOP_GRACE_S,
    reap: Callable[[], object] | None = None,
) -> None:
    """SIGTERM the process group led by ``pid``; SIGKILL what is left after
    ``grace_s``. ``reap`` collects the leader if it is our child (a zombie
    still counts as a member of its group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if reap is not None:
            reap()
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.25)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    if reap is not None:
        reap()


class Stack:
    """Servers started by the bench, stopped together (also on errors)."""

    def __init__(self, run_dir: Path, progress: Progress = print) -> None:
        self.run_dir = run_dir
        self.progress = progress
        self.servers: dict[str, Server] = {}
        run_dir.mkdir(parents=True, exist_ok=True)

    def launch(
        self, name: str, argv: list[str], env: Mapping[str, str], url: str
    ) -> Server:
        log = self.run_dir / f"{name}.log"
        process = twin.launch(name, argv, env, self.run_dir)
        server = Server(name, process, log, url)
        self.servers[name] = server
        _record(self.run_dir, self.servers)
        self.progress(f"started {name} (pid {process.pid}), log {log}")
        return server

    def wait_healthy(self, name: str, deadline_s: float) -> float:
        server = self.servers[name]
        took = wait.until_healthy(
            name, server.url, deadline_s, server.process, server.log, self.progress
        )
        self.progress(f"{name} healthy at {server.url} ({took:.0f}s)")
        return took

    def stop(self, names: list[str] | None = None) -> None:
        for name in list(names or self.servers):
            server = self.servers.pop(name, None)
            if server is None:
                continue
            if server.process.poll() is None:
                self.progress(f"stopping {name} (pid {server.pid})")
            _kill_group(server.pid, reap=server.process.poll)
        _record(self.run_dir, self.servers)

    def pids(self, names: list[str]) -> list[int]:
        return [self.servers[n].pid for n in names if n in self.servers]


def _vllm_argv(
    role: str, profile: str, port: int, drop: tuple[str, ...] = ()
) -> tuple[list[str], dict[str, str]]:
    """pdstack.serve's command for ``role`` on ``port``, without ``drop``'s flags."""
    from pdstack import serve

    argv, env = serve.command(role, profile, "cpu", HOST)
    for flag in drop:
        if f"--{flag}" in argv:
            i = argv.index(f"--{flag}")
            del argv[i : i + 2]
    i = argv.index("--port")
    argv[i + 1] = str(port)
    return argv, env


@dataclass(frozen=True)
class PdUrls:
    router: str
    prefill: str
    decode: str
    bootstrap_port: int


def start_pd(
    stack: Stack, profile: str, progress: Progress = print
) -> tuple[PdUrls, dict[str, float], list[str]]:
    """Prefill, decode and router on the configured ports; returns the URLs,
    seconds to healthy per server (and in total), and the adjustments made."""
    ports = config.ports()
    urls = PdUrls(
        router=f"http://{HOST}:{ports.router}",
        prefill=f"http://{HOST}:{ports.prefill}",
        decode=f"http://{HOST}:{ports.decode}",
        bootstrap_port=ports.bootstrap,
    )
    for name, port in (
        ("router", ports.router),
        ("prefill", ports.prefill),
        ("decode", ports.decode),
        ("bootstrap", ports.bootstrap),
    ):
        if port_in_use(port):
            raise wait.WaitError(
                f"{name} port {port} on {HOST} is in use: set ROUTER_PORT, "
                "PREFILL_PORT, DECODE_PORT, BOOTSTRAP_PORT to free ones"
            )
    start = time.monotonic()
    notes: list[str] = []
    for role, port in (("prefill", ports.prefill), ("decode", ports.decode)):
        argv, env = _vllm_argv(role, profile, port)
        stack.launch(role, argv, env, f"http://{HOST}:{port}")
    timings = {}
    for role in ("prefill", "decode"):
        stack.wait_healthy(role, SERVER_DEADLINE_S)
        timings[role] = time.monotonic() - start
    metrics_port = free_port()
    router_argv = [
        str(Path(sys.executable).parent / "vllm-router"),
        *config.router_args(
            urls.prefill,
            urls.bootstrap_port,
            urls.decode,
            HOST,
            ports.router,
            metrics_port,
        ),
    ]
    notes.append(f"router: --prometheus-port {metrics_port} (29000 may be taken)")
    stack.launch("router", router_argv, {}, urls.router)
    stack.wait_healthy("router", ROUTER_DEADLINE_S)
    timings["router"] = time.monotonic() - start
    timings["total"] = timings["router"]
    return urls, timings, notes


def start_colocated(
    stack: Stack,
    profile: str,
    port: int,
    threads: int,
    progress: Progress = print,
) -> tuple[str, float, list[str]]:
    """One vLLM server with P/D's flags minus the KV connector, given the
    threads and the KV cache of both P/D servers together."""
    if port_in_use(port):
        raise wait.WaitError(
            f"colocated port {port} on {HOST} is in use: set BENCH_COLOCATED_PORT"
        )
    kv_bytes = sum(
        int(config.vllm_flags(role, profile, "cpu")["kv-cache-memory-bytes"])
        for role in config.ROLES
    )
    argv, env = _vllm_argv(
        "prefill", profile, port, drop=("kv-transfer-config", "kv-cache-memory-bytes")
    )
    argv += ["--kv-cache-memory-bytes", str(kv_bytes)]
    env = {k: v for k, v in env.items() if k != "VLLM_MOONCAKE_BOOTSTRAP_PORT"}
    env["OMP_NUM_THREADS"] = str(threads)
    notes = [
        f"colocated: no kv-transfer-config, OMP_NUM_THREADS={threads}, "
        f"--kv-cache-memory-bytes {kv_bytes} (prefill's and decode's together)"
    ]
    url = f"http://{HOST}:{port}"
    start = time.monotonic()
    stack.launch("colocated", argv, env, url)
    stack.wait_healthy("colocated", SERVER_DEADLINE_S)
    return url, time.monotonic() - start, notes


@contextlib.contextmanager
def model_cache(path: Path | None) -> Iterator[None]:
    """Point PD_MODEL_CACHE at ``path`` inside the block (None: unchanged)."""
    if path is None:
        yield
        return
    before = os.environ.get("PD_MODEL_CACHE")
    os.environ["PD_MODEL_CACHE"] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PD_MODEL_CACHE", None)
        else:
            os.environ["PD_MODEL_CACHE"] = before


def generate_model(cache_dir: Path, log: Path, deadline_s: float = 900.0) -> float:
    """Generate the tiny model pair into an empty ``cache_dir``; seconds taken."""
    start = time.monotonic()
    with log.open("wb") as out:
        try:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pdstack.tiny_model",
                    "--cache-dir",
                    str(cache_dir),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=deadline_s,
                stdin=subprocess.DEVNULL,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise wait.WaitError(
                f"tiny model generation failed ({exc}); log {log}:\n{wait.tail(log)}"
            ) from exc
    return time.monotonic() - start
