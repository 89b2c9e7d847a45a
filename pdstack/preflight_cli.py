"""``python -m pdstack.preflight``: the GPU preflight's command line.

It prints the table (or JSON, or one bit) and says by its exit status whether
every check could be answered: a preflight that can only say "unknown" must
not pass a CI step vacuously. vLLM's own start-up warnings (Triton missing on
a CPU host, its model runner's choice) say nothing about the answer and go
unprinted unless ``--verbose``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from pdstack import config, preflight

# Exit statuses (argparse's own is 2, for bad arguments).
ACCEPTED, REJECTED, UNKNOWN = 0, 1, 3


def parse_gpu(text: str) -> tuple[str, tuple[int, int]]:
    """sm90, 9.0 or 90 -> ("sm90", (9, 0))."""
    raw = text.lower().removeprefix("sm").replace(".", "")
    if not raw.isdigit() or len(raw) < 2:
        raise argparse.ArgumentTypeError(f"not a compute capability: {text!r}")
    return f"sm{raw}", (int(raw[:-1]), int(raw[-1]))


def parse_set(text: str) -> tuple[str, Any]:
    """FLAG=VALUE, the value as YAML would read it (configs/ are YAML)."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected FLAG=VALUE, got {text!r}")
    return key, yaml.safe_load(value)


@contextlib.contextmanager
def vllm_quiet(verbose: bool) -> Iterator[None]:
    """vLLM's loggers at ERROR while it is imported and asked. Its logging is
    not configured when only its selector is imported, so its warnings would
    reach stderr through Python's last-resort handler."""
    logger = logging.getLogger("vllm")
    level = logger.level
    if not verbose:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def exit_status(checks: Sequence[preflight.Check], allow_unknown: bool) -> int:
    statuses = {c.status for c in checks}
    if "rejected" in statuses:
        return REJECTED
    if "unknown" in statuses and not allow_unknown:
        return UNKNOWN
    return ACCEPTED


def parse_tp_pair(text: str) -> dict[str, dict[str, int]]:
    """``2:1`` -> each role's tensor-parallel-size."""
    try:
        sizes = [int(part) for part in text.split(":")]
    except ValueError:
        sizes = []
    if len(sizes) != 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected P:D, e.g. 2:1")
    return {
        role: {"tensor-parallel-size": size}
        for role, size in zip(config.ROLES, sizes, strict=True)
    }


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pdstack.preflight",
        description=preflight.__doc__.splitlines()[0],
        epilog="Exit status: 0 accepted, 1 rejected, 3 unknown (0 with "
        "--allow-unknown), 2 bad arguments or configuration.",
    )
    known = config.profile_names()
    add = parser.add_argument
    add("--profile", action="append", choices=known, help="default: every profile")
    add("--role", action="append", choices=config.ROLES, help="default: both")
    add(
        "--capability",
        action="append",
        type=parse_gpu,
        help="sm80, 9.0 or 100, repeatable; default: sm80 sm90 sm100",
    )
    add("--device", action="store_true", help="the visible CUDA devices' instead")
    add(
        "--target-config",
        "--model-config",
        dest="target_config",
        type=Path,
        metavar="PATH",
        help="the target's config.json (default: tests/data/<profile>/config.json, "
        "else the Hugging Face cache)",
    )
    add(
        "--draft-config",
        type=Path,
        metavar="PATH",
        help="the Eagle draft's config.json (default: tests/data/<profile>/"
        "draft_config.json, else the Hugging Face cache)",
    )
    add(
        "--set",
        action="append",
        type=parse_set,
        default=[],
        metavar="FLAG=VALUE",
        help="override a vLLM flag of configs/ (what-if)",
    )
    add(
        "--tp-pair",
        type=parse_tp_pair,
        metavar="P:D",
        help="prefill's and decode's tensor-parallel-size (what-if): refused "
        "where they cannot pair (pd_mooncake.tp_pairs)",
    )
    add(
        "--allow-unknown",
        action="store_true",
        help="exit 0 where a check can only say unknown (nothing rejected)",
    )
    add("--verbose", action="store_true", help="also vLLM's own log lines")
    add("--json", action="store_true", help="JSON instead of the table")
    add(
        "--print",
        choices=["batch-invariant"],
        help="print 1 if every layer keeps a backend under VLLM_BATCH_INVARIANT=1, "
        "else 0 (needs one capability)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    cli = parser()
    opts = cli.parse_args(argv)
    gpus = dict(opts.capability or [(g, c) for g, (c, _) in preflight.GPUS.items()])
    if opts.device and not (gpus := preflight.device_gpus()):
        cli.exit(2, "pdstack.preflight: --device: no CUDA device visible\n")
    if opts.print and len(gpus) != 1:
        cli.error("--print batch-invariant needs exactly one capability")
    try:
        with vllm_quiet(opts.verbose):
            checks = preflight.run(
                opts.profile or config.profile_names(),
                gpus,
                opts.role or config.ROLES,
                dict(opts.set),
                opts.target_config,
                opts.draft_config,
                role_overrides=opts.tp_pair,
            )
    except config.ConfigError as exc:
        cli.exit(2, f"pdstack.preflight: {exc}\n")
    status = exit_status(checks, opts.allow_unknown)
    if opts.print:
        print(int(all(c.batch_invariant for c in checks)))
        for problem in (p for c in checks for p in c.problems):
            print(f"pdstack.preflight: {problem}", file=sys.stderr)
    elif opts.json:
        state = {"ok": status == ACCEPTED, "checks": [asdict(c) for c in checks]}
        print(json.dumps(state, indent=2))
    else:
        print(preflight.table(checks))
    if status == UNKNOWN:
        print(
            "pdstack.preflight: unknown: nothing to ask with for some checks (the "
            "notes say why); --allow-unknown accepts that",
            file=sys.stderr,
        )
    return status
