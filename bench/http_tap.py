"""A forwarding HTTP proxy on 127.0.0.1 that records every exchange.

Pointed between vllm-router and a backend, it shows what the router really
sends (paths, bodies, timing), whatever language the router is written in.
Runs in a thread of the calling process; bodies are kept whole (JSON parsed
where possible), streamed responses are relayed chunk by chunk. A tap without
an upstream answers itself through ``respond`` (a stub backend).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from pdstack.supervisor import HOST

START_TIMEOUT_S = 10.0
# Hop-by-hop headers, and those aiohttp recomputes for the relayed body.
_DROP = {"connection", "keep-alive", "transfer-encoding", "content-length",
         "content-encoding", "host"}  # fmt: skip


@dataclass
class Exchange:
    tap: str
    method: str
    path: str
    request: Any
    status: int = 0
    response: Any = None
    started: float = field(default_factory=time.monotonic)
    finished: float = 0.0

    def finish(self, status: int, response: Any) -> None:
        self.status, self.response = status, response
        self.finished = time.monotonic()


# A stub's answer to (method, path, body): status, then a JSON value or, for a
# stream, the list of server-sent-event payloads.
Reply = tuple[int, Any]
Responder = Callable[[str, str, Any], Reply]


@dataclass
class Tap:
    """One listening port forwarding to ``upstream`` (``http://host:port``),
    or answering with ``respond`` when there is no upstream."""

    name: str
    port: int
    upstream: str | None
    exchanges: list[Exchange] = field(default_factory=list)
    respond: Responder | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def _decode(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _kept(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _DROP}


class TapServer:
    """Runs taps in a background event loop: ``with TapServer(taps): ...``."""

    def __init__(self, taps: list[Tap]) -> None:
        self.taps = taps
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tap")
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    def _handler(self, tap: Tap, session: aiohttp.ClientSession):
        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            exchange = Exchange(
                tap.name, request.method, request.path_qs, _decode(body)
            )
            tap.exchanges.append(exchange)
            if tap.upstream is None:
                return await self._stub(tap, request, exchange)
            async with session.request(
                request.method,
                tap.upstream + request.path_qs,
                data=body or None,
                headers=_kept(request.headers),
                allow_redirects=False,
            ) as upstream:
                out = web.StreamResponse(
                    status=upstream.status, headers=_kept(upstream.headers)
                )
                await out.prepare(request)
                kept = bytearray()
                async for chunk in upstream.content.iter_any():
                    kept += chunk
                    await out.write(chunk)
                await out.write_eof()
            exchange.finish(upstream.status, _decode(bytes(kept)))
            return out

        return handle

    async def _stub(
        self, tap: Tap, request: web.Request, exchange: Exchange
    ) -> web.StreamResponse:
        if tap.respond is None:
            raise RuntimeError(f"tap {tap.name}: neither upstream nor respond")
        status, payload = tap.respond(request.method, request.path, exchange.request)
        if isinstance(payload, list):
            out = web.StreamResponse(
                status=status, headers={"Content-Type": "text/event-stream"}
            )
            await out.prepare(request)
            for event in payload:
                data = event if isinstance(event, str) else json.dumps(event)
                await out.write(f"data: {data}\n\n".encode())
            await out.write_eof()
        elif isinstance(payload, str):
            out = web.Response(status=status, text=payload)
        else:
            out = web.json_response(payload, status=status)
        exchange.finish(status, payload)
        return out

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            runners = []
            try:
                for tap in self.taps:
                    app = web.Application(client_max_size=1 << 30)
                    app.router.add_route("*", "/{tail:.*}", self._handler(tap, session))
                    runner = web.AppRunner(app, access_log=None)
                    await runner.setup()
                    await web.TCPSite(runner, HOST, tap.port).start()
                    runners.append(runner)
                self._ready.set()
                await self._stop.wait()
            finally:
                for runner in runners:
                    await runner.cleanup()

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
        finally:
            self._loop.close()

    def __enter__(self) -> TapServer:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or self._error is not None:
            raise RuntimeError(f"HTTP tap did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def exchanges(self, path_prefix: str = "") -> list[Exchange]:
        found = [
            e for t in self.taps for e in t.exchanges if e.path.startswith(path_prefix)
        ]
        return sorted(found, key=lambda e: e.started)
