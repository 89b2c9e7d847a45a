"""Start vllm-router from configs/ (the router image's command).

    PREFILL_URL=http://prefill:8100 DECODE_URL=http://decode:8200 \\
        python -m pdstack.route [--print]

Flags come from ``pdstack.config.router_args`` (configs/router.yaml), the same
call the CPU twin makes; ROUTER_PORT and BOOTSTRAP_PORT from configs/ports.env,
each overridable in the environment. ``ROUTER_API_KEY_FILE`` names a file (a
compose secret) with the key the router presents to prefill and decode; it is
handed to vllm-router in-process, never on its command line, which any user of
the host can read with ``ps``. An empty file means no key.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

from pdstack import config

# In a container the router must listen beyond loopback.
DEFAULT_HOST = "0.0.0.0"


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
    argv += ["--prometheus-host", host]
    return argv


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


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print, do not run")
    opts = parser.parse_args(args)
    try:
        argv = command(os.environ)
        key = api_key(os.environ)
    except config.ConfigError as exc:
        parser.exit(2, f"pdstack.route: {exc}\n")
    if opts.print:
        note = " (+ API key from ROUTER_API_KEY_FILE)" if key else ""
        print(" ".join(["vllm-router", *argv]) + note)
        return
    # Lazy: --print and the tests need no vllm-router.
    from vllm_router.launch_router import launch_router, parse_router_args

    router_args = parse_router_args(argv)
    router_args.api_key = key
    launch_router(router_args)


if __name__ == "__main__":
    main()
