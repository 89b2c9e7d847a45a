"""Start the stack's router from configs/ (the router image's command, and
the CPU twins' router).

    PREFILL_URL=http://prefill:8100 DECODE_URL=http://decode:8200 \\
        python -m pdstack.route [--print] [-- extra vllm-router flags]

Two processes: vllm-router, on 127.0.0.1:``ROUTER_INTERNAL_PORT`` (default
ROUTER_PORT + 1), and in front of it, on ROUTER_PORT, ``pdstack.front``: the
API key check and the liveness guard that bounds a request stuck on a frozen
or cut-off backend (see there). vllm-router's flags come from
``pdstack.config.router_args`` (configs/router.yaml); ROUTER_PORT and
BOOTSTRAP_PORT from configs/ports.env, each overridable in the environment or
by the options below. ``ROUTER_API_KEY_FILE`` names a file (a compose secret)
with the key the router presents to prefill and decode; it is handed to
vllm-router in-process, never on its command line, which any user of the host
can read with ``ps``. An empty file means no key. If vllm-router exits, so
does the launcher, with its exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from pdstack import config, front

# In a container the router must listen beyond loopback.
DEFAULT_HOST = "0.0.0.0"
# Where vllm-router listens behind the front.
INTERNAL_HOST = "127.0.0.1"
BACKEND_FLAG = "--backend"
# Options that set what the environment would (the CPU twins use them).
OPTION_ENV = {
    "prefill": "PREFILL_URL",
    "decode": "DECODE_URL",
    "host": "ROUTER_HOST",
    "port": "ROUTER_PORT",
    "metrics_port": "ROUTER_METRICS_PORT",
    "bootstrap_port": "BOOTSTRAP_PORT",
    "internal_port": "ROUTER_INTERNAL_PORT",
}


def command(env: Mapping[str, str], extra: list[str] | None = None) -> list[str]:
    """vllm-router's arguments (without the program name); ``extra`` flags win
    (argparse: the last one does)."""
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
    return [*argv, "--prometheus-host", host, *(extra or [])]


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
    """vllm-router's own port behind the front."""
    raw = env.get("ROUTER_INTERNAL_PORT")
    try:
        return int(raw) if raw else config.ports(env).router + 1
    except ValueError as exc:
        raise config.ConfigError(f"ROUTER_INTERNAL_PORT={raw!r}: not a port") from exc


def backend_command(
    env: Mapping[str, str], extra: list[str] | None = None
) -> list[str]:
    """vllm-router's arguments behind the front: loopback, the internal port
    (argparse keeps the last value); metrics stay where ``command`` put them."""
    inner = ["--host", INTERNAL_HOST, "--port", str(internal_port(env))]
    return [*command(env, extra), *inner]


def backends(env: Mapping[str, str]) -> list[str]:
    """Every prefill and decode replica: what the front's liveness guard probes."""
    return [
        url.strip()
        for name in ("PREFILL_URL", "DECODE_URL")
        for url in env[name].split(",")
        if url.strip()
    ]


def run(env: Mapping[str, str], key: str | None, extra: list[str]) -> int:
    """vllm-router as a child on loopback, the front on ROUTER_PORT; returns
    when either ends (the child's exit code)."""
    from aiohttp import web

    port = config.ports(env).router
    host = env.get("ROUTER_HOST") or DEFAULT_HOST
    inner = internal_port(env)
    liveness = front.Liveness.of(config.front_settings())
    child = subprocess.Popen(
        [sys.executable, "-m", "pdstack.route", BACKEND_FLAG, "--", *extra],
        env=dict(env),
        stdin=subprocess.DEVNULL,
    )
    print(
        f"pdstack.route: vllm-router on {INTERNAL_HOST}:{inner}, the front on "
        f"{host}:{port}" + (" (clients need the API key)" if key else ""),
        flush=True,
    )

    async def serve() -> int:
        # Cancel a handler when its client goes away, so the forwarded
        # request is closed too and vllm-router aborts it on the servers.
        app = front.front_app(
            f"http://{INTERNAL_HOST}:{inner}",
            backends(env),
            liveness,
            key,
            log=lambda line: print(line, flush=True),
        )
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
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
    for option, variable in OPTION_ENV.items():
        parser.add_argument(
            f"--{option.replace('_', '-')}", help=f"instead of ${variable}"
        )
    parser.add_argument("extra", nargs="*", help="vllm-router flags, after --")
    # Internal: vllm-router itself, behind the front.
    parser.add_argument(BACKEND_FLAG, action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args(args)
    given = {
        v: str(getattr(opts, o)) for o, v in OPTION_ENV.items() if getattr(opts, o)
    }
    env = {**os.environ, **given}
    try:
        key = api_key(env)
        argv = (backend_command if opts.backend else command)(env, opts.extra)
    except config.ConfigError as exc:
        parser.exit(2, f"pdstack.route: {exc}\n")
    if opts.print:
        note = " (+ API key from ROUTER_API_KEY_FILE)" if key else ""
        print(shlex.join(["vllm-router", *argv]) + note)
        print(f"behind the front: vllm-router on {INTERNAL_HOST}:{internal_port(env)}")
        return
    if not opts.backend:
        sys.exit(run(env, key, opts.extra))
    # Lazy: --print and the tests need no vllm-router.
    from vllm_router.launch_router import launch_router, parse_router_args

    router_args = parse_router_args(argv)
    router_args.api_key = key
    launch_router(router_args)


if __name__ == "__main__":
    main()
