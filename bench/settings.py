"""The benchmark's knobs: command-line options whose defaults come from BENCH_*.

`make bench` sets them with `?=` variables of the same names; an option given on
the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from bench import topology
from pdstack import config
from pdstack.supervisor import Urls

ROOT = Path(__file__).resolve().parent.parent
SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DEFAULT_TRANSFER_SIZES = "64K,256K,1M,4M,16M,64M,256M"


class SettingsError(ValueError):
    pass


def parse_size(text: str) -> int:
    """``64K`` -> 65536 (binary units: K, M, G; a bare number is bytes)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise SettingsError(f"not a size: {text!r} (examples: 65536, 64K, 256M)")
    return int(match.group(1)) * SIZE_UNITS[match.group(2).upper()]


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise SettingsError(
            f"not a comma-separated list of integers: {text!r}"
        ) from exc
    if not values or any(v <= 0 for v in values):
        raise SettingsError(f"expected positive integers, got {text!r}")
    return values


def parse_sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(parse_size(part) for part in text.split(",") if part.strip())
    if not sizes or any(s <= 0 for s in sizes):
        raise SettingsError(f"expected positive sizes, got {text!r}")
    return sizes


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.{0 if value == int(value) else 1}f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class Settings:
    profile: str
    input_lens: tuple[int, ...]
    output_len: int
    concurrencies: tuple[int, ...]
    min_prompts: int
    max_batch_tokens: int
    level_timeout_s: float
    sweep_budget_s: float
    # Given URLs: benchmark that stack and start nothing (e.g. compose on GPUs).
    urls: Urls | None
    colocated_port: int
    colocated_threads: int
    out_root: Path
    run_dir: Path
    overhead_requests: int
    transfer_sizes: tuple[int, ...]
    transfer_repeats: int
    # The engine between hosts (bench.hosts_link): one size, a few repeats.
    hosts_link_size: int
    hosts_link_repeats: int
    cold_start: bool
    # The checksum's cost: a second P/D stack with it off (bench.kv_checksum).
    kv_checksum: bool
    checksum_requests: int
    # Staged against direct KV sends, fresh and fragmented (bench.kv_path).
    kv_path: bool
    kv_path_requests: int
    # Descriptors and CPU per GiB by prompt length (bench.transfer_cost).
    transfer_cost: bool
    tokenizer: str | None
    model: str
    seed: int
    # The goodput sweep (bench.rate_sweep): SLOs ("" = the target's), the
    # target whose defaults apply ("" = cpu for the twin's tiny profile,
    # else gpu), its prompt and output lengths, prompts per rate and number
    # of rates (0 = sized by the stack, bench.run.goodput_plan).
    slo: str = ""
    slo_target: str = ""
    goodput_input_len: int = 0
    goodput_output_len: int = 0
    goodput_prompts: int = 0
    goodput_steps: int = 0
    quick: bool = False
    # A file holding the stack's API key (vllm bench serve and every request).
    api_key_file: str = ""
    # The CPU micro-benchmarks (engine vs socket, hosts link) against URLs.
    micro: bool = False
    # Whether the colocated reference is prefill itself (no URL given).
    colocated_is_prefill: bool = False
    # Against URLs: every prefill and decode behind the router (one URL each,
    # comma-separated in BENCH_PREFILL_URL / BENCH_DECODE_URL; ``urls`` holds
    # the first of each, bench.topology checks them against the router).
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()

    def levels(self) -> list[tuple[int, int]]:
        """(input_len, concurrency) pairs within the in-flight token budget,
        cheapest first (prompt tokens sent): if the sweep's time runs out, what
        is lost is the costliest levels, not the many cheap ones."""
        chosen = [
            (length, conc)
            for conc in self.concurrencies
            for length in self.input_lens
            if length * conc <= self.max_batch_tokens
        ]
        return sorted(chosen, key=lambda lc: (self.num_prompts(lc[1]) * lc[0], lc[1]))

    def skipped_levels(self) -> list[tuple[int, int]]:
        return [
            (length, conc)
            for length in self.input_lens
            for conc in self.concurrencies
            if length * conc > self.max_batch_tokens
        ]

    def num_prompts(self, concurrency: int) -> int:
        """One wave of requests at the level's concurrency (at least min_prompts)."""
        return max(self.min_prompts, concurrency)


SWITCH = (0, 1)
URL_NAMES = ("router", "prefill", "decode", "colocated")
# The roles several servers of may stand behind the router (bench.topology).
LISTED = ("prefill", "decode")
# (flag, variable giving its default, default, type, help): a type of None is
# a string (from_args parses it), SWITCH an int of 0 or 1; a number's default
# is converted when the parser is built.
OPTIONS: tuple[tuple[str, str, str, Any, str | None], ...] = (
    ("--profile", "PD_PROFILE", "tiny", None, None),
    ("--input-lens", "BENCH_INPUT_LENS", "128,1024,4096", None, None),
    ("--output-len", "BENCH_OUTPUT_LEN", "64", int, None),
    ("--concurrency", "BENCH_CONCURRENCY", "1,4,16", None, None),
    ("--min-prompts", "BENCH_MIN_PROMPTS", "2", int,
     "prompts per level: max(this, concurrency)"),
    ("--max-batch-tokens", "BENCH_MAX_BATCH_TOKENS", "16384", int,
     "skip levels whose input_len x concurrency exceeds this"),
    ("--level-timeout", "BENCH_LEVEL_TIMEOUT_S", "600", float,
     "seconds one `vllm bench serve` level may take"),
    ("--sweep-budget", "BENCH_SWEEP_BUDGET_S", "900", float,
     "seconds for the whole vllm bench serve sweep; later levels skipped"),
    *((f"--{name}-url", f"BENCH_{name.upper()}_URL", "", None,
       "one URL per server behind the router, comma-separated" * (name in LISTED))
      for name in URL_NAMES),
    ("--colocated-port", "BENCH_COLOCATED_PORT", "8300", int, None),
    ("--colocated-threads", "BENCH_COLOCATED_THREADS", "2", int,
     "OMP threads of the colocated server (P/D: two 1-thread servers)"),
    ("--out", "BENCH_OUT", str(ROOT / "run" / "bench"), None, None),
    ("--run-dir", "PD_RUN_DIR", str(ROOT / "run" / "bench-stack"), None,
     "logs and pids of the servers the bench starts"),
    ("--overhead-requests", "BENCH_OVERHEAD_REQUESTS", "60", int, None),
    ("--transfer-sizes", "BENCH_TRANSFER_SIZES", DEFAULT_TRANSFER_SIZES, None, None),
    ("--transfer-repeats", "BENCH_TRANSFER_REPEATS", "5", int, None),
    ("--hosts-link-size", "BENCH_HOSTS_LINK_SIZE", "64M", None,
     "bytes per transfer of the engine between hosts"),
    ("--hosts-link-repeats", "BENCH_HOSTS_LINK_REPEATS", "3", int, None),
    ("--cold-start", "BENCH_COLD_START", "1", SWITCH,
     "also time a start with an empty model cache"),
    ("--kv-checksum", "BENCH_KV_CHECKSUM", "1", SWITCH,
     "also measure the KV checksum's cost: the P/D stack restarted "
     "with PD_MOONCAKE_KV_CHECKSUM=0, and the digest's own speed"),
    ("--checksum-requests", "BENCH_CHECKSUM_REQUESTS", "5", int,
     "requests per prompt length, checksum on and off (one at a time)"),
    ("--kv-path", "BENCH_KV_PATH", "1", SWITCH,
     "also measure the KV path: staged and (after a restart with "
     "PD_MOONCAKE_KV_STAGING_MIB=0) direct sends, fresh and fragmented"),
    ("--kv-path-requests", "BENCH_KV_PATH_REQUESTS", "5", int,
     "KV path: requests per prompt length, state and pass (one at a time)"),
    ("--transfer-cost", "BENCH_TRANSFER_COST", "1", SWITCH,
     "also measure descriptors and CPU-seconds per GiB by prompt length, "
     "staged and direct, fresh and fragmented (bench.transfer_cost)"),
    ("--tokenizer", "BENCH_TOKENIZER", "", None,
     "default: the profile's model (the generated one for tiny)"),
    ("--model", "BENCH_MODEL", "pd-model", None, "served name"),
    ("--seed", "BENCH_SEED", "0", int, None),
    ("--slo", "BENCH_SLO", "", None,
     "goodput SLOs, ttft=MS,tpot=MS (default: configs/targets/<target>.yaml)"),
    ("--slo-target", "BENCH_SLO_TARGET", "", None,
     "cpu or gpu: whose default SLOs (default: cpu for the tiny profile)"),
    ("--goodput-input-len", "BENCH_GOODPUT_INPUT_LEN", "0", int,
     "goodput sweep's prompt tokens (0: sized by the stack's max-model-len)"),
    ("--goodput-output-len", "BENCH_GOODPUT_OUTPUT_LEN", "0", int, None),
    ("--goodput-prompts", "BENCH_GOODPUT_PROMPTS", "0", int,
     "requests per rate (0: sized by the stack's KV cache)"),
    ("--goodput-steps", "BENCH_GOODPUT_STEPS", "0", int, "rates tried (0: 6, quick 3)"),
    ("--quick", "BENCH_QUICK", "0", SWITCH, "about 3 minutes against a stack"),
    ("--api-key-file", "BENCH_API_KEY_FILE", "", None,
     "a file holding the stack's API key"),
    ("--micro", "BENCH_MICRO", "0", SWITCH,
     "against URLs, also the CPU micro-benchmarks (engine vs socket, hosts link)"),
)  # fmt: skip
# Options that must be positive; the repeats are raised to one instead.
POSITIVE = ("output_len", "min_prompts", "max_batch_tokens", "overhead_requests",
            "checksum_requests", "kv_path_requests")  # fmt: skip


def add_arguments(
    parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None
) -> None:
    env = os.environ if env is None else env
    for flag, var, default, kind, text in OPTIONS:
        value = v if (v := env.get(var, "")).strip() else default  # blanks: unset
        number = int if kind is SWITCH else kind
        parser.add_argument(
            flag,
            type=number,
            default=number(value) if number else value,
            choices=SWITCH if kind is SWITCH else None,
            help=text,
        )


def from_args(args: argparse.Namespace) -> Settings:
    given = {name: getattr(args, f"{name}_url").rstrip("/") for name in URL_NAMES}
    listed = {name: topology.split(given[name]) for name in LISTED}
    for name in ("router", "colocated"):
        if len(topology.split(given[name])) > 1:
            raise SettingsError(f"BENCH_{name.upper()}_URL takes one URL")
    given |= {name: next(iter(servers), "") for name, servers in listed.items()}
    urls = None
    if any(given.values()):
        needed = ("router", "prefill", "decode")
        if missing := [name for name in needed if not given[name]]:
            raise SettingsError(
                "against a running stack give the router's, prefill's and decode's "
                "URLs; missing: " + ", ".join(f"BENCH_{m.upper()}_URL" for m in missing)
            )
        # No colocated server given: prefill serves the prompts whole (as the
        # e2e suite's reference does).
        given["colocated"] = given["colocated"] or given["prefill"]
        urls = Urls(**given, bootstrap_port=config.ports().bootstrap)
    for name in POSITIVE:
        if getattr(args, name) <= 0:
            raise SettingsError(f"--{name.replace('_', '-')} must be positive")
    values = dict(
        input_lens=parse_ints(args.input_lens),
        concurrencies=parse_ints(args.concurrency),
        level_timeout_s=args.level_timeout,
        sweep_budget_s=args.sweep_budget,
        urls=urls,
        out_root=Path(args.out),
        run_dir=Path(args.run_dir),
        transfer_sizes=parse_sizes(args.transfer_sizes),
        transfer_repeats=max(1, args.transfer_repeats),
        hosts_link_size=parse_size(args.hosts_link_size),
        hosts_link_repeats=max(1, args.hosts_link_repeats),
        cold_start=bool(args.cold_start),
        kv_checksum=bool(args.kv_checksum),
        kv_path=bool(args.kv_path),
        transfer_cost=bool(args.transfer_cost),
        tokenizer=args.tokenizer or None,
        quick=bool(args.quick),
        micro=bool(args.micro),
        colocated_is_prefill=urls is not None and not args.colocated_url,
        prefill_urls=listed["prefill"] if urls else (),
        decode_urls=listed["decode"] if urls else (),
    )
    # The other fields: their options as parsed.
    kept = (f.name for f in fields(Settings) if f.name not in values)
    return Settings(**values, **{name: getattr(args, name) for name in kept})
