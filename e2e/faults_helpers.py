"""Helpers of the fault suite (e2e/test_faults.py): its own stack's ports and
settings (configs/faults.yaml), timed requests, and the leak check.

"Idle" is what every fault case must come back to: on prefill and decode no
request running or waiting and ``vllm:kv_cache_usage_perc`` at its value
before the case; on decode ``vllm:num_requests_kv_fetch_by_stage`` (all
stages) at 0. A block kept for a transfer that never comes shows as usage
above idle on prefill; a request stuck waiting for KV as a fetch stage above
0 on decode.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import yaml

from conftest import Stack
from pdstack import config, wait
from pdstack import metrics as m

FAULTS_CONFIG = config.CONFIGS / "faults.yaml"
KV_FETCH = "vllm:num_requests_kv_fetch_by_stage"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
SUCCESS = "vllm:request_success_total"
PORT_NAMES = (
    "ROUTER_PORT",
    "PREFILL_PORT",
    "DECODE_PORT",
    "BOOTSTRAP_PORT",
    "ROUTER_METRICS_PORT",
)


def settings() -> dict[str, Any]:
    data = yaml.safe_load(FAULTS_CONFIG.read_text())
    assert isinstance(data, dict), f"{FAULTS_CONFIG}: not a mapping"
    return data


def fault_ports(base: config.Ports, offsets: Mapping[str, int]) -> dict[str, str]:
    """The fault stack's port variables: the session twin's, moved."""
    values = {
        "ROUTER_PORT": base.router,
        "PREFILL_PORT": base.prefill,
        "DECODE_PORT": base.decode,
        "BOOTSTRAP_PORT": base.bootstrap,
        "ROUTER_METRICS_PORT": base.router_metrics,
    }
    return {name: str(values[name] + offsets.get(name, 0)) for name in PORT_NAMES}


def router_flags(flags: Mapping[str, Any]) -> list[str]:
    return config.render(flags, {})


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` for the duration (pdstack reads ports
    from the environment)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def port_in_use(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class FaultStack(Stack):
    """A stack the fault suite may break: its ports' environment and bounds."""

    env: dict[str, str] = field(default_factory=dict)
    bootstrap: str = ""
    bounds: dict[str, float] = field(default_factory=dict)
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)
    router_extra: list[str] = field(default_factory=list)
    idle: dict[str, float] = field(default_factory=dict)


# --- requests -----------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """A request's terminal answer (status None: no HTTP answer at all)."""

    status: int | None
    body: str
    seconds: float

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def token_ids(self) -> list[int] | None:
        try:
            return self.json()["choices"][0]["token_ids"]
        except (ValueError, KeyError, IndexError, TypeError):
            return None


def post(
    url: str,
    body: Mapping[str, Any] | None = None,
    *,
    raw: str | None = None,
    timeout: float = 120.0,
    headers: Mapping[str, str] | None = None,
    path: str = "/v1/completions",
) -> Outcome:
    start = time.monotonic()
    try:
        if raw is not None:
            answer = requests.post(
                url + path,
                data=raw,
                headers={"Content-Type": "application/json", **(headers or {})},
                timeout=timeout,
            )
        else:
            answer = requests.post(
                url + path, json=body, headers=dict(headers or {}), timeout=timeout
            )
    except requests.RequestException as exc:
        return Outcome(None, repr(exc), time.monotonic() - start)
    return Outcome(answer.status_code, answer.text, time.monotonic() - start)


def greedy(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """The body of pdstack.client.complete (greedy, fixed length, token ids)."""
    return {
        "model": "pd-model",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        "ignore_eos": True,
        **extra,
    }


def stream_then_leave(
    url: str, body: Mapping[str, Any], chunks: int, timeout: float = 120.0
) -> tuple[int, int, float]:
    """Stream, read ``chunks`` SSE events, close the connection.

    Returns (HTTP status, events read, seconds to the close).
    """
    start = time.monotonic()
    answer = requests.post(
        url + "/v1/completions",
        json={**body, "stream": True},
        stream=True,
        timeout=timeout,
    )
    read = 0
    try:
        for line in answer.iter_lines():
            if line.startswith(b"data:"):
                read += 1
            if read >= chunks:
                break
    finally:
        answer.close()
    return answer.status_code, read, time.monotonic() - start


# --- state: idle and leaks ------------------------------------------------------


def state(stack: Stack) -> dict[str, float]:
    """What must return to idle after every case."""
    p, d = m.scrape(stack.prefill), m.scrape(stack.decode)
    return {
        "prefill_kv_usage": p.total(m.KV_USAGE),
        "prefill_requests": p.total(RUNNING) + p.total(WAITING),
        "decode_kv_usage": d.total(m.KV_USAGE),
        "decode_requests": d.total(RUNNING) + d.total(WAITING),
        "decode_kv_fetch": d.total(KV_FETCH),
    }


def idle_state(stack: Stack) -> dict[str, float]:
    """The reference idle state: captured on a quiet stack; counts must be 0."""
    now = state(stack)
    busy = {k: v for k, v in now.items() if not k.endswith("kv_usage") and v}
    assert not busy, f"stack not quiet before the fault cases: {busy}"
    return now


def leaks(now: Mapping[str, float], idle: Mapping[str, float]) -> dict[str, float]:
    """Every quantity that is not back to its idle value."""
    return {k: v for k, v in now.items() if abs(v - idle.get(k, 0.0)) > 1e-9}


def wait_idle(stack: FaultStack, deadline_s: float) -> tuple[float, dict[str, float]]:
    """Poll until nothing leaks or the deadline; returns (seconds, leaks)."""
    start = time.monotonic()
    while True:
        found = leaks(state(stack), stack.idle)
        waited = time.monotonic() - start
        if not found or waited > deadline_s:
            return waited, found
        time.sleep(0.5)


def counters(stack: Stack) -> dict[str, m.Snapshot]:
    return {"prefill": m.scrape(stack.prefill), "decode": m.scrape(stack.decode)}


def engine_ids(bootstrap_url: str) -> list[str]:
    """The engine ids prefill's Mooncake bootstrap server hands out."""
    answer = requests.get(f"{bootstrap_url}/query", timeout=5)
    answer.raise_for_status()
    return sorted(entry["engine_id"] for entry in answer.json().values())


def log_tail(stack: FaultStack, role: str, lines: int = 30) -> str:
    if stack.run_dir is None:
        return "(no log: stack given by URLs)"
    return wait.tail(Path(stack.run_dir) / f"{role}.log", lines)
