"""Start vllm-router from configs/ (the router image's command).

    PREFILL_URL=http://prefill:8100 DECODE_URL=http://decode:8200 \\
        python -m pdstack.route [--print]

Flags come from ``pdstack.config.router_args`` (configs/router.yaml), the same
call the CPU twin makes; ROUTER_PORT and BOOTSTRAP_PORT from configs/ports.env,
each overridable in the environment. ``ROUTER_API_KEY_FILE`` names a file (a
compose secret) with the key the router presents to prefill and decode; it is
handed to vllm-router in-process, never on its command line, which any user of
the host can read with ``ps``. An empty file means no key.

With a key, clients must present it too (``Authorization: Bearer <key>``).
vllm-router 0.1.17 does not check its own clients (its ``--api-key`` is only
sent to the workers; a request without a key is served), so this launcher
then runs vllm-router on 127.0.0.1:``ROUTER_INTERNAL_PORT`` (default
ROUTER_PORT + 1) and answers on ROUTER_PORT itself with a small streaming
proxy that refuses requests without the key (401). ``GET /health`` stays
open for health checks, as on vLLM's own servers. If vllm-router exits, so
does the launcher, with its exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from pdstack import config

# In a container the router must listen beyond loopback.
DEFAULT_HOST = "0.0.0.0"
# Where vllm-router listens behind the authenticating proxy.
INTERNAL_HOST = "127.0.0.1"
# Paths served without a key (GET/HEAD only): health checks.
OPEN_PATHS = frozenset({"/health"})
# Not forwarded in either direction (RFC 9110 section 7.6.1), plus what the
# proxy sets itself.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization"}
    | {"te", "trailer", "transfer-encoding", "upgrade", "host"}
)
BACKEND_FLAG = "--backend"


def command(env: Mapping[str, str]) -> list[str]:
    """vllm-router's arguments (without the program name)."""
    missing = [name for name in ("PREFILL_URL", "DECODE_URL") if not env.get(name)]
    if missing:
        raise config.ConfigError(
            f"set {' and '.join(missing)} (e.g. PREFILL_URL=http://prefill:8100)"
        )
    ports = config.ports(env)
    host = env.get("ROUTER_HOST") or DEFAULT_HOST
    argv = config.router_args(
        env["PREFILL_URL"],
        ports.bootstrap,
        env["DECODE_URL"],
        host,
        ports.router,
        ports.router_metrics,
    )
    # vllm-router serves Prometheus metrics on 127.0.0.1 by default: out of
    # reach of a scraper in another container.
    return [*argv, "--prometheus-host", host]


def api_key(env: Mapping[str, str]) -> str | None:
    """The key in ``ROUTER_API_KEY_FILE``; None if unset or the file is empty."""
    path = env.get("ROUTER_API_KEY_FILE")
    if not path:
        return None
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        raise config.ConfigError(f"ROUTER_API_KEY_FILE={path}: {exc.strerror}") from exc
    return key or None


def internal_port(env: Mapping[str, str]) -> int:
    """vllm-router's own port when the authenticating proxy fronts it."""
    raw = env.get("ROUTER_INTERNAL_PORT")
    try:
        return int(raw) if raw else config.ports(env).router + 1
    except ValueError as exc:
        raise config.ConfigError(f"ROUTER_INTERNAL_PORT={raw!r}: not a port") from exc


def backend_command(env: Mapping[str, str]) -> list[str]:
    """vllm-router's arguments behind the proxy: loopback, the internal port
    (argparse keeps the last value); metrics stay where ``command`` put them."""
    return [*command(env), "--host", INTERNAL_HOST, "--port", str(internal_port(env))]


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


def auth_proxy_app(key: str, upstream: str) -> Any:
    """An aiohttp application that forwards authorized requests to
    ``upstream`` (vllm-router), streaming both ways."""
    from aiohttp import ClientError, ClientSession, ClientTimeout, web

    sessions: list[ClientSession] = []

    async def session(app: web.Application) -> AsyncIterator[None]:
        # No total timeout: vllm-router's --request-timeout-secs bounds
        # requests; a dead router fails the connect at once.
        timeout = ClientTimeout(total=None, sock_connect=10)
        sessions.append(ClientSession(timeout=timeout, auto_decompress=False))
        yield
        await sessions[0].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        open_path = request.path in OPEN_PATHS and request.method in ("GET", "HEAD")
        if not open_path and not authorized(request.headers, key):
            message = "missing or invalid API key (Authorization: Bearer <key>)"
            error = {"message": message, "type": "Unauthorized", "code": 401}
            return web.json_response(
                {"error": error}, status=401, headers={"WWW-Authenticate": "Bearer"}
            )
        # vllm-router does not need the client's key; keep it out of its logs
        # (any spelling: header names are case-insensitive).
        headers = _forwardable(request.headers, drop=frozenset({"authorization"}))
        try:
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
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except ClientError as exc:
            return web.json_response(
                {"error": {"message": f"router unavailable: {exc}", "code": 502}},
                status=502,
            )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    app.cleanup_ctx.append(session)
    return app


def run_with_auth(env: Mapping[str, str], key: str) -> int:
    """vllm-router as a child on loopback, the authenticating proxy in front;
    returns when either ends (the child's exit code)."""
    from aiohttp import web

    port = config.ports(env).router
    host = env.get("ROUTER_HOST") or DEFAULT_HOST
    inner = internal_port(env)
    child = subprocess.Popen(
        [sys.executable, "-m", "pdstack.route", BACKEND_FLAG],
        env=dict(env),
        stdin=subprocess.DEVNULL,
    )
    print(
        f"pdstack.route: clients need the API key; vllm-router on "
        f"{INTERNAL_HOST}:{inner}, authenticating proxy on {host}:{port}",
        flush=True,
    )

    async def serve() -> int:
        # Cancel a handler when its client goes away, so the forwarded
        # request is closed too and vllm-router aborts it on the servers.
        runner = web.AppRunner(
            auth_proxy_app(key, f"http://{INTERNAL_HOST}:{inner}"),
            handler_cancellation=True,
            access_log=None,
        )
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            while child.poll() is None and not stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
        finally:
            await runner.cleanup()
        return child.returncode if child.returncode is not None else 0

    try:
        return asyncio.run(serve())
    finally:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print, do not run")
    # Internal: vllm-router itself, behind the authenticating proxy.
    parser.add_argument(BACKEND_FLAG, action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args(args)
    try:
        key = api_key(os.environ)
        argv = backend_command(os.environ) if opts.backend else command(os.environ)
    except config.ConfigError as exc:
        parser.exit(2, f"pdstack.route: {exc}\n")
    if opts.print:
        note = " (+ API key from ROUTER_API_KEY_FILE)" if key else ""
        print(" ".join(["vllm-router", *argv]) + note)
        if key:
            print(
                f"clients need the key: vllm-router on {INTERNAL_HOST}:"
                f"{internal_port(os.environ)}, authenticating proxy in front"
            )
        return
    if key and not opts.backend:
        sys.exit(run_with_auth(os.environ, key))
    # Lazy: --print and the tests need no vllm-router.
    from vllm_router.launch_router import launch_router, parse_router_args

    router_args = parse_router_args(argv)
    router_args.api_key = key
    launch_router(router_args)


if __name__ == "__main__":
    main()
