"""pdstack.route's authenticating proxy, against a stand-in for vllm-router.

vllm-router 0.1.17 does not check its clients' key (the e2e fault suite shows
it on the twin); with ROUTER_API_KEY_FILE set, pdstack.route answers in front
of it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator

import pytest
import requests
from aiohttp import web

from pdstack import route
from pdstack.supervisor import free_port
from tests.shared import serving

KEY = "k-3f9a1c"
CHUNKS = 3


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

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/v1/endless", endless)
        return app


@pytest.fixture(scope="module")
def proxy() -> Iterator[tuple[str, Upstream]]:
    upstream = Upstream()
    up_port, proxy_port = free_port(), free_port()
    proxied = route.auth_proxy_app(KEY, f"http://127.0.0.1:{up_port}")
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
