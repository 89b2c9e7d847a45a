"""The servers the bench starts on the CPU twin: the P/D stack and a colocated one.

Built from the same pdstack functions as the twin (``serve.command`` renders
prefill and decode from configs/, ``supervisor.router_command`` the router),
with one difference, logged: the router gets a free Prometheus port
(vllm-router binds 29000 by default, so two twins on one host, CI and a
bench, would collide there). ``pdstack.supervisor`` keeps the processes, in
``STATE_FILE``: a killed bench's servers are stopped by the next one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from unittest import mock

from pdstack import config, supervisor, wait
from pdstack.supervisor import HOST, Progress, Urls, free_port, port_in_use

STATE_FILE = "bench-processes.json"


def processes(run_dir: Path, progress: Progress = print) -> supervisor.Processes:
    return supervisor.Processes(run_dir, STATE_FILE, progress)


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
    argv[argv.index("--port") + 1] = str(port)
    return argv, env


def _check_free(ports: Mapping[str, int], what_to_set: str) -> None:
    for name, port in ports.items():
        if port_in_use(port):
            raise wait.WaitError(
                f"{name} port {port} on {HOST} is in use: set {what_to_set}"
            )


def start_pd(
    stack: supervisor.Processes, profile: str, env: Mapping[str, str] | None = None
) -> tuple[Urls, dict[str, float], list[str]]:
    """Prefill, decode and router on the configured ports, with ``env`` on top
    of this process's environment (e.g. ``PD_MOONCAKE_KV_CHECKSUM=0``: what
    pdstack.config's ENV_OVERRIDES render, what the plugin reads); returns the
    URLs, seconds to healthy per server (and in total), and the adjustments made."""
    with mock.patch.dict(os.environ, dict(env or {})):
        return _start_pd(stack, profile)


def restart_pd(
    stack: supervisor.Processes, profile: str, env: Mapping[str, str]
) -> tuple[Urls, dict[str, float], list[str]]:
    """The P/D servers stopped (if running) and started again with ``env``
    (empty: the environment untouched); as start_pd. The bench's one way to
    run a stack with a setting changed, and to have fresh servers."""
    stack.stop(["router", "decode", "prefill"])
    return start_pd(stack, profile, env)


def _start_pd(
    stack: supervisor.Processes, profile: str
) -> tuple[Urls, dict[str, float], list[str]]:
    ports = config.ports()
    urls = supervisor.urls(ports)
    names = ("router", "prefill", "decode", "bootstrap", "side_channel")
    variables = "ROUTER_PORT, PREFILL_PORT, DECODE_PORT, BOOTSTRAP_PORT to free ones"
    _check_free({n.replace("_", " "): getattr(ports, n) for n in names}, variables)
    start = time.monotonic()
    for role in config.ROLES:
        port = getattr(ports, role)
        stack.launch(role, *_vllm_argv(role, profile, port), f"http://{HOST}:{port}")
    timings = {}
    for role in config.ROLES:
        stack.wait_healthy(role, supervisor.SERVER_DEADLINE_S)
        timings[role] = time.monotonic() - start
    metrics_port = free_port()
    notes = [f"router: --prometheus-port {metrics_port} (29000 may be taken)"]
    router = supervisor.router_command(urls, metrics_port=metrics_port)
    stack.launch("router", router, {}, urls.router)
    stack.wait_healthy("router", supervisor.ROUTER_DEADLINE_S)
    timings["router"] = timings["total"] = time.monotonic() - start
    return urls, timings, notes


def start_colocated(
    stack: supervisor.Processes, profile: str, port: int, threads: int
) -> tuple[str, float, list[str]]:
    """One vLLM server with P/D's flags minus the KV connector, given the
    threads and the KV cache of both P/D servers together."""
    _check_free({"colocated": port}, "BENCH_COLOCATED_PORT")
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
    stack.wait_healthy("colocated", supervisor.SERVER_DEADLINE_S)
    return url, time.monotonic() - start, notes


def generate_model(cache_dir: Path, log: Path, deadline_s: float = 900.0) -> float:
    """Generate the tiny model pair into an empty ``cache_dir``; seconds taken."""
    start = time.monotonic()
    argv = [sys.executable, "-m", "pdstack.tiny_model", "--cache-dir", str(cache_dir)]
    with log.open("wb") as out:
        try:
            subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=True,
                           timeout=deadline_s, stdin=subprocess.DEVNULL)  # fmt: skip
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise wait.WaitError(
                f"tiny model generation failed ({exc}); log {log}:\n{wait.tail(log)}"
            ) from exc
    return time.monotonic() - start
