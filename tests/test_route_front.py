"""pdstack.front, the router's front, against a stand-in for vllm-router.

vllm-router 0.1.17 does not check its clients' key (the e2e fault suite shows
it on the twin): with ROUTER_API_KEY_FILE set the front refuses requests
without it. vllm-router waits for a frozen prefill for 30 minutes: the front
cuts a request that has had no byte while a backend fails its health probes;
the backend here is a real server process frozen with SIGSTOP.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from aiohttp import web

from pdstack import config, front, route, wait
from pdstack.supervisor import free_port
from tests.shared import serving

KEY = "k-3f9a1c"
CHUNKS = 3
# Short, so that each case takes seconds: a backend is unresponsive after two
# probes of 0.5 s missed, 0.2 s apart.
LIVENESS = front.Liveness(interval_s=0.2, timeout_s=0.5, misses=2, quiet_s=0.5)
# From a freeze to the cut: misses x (timeout + interval) + quiet, with slack.
CUT_WITHIN_S = 2 * (0.5 + 0.2) + 0.5 + 2.0
# A slow answer on a live stack: many probe rounds and quiet periods long.
SLOW_S = 3.0


class Upstream:
    """What the proxy forwards to: records what it saw."""

    def __init__(self) -> None:
        self.seen_auth: list[str | None] = []
        self.bodies: list[bytes] = []
        self.disconnected = threading.Event()

    def app(self) -> web.Application:
        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def completions(request: web.Request) -> web.StreamResponse:
            self.seen_auth.append(request.headers.get("Authorization"))
            self.bodies.append(await request.read())
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i in range(CHUNKS):
                await response.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(0.05)
            await response.write_eof()
            return response

        async def endless(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse()
            await response.prepare(request)
            try:
                while True:
                    await response.write(b"data: more\n\n")
                    await asyncio.sleep(0.05)
            except (ConnectionResetError, asyncio.CancelledError):
                self.disconnected.set()
                raise

        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(SLOW_S)
            return web.Response(text="done")

        async def hang(request: web.Request) -> web.StreamResponse:
            # Like vllm-router waiting on a frozen prefill's leg: nothing.
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.disconnected.set()
                raise
            return web.Response()

        async def stall(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(b"data: 0\n\n")
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.disconnected.set()
                raise
            return response

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/v1/endless", endless)
        app.router.add_post("/v1/slow", slow)
        app.router.add_post("/v1/hang", hang)
        app.router.add_post("/v1/stall", stall)
        return app


@pytest.fixture(scope="module")
def proxy() -> Iterator[tuple[str, Upstream]]:
    upstream = Upstream()
    up_port, proxy_port = free_port(), free_port()
    proxied = front.front_app(f"http://127.0.0.1:{up_port}", [], LIVENESS, KEY)
    with serving(
        {up_port: upstream.app(), proxy_port: proxied}, handler_cancellation=True
    ):
        yield f"http://127.0.0.1:{proxy_port}", upstream


BODY = {"model": "pd-model", "prompt": "hi", "max_tokens": 2}


def streamed(url: str, path: str) -> requests.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return requests.post(f"{url}{path}", json=BODY, headers=headers, stream=True)


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}],
    ids=["no-key", "wrong-key", "no-bearer"],
)
def test_requests_without_the_key_are_refused(
    proxy: tuple[str, Upstream], headers: dict[str, str]
) -> None:
    url, upstream = proxy
    before = len(upstream.bodies)
    answer = requests.post(f"{url}/v1/completions", json=BODY, headers=headers)
    assert answer.status_code == 401
    assert answer.headers["WWW-Authenticate"] == "Bearer"
    assert "API key" in answer.json()["error"]["message"]
    assert len(upstream.bodies) == before, "a refused request reached the router"


def test_admin_paths_need_the_key_too(proxy: tuple[str, Upstream]) -> None:
    url, _ = proxy
    admin = [("POST", "/add_worker?url=http://evil:1"), ("GET", "/v1/models")]
    for method, path in admin:
        assert requests.request(method, f"{url}{path}").status_code == 401


def test_health_stays_open(proxy: tuple[str, Upstream]) -> None:
    url, _ = proxy
    answer = requests.get(f"{url}/health")
    assert (answer.status_code, answer.text) == (200, "ok")


def test_with_the_key_the_answer_streams_through(proxy: tuple[str, Upstream]) -> None:
    url, upstream = proxy
    answer = streamed(url, "/v1/completions")
    assert answer.status_code == 200
    lines = [line for line in answer.iter_lines() if line]
    assert lines == [f"data: {i}".encode() for i in range(CHUNKS)]
    assert upstream.bodies[-1] == requests.models.complexjson.dumps(BODY).encode()
    # The router never sees the client's key (nor logs it).
    assert upstream.seen_auth[-1] is None


def test_a_client_that_leaves_closes_the_forwarded_request(
    proxy: tuple[str, Upstream],
) -> None:
    url, upstream = proxy
    answer = streamed(url, "/v1/endless")
    list(itertools.islice(filter(None, answer.iter_lines()), 3))
    answer.close()
    start = time.monotonic()
    assert upstream.disconnected.wait(timeout=10), "the router kept streaming"
    print(f"upstream saw the disconnect {time.monotonic() - start:.2f}s after it")


def test_backend_listens_on_loopback_behind_the_proxy() -> None:
    env = {
        "PREFILL_URL": "http://prefill:8100",
        "DECODE_URL": "http://decode:8200",
        "ROUTER_PORT": "9000",
    }
    from vllm_router.launch_router import parse_router_args

    parsed = parse_router_args(route.backend_command(env))
    assert (parsed.host, parsed.port) == ("127.0.0.1", 9001)
    assert parsed.prometheus_host == "0.0.0.0"
    assert route.internal_port({**env, "ROUTER_INTERNAL_PORT": "7777"}) == 7777


# --- the liveness guard ---------------------------------------------------------


@pytest.fixture
def backend(tmp_path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real server process answering GET /health (python -m http.server)."""
    (tmp_path / "health").write_text("ok")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait.poll(lambda: wait.healthy(url), bool, 30, "http.server", interval_s=0.1)
        yield url, proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def guarded(backend: tuple[str, subprocess.Popen]) -> Iterator[tuple[str, Upstream]]:
    """The front without a key, guarding ``backend``, before a stand-in router."""
    upstream = Upstream()
    up_port, front_port = free_port(), free_port()
    app = front.front_app(f"http://127.0.0.1:{up_port}", [backend[0]], LIVENESS)
    with serving({up_port: upstream.app(), front_port: app}, handler_cancellation=True):
        yield f"http://127.0.0.1:{front_port}", upstream


def freeze(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGSTOP)
    stat = Path(f"/proc/{proc.pid}/stat")
    wait.poll(
        lambda: stat.read_text().split()[2],
        lambda state: state == "T",
        10,
        "the backend stopped",
        interval_s=0.05,
    )


def test_a_frozen_server_still_completes_tcp_handshakes(
    backend: tuple[str, subprocess.Popen],
) -> None:
    """Why a connect probe is no liveness check: the kernel answers for it."""
    url, proc = backend
    freeze(proc)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=2):
        pass
    assert not wait.healthy(url, timeout=1.0)


def test_a_request_stuck_behind_a_frozen_backend_gets_a_503_in_seconds(
    backend: tuple[str, subprocess.Popen], guarded: tuple[str, Upstream]
) -> None:
    url, upstream = guarded
    freeze(backend[1])
    start = time.monotonic()
    answer = requests.post(f"{url}/v1/hang", json=BODY, timeout=30)
    took = time.monotonic() - start
    print(f"503 after {took:.2f}s")
    assert answer.status_code == 503
    assert backend[0] in answer.json()["error"]["message"]
    assert took < CUT_WITHIN_S
    assert upstream.disconnected.wait(timeout=10), "the router's request stayed open"


def test_a_stream_stalled_behind_a_frozen_backend_is_cut(
    backend: tuple[str, subprocess.Popen], guarded: tuple[str, Upstream]
) -> None:
    url, _ = guarded
    answer = requests.post(f"{url}/v1/stall", json=BODY, stream=True, timeout=30)
    assert answer.status_code == 200
    lines = answer.iter_lines()
    assert next(filter(None, lines)) == b"data: 0"
    freeze(backend[1])
    start = time.monotonic()
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        list(lines)
    assert time.monotonic() - start < CUT_WITHIN_S


def test_negative_control_a_slow_answer_on_a_live_stack_is_not_cut(
    guarded: tuple[str, Upstream],
) -> None:
    url, _ = guarded
    start = time.monotonic()
    answer = requests.post(f"{url}/v1/slow", json=BODY, timeout=30)
    assert (answer.status_code, answer.text) == (200, "done")
    assert time.monotonic() - start >= SLOW_S


def test_negative_control_unguarded_a_request_behind_a_frozen_backend_waits(
    backend: tuple[str, subprocess.Popen],
) -> None:
    """With nothing to probe (vllm-router's own behaviour), the same request
    is still waiting long after the guard would have cut it."""
    upstream = Upstream()
    up_port, front_port = free_port(), free_port()
    app = front.front_app(f"http://127.0.0.1:{up_port}", [], LIVENESS)
    with serving({up_port: upstream.app(), front_port: app}, handler_cancellation=True):
        freeze(backend[1])
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(
                f"http://127.0.0.1:{front_port}/v1/hang",
                json=BODY,
                timeout=CUT_WITHIN_S,
            )


def test_the_front_settings_bound_a_cut_within_30_seconds() -> None:
    """configs/router.yaml's worst case, freeze to 503, well inside the 60 s
    a client may wait for a terminal answer."""
    live = front.Liveness.of(config.front_settings())
    worst = live.misses * (live.probe_bound_s) + live.quiet_s + front.WATCH_S
    assert worst <= 30
