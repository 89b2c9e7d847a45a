"""Why vllm-router dropped the decode during a Mooncake stall, and that the
configured router keeps it.

The real vllm-router with configs/router.yaml's flags, in front of stub
prefill, decode and bootstrap servers (aiohttp; no vLLM). A decode whose
``/health`` answers later than the router's health-check timeout is marked
unhealthy after three checks, and every request then gets ``503 No available
workers: 1 prefill, 0 decode``: the message CI and the bench saw during
stalls. Measured on the twin under the bench's load, decode's ``/health``
took up to 3.6 s (API server starved of the 2 cores), against vllm-router's
5 s default timeout; the configured timeout leaves room for that.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import requests
from aiohttp import web

from pdstack import config, supervisor
from pdstack.supervisor import free_port
from tests.shared import serving

MODEL = "pd-model"
# Longer than vllm-router's default timeout (5 s), shorter than the
# configured one.
HEALTH_DELAY_S = 6.0
# The control: the default timeout, checked every second (drops in ~10 s).
CONTROL_FLAGS = config.render(
    {"health-check-timeout-secs": 5, "health-check-interval-secs": 1}, {}
)
# Three checks at the configured 5 s interval, and a margin.
WATCH_S = 25.0


class Stubs:
    """Prefill, decode and bootstrap stubs; decode's /health waits ``delay_s``."""

    def __init__(self) -> None:
        self.ports = {role: free_port() for role in ("prefill", "decode", "bootstrap")}
        self.delay_s = 0.0

    def app(self, role: str) -> web.Application:
        async def completions(request: web.Request) -> web.Response:
            await request.read()
            answer = {"id": "stub", "object": "text_completion", "model": MODEL}
            choice = {"index": 0, "text": "x", "finish_reason": "length"}
            answer.update(choices=[choice], kv_transfer_params=None)
            return web.json_response(answer)

        async def health(request: web.Request) -> web.Response:
            if role == "decode":
                await asyncio.sleep(self.delay_s)
            return web.Response()

        async def query(request: web.Request) -> web.Response:
            addr = {"0": {"0": "tcp://127.0.0.1:1"}}
            return web.json_response({"0": {"engine_id": "stub", "worker_addr": addr}})

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/health", health)
        app.router.add_get("/query", query)
        return app


@pytest.fixture(scope="module")
def stubs() -> Iterator[Stubs]:
    stubs = Stubs()
    with serving({port: stubs.app(role) for role, port in stubs.ports.items()}):
        yield stubs


@contextlib.contextmanager
def router(stubs: Stubs, tmp_path: Path, extra: list[str]) -> Iterator[str]:
    ports = config.Ports(router=free_port(), router_metrics=free_port(), **stubs.ports)
    urls = supervisor.urls(ports)
    argv = supervisor.router_command(
        urls, extra, ports.router_metrics, internal_port=free_port()
    )
    procs = supervisor.Processes(tmp_path, "router.json", lambda line: None)
    procs.launch("router", argv, {}, urls.router)
    try:
        procs.wait_healthy("router", 60)
        yield urls.router
    finally:
        procs.stop()


def answers_while_health_is_slow(
    stubs: Stubs, url: str, until_dropped: bool = False
) -> list[str]:
    """Requests once a second for WATCH_S while decode's /health is slow."""
    seen: list[str] = []
    with mock.patch.object(stubs, "delay_s", HEALTH_DELAY_S):
        end = time.monotonic() + WATCH_S
        while time.monotonic() < end:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            answer = requests.post(f"{url}/v1/completions", json=body, timeout=30)
            seen.append(f"{answer.status_code} {answer.text[:60]}")
            if until_dropped and answer.status_code == 503:
                break
            time.sleep(1.0)
    return seen


def test_the_configured_router_keeps_a_decode_whose_health_answers_late(
    stubs: Stubs, tmp_path: Path
) -> None:
    timeout = float(config.router_flags().get("health-check-timeout-secs", 5))
    assert timeout > HEALTH_DELAY_S, "vllm-router's health-check timeout"
    with router(stubs, tmp_path, []) as url:
        seen = answers_while_health_is_slow(stubs, url)
    assert seen and all(line.startswith("200") for line in seen), seen


def test_negative_control_a_short_health_timeout_drops_the_decode(
    stubs: Stubs, tmp_path: Path
) -> None:
    with router(stubs, tmp_path, CONTROL_FLAGS) as url:
        seen = answers_while_health_is_slow(stubs, url, until_dropped=True)
    assert "503 No available workers: 1 prefill, 0 decode" in seen, seen
