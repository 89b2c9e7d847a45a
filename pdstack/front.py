"""The router's front: every client request passes through it to vllm-router
(``pdstack.route`` runs both), for two things vllm-router 0.1.17 does not do.

**The API key.** vllm-router's ``--api-key`` is only presented to the
workers; a client without a key is served. With a key the front refuses a
request without ``Authorization: Bearer <key>`` (401). ``GET /health`` stays
open for health checks, as on vLLM's own servers.

**No wait without a deadline.** vllm-router sends a request's prefill leg and
waits for its answer before it contacts decode, bounded only by
``--request-timeout-secs`` (1800 s), which also bounds the longest answer's
whole stream, so it cannot be short. A prefill frozen (SIGSTOP, ``docker
pause``) still completes TCP handshakes in its kernel, and one cut off by a
partition swallows packets: nothing fails, and the client waits 30 minutes.
The front probes every backend's ``/health`` (configs/router.yaml,
``front``); while one has failed ``misses`` probes in a row, a request that
has had no byte for ``quiet_s`` is answered 503 (its stream cut, if it had
started) and closed towards vllm-router, which drops its legs. A busy server
still answers ``/health`` (its API server is not its engine core), so a slow
request on a live stack is never cut; a request on a healthy replica while
another replica is unresponsive can be (replicas are not told apart: the
front does not see vllm-router's choice).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Paths served without a key (GET/HEAD only): health checks.
OPEN_PATHS = frozenset({"/health"})
# Not forwarded in either direction (RFC 9110 section 7.6.1), plus what the
# proxy sets itself.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization"}
    | {"te", "trailer", "transfer-encoding", "upgrade", "host"}
)
# How often a waiting request looks at the backends' liveness.
WATCH_S = 0.5


@dataclass(frozen=True)
class Liveness:
    """configs/router.yaml's ``front`` settings."""

    interval_s: float
    timeout_s: float
    misses: int
    quiet_s: float

    @property
    def probe_bound_s(self) -> float:
        """The longest one probe round takes: its timeout, then the interval."""
        return self.timeout_s + self.interval_s

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> Liveness:
        return cls(
            float(settings["probe_interval_s"]),
            float(settings["probe_timeout_s"]),
            int(settings["misses"]),
            float(settings["quiet_s"]),
        )


@dataclass
class Probes:
    """Each backend's consecutive failed ``/health`` probes."""

    backends: tuple[str, ...]
    failures: dict[str, int] = field(default_factory=dict)

    def unresponsive(self, misses: int) -> list[str]:
        return [b for b in self.backends if self.failures.get(b, 0) >= misses]


def authorized(headers: Mapping[str, str], key: str) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time."""
    given = headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), key.encode()
    )


def _forwardable(
    headers: Mapping[str, str], drop: frozenset[str] = frozenset()
) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP | drop}


def _error(status: int, message: str, kind: str, **headers: str) -> Any:
    from aiohttp import web

    error = {"message": message, "type": kind, "code": status}
    return web.json_response({"error": error}, status=status, headers=headers)


def front_app(
    upstream: str,
    backends: Iterable[str],
    liveness: Liveness,
    key: str | None = None,
    log: Any = print,
) -> Any:
    """An aiohttp application that forwards to ``upstream`` (vllm-router),
    streaming both ways, with the key check (``key``) and the liveness guard
    over ``backends`` (base URLs)."""
    from aiohttp import ClientError, ClientSession, ClientTimeout, web

    probes = Probes(tuple(backends))
    sessions: list[ClientSession] = []

    async def probe(session: ClientSession, backend: str) -> None:
        timeout = ClientTimeout(total=liveness.timeout_s)
        while True:
            try:
                async with session.get(f"{backend}/health", timeout=timeout) as answer:
                    ok = answer.status == 200
            except (ClientError, asyncio.TimeoutError):
                ok = False
            before = probes.failures.get(backend, 0)
            probes.failures[backend] = 0 if ok else before + 1
            if before >= liveness.misses and ok:
                log(f"pdstack.front: {backend} answers /health again")
            elif probes.failures[backend] == liveness.misses:
                log(
                    f"pdstack.front: {backend} did not answer /health within "
                    f"{liveness.timeout_s:g} s {liveness.misses} times in a row: "
                    f"requests quiet for {liveness.quiet_s:g} s are answered 503"
                )
            await asyncio.sleep(liveness.interval_s)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        # No total timeout towards vllm-router: the liveness guard and its
        # --request-timeout-secs bound requests; a dead router fails the
        # connect at once.
        timeout = ClientTimeout(total=None, sock_connect=10)
        sessions.append(ClientSession(timeout=timeout, auto_decompress=False))
        tasks = [asyncio.ensure_future(probe(sessions[0], b)) for b in probes.backends]
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await sessions[0].close()

    async def relay(
        request: web.Request, last_byte: list[float], started: list[web.StreamResponse]
    ) -> web.StreamResponse:
        # vllm-router does not need the client's key; keep it out of its logs
        # (any spelling: header names are case-insensitive).
        headers = _forwardable(request.headers, drop=frozenset({"authorization"}))
        async with sessions[0].request(
            request.method,
            upstream + request.rel_url.raw_path_qs,
            headers=headers,
            data=request.content if request.body_exists else None,
            allow_redirects=False,
        ) as answer:
            response = web.StreamResponse(
                status=answer.status,
                reason=answer.reason,
                headers=_forwardable(answer.headers),
            )
            await response.prepare(request)
            started.append(response)
            last_byte[0] = time.monotonic()
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
                last_byte[0] = time.monotonic()
            await response.write_eof()
            return response

    async def forward(request: web.Request) -> web.StreamResponse:
        open_path = request.path in OPEN_PATHS and request.method in ("GET", "HEAD")
        if key and not open_path and not authorized(request.headers, key):
            message = "missing or invalid API key (Authorization: Bearer <key>)"
            return _error(
                401, message, "Unauthorized", **{"WWW-Authenticate": "Bearer"}
            )
        last_byte = [time.monotonic()]
        started: list[web.StreamResponse] = []
        task = asyncio.ensure_future(relay(request, last_byte, started))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=WATCH_S)
                if done:
                    return task.result()
                stuck = probes.unresponsive(liveness.misses)
                quiet = time.monotonic() - last_byte[0]
                if open_path or not stuck or quiet < liveness.quiet_s:
                    continue
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                log(
                    f"pdstack.front: {request.method} {request.path} cut after "
                    f"{quiet:.0f} s without a byte: {', '.join(stuck)} unresponsive"
                )
                if started:
                    # The answer had begun: all the client can get is its end.
                    if request.transport is not None:
                        request.transport.close()
                    return started[0]
                return _error(
                    503,
                    f"{', '.join(stuck)} did not answer its health checks while "
                    f"this request waited {quiet:.0f} s (frozen or cut off?)",
                    "ServiceUnavailable",
                )
        except ClientError as exc:
            if started:
                if request.transport is not None:
                    request.transport.close()
                return started[0]
            return _error(502, f"router unavailable: {exc}", "BadGateway")
        finally:
            task.cancel()

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    app.cleanup_ctx.append(lifecycle)
    return app
