"""vLLM's own `vllm bench serve`, one subprocess for a whole sweep.

The ``vllm`` console script dies on CPU builds before it parses anything, so
this module builds ``vllm bench serve``'s parser and runs the code it
dispatches to, under a per-level deadline (why and how: docs/bench.md, "`vllm
bench serve` on a CPU build"). One subprocess runs every level, and scrapes
the prefill server's transfer metrics around each P/D level:

    python -m bench.vllm_bench PLAN.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
PERCENTILES = "50,90,99"
SETTLE_S = 30.0
# A level given less time than this is skipped rather than started.
MIN_LEVEL_S = 30.0


@dataclass(frozen=True)
class Level:
    target: str  # "pd" or "colocated"
    base_url: str
    input_len: int
    concurrency: int
    num_prompts: int
    seed: int
    result_file: str
    # P/D only: the prefill server, whose /metrics counts the transfers
    # (several behind one router: comma-separated, bench.kv_transfer sums).
    prefill_url: str | None = None
    kv_file: str | None = None
    # Also scraped around the level (with kv_file): the decode server, for
    # the staged sends' scatter (bench.kv_phases).
    decode_url: str | None = None
    # This level's own output length (default: the plan's), the random
    # dataset's range ratio (lengths of input and output drawn from
    # [len * (1 - r), len * (1 + r)]; 0: every request the same) and deadline
    # (default: the plan's timeout_s).
    output_len: int | None = None
    range_ratio: float = 0.0
    timeout_s: float | None = None
    # A Poisson arrival rate (req/s; None: all at once, --request-rate inf)
    # and vllm bench serve's --goodput SLOs (e.g. "ttft:2000", "tpot:50").
    request_rate: float | None = None
    goodput: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    model: str
    tokenizer: str
    output_len: int
    timeout_s: float
    levels: tuple[Level, ...]
    # The whole sweep's time; later levels are skipped once it is spent.
    budget_s: float = float("inf")
    # The profile's tokenizer needs its own code (Kimi's).
    trust_remote_code: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # the levels too (a tuple of dicts: a JSON list)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        """What to_json wrote (JSON keeps its numbers' types, and infinity)."""
        levels = tuple(
            Level(**{**level, "goodput": tuple(level.get("goodput", ()))})
            for level in data["levels"]
        )
        return cls(**{**data, "levels": levels})


def bench_serve_args(plan: Plan, level: Level) -> list[str]:
    result = Path(level.result_file)
    spread = ["--random-range-ratio", str(r)] if (r := level.range_ratio) else []
    return [
        "--backend", "openai",
        "--base-url", level.base_url,
        "--endpoint", "/v1/completions",
        "--model", plan.model,
        "--served-model-name", plan.model,
        "--tokenizer", plan.tokenizer,
        "--dataset-name", "random",
        "--random-input-len", str(level.input_len),
        "--random-output-len", str(level.output_len or plan.output_len), *spread,
        "--num-prompts", str(level.num_prompts),
        "--max-concurrency", str(level.concurrency),
        "--request-rate", "inf" if level.request_rate is None
        else f"{level.request_rate:.4g}",
        "--temperature", "0",
        "--ignore-eos",
        "--seed", str(level.seed),
        "--percentile-metrics", PERCENTILE_METRICS,
        "--metric-percentiles", PERCENTILES,
        "--save-result",
        "--save-detailed",
        "--result-dir", str(result.parent),
        "--result-filename", result.name,
        *(["--goodput", *level.goodput] if level.goodput else []),
        *(["--trust-remote-code"] if plan.trust_remote_code else []),
        "--label", level.target,
        "--metadata", f"target={level.target}", f"input_len={level.input_len}",
        f"concurrency={level.concurrency}",
    ]  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    BenchmarkServingSubcommand.add_cli_args(parser)
    return parser


def _run_level(
    parser: argparse.ArgumentParser, plan: Plan, level: Level, timeout_s: float
) -> str:
    from vllm.benchmarks.serve import main_async

    args = parser.parse_args(bench_serve_args(plan, level))
    try:
        asyncio.run(asyncio.wait_for(main_async(args), timeout_s))
    except (asyncio.TimeoutError, TimeoutError):
        return f"timed out after {timeout_s:.0f}s"
    return "ok"


def run(plan: Plan) -> int:
    """Every level in order, within the plan's budget: a level gets at most
    ``timeout_s``, and the first run of a P/D-colocated pair at most half of
    what is left, so its partner always gets a turn; with under a minute left
    the remaining levels are skipped (and say so)."""
    from bench import kv_phases, kv_transfer

    parser = _parser()
    failures = 0
    sweep_start = time.monotonic()
    # A P/D-colocated pair's two runs share their prompt length and concurrency.
    keys = [(lv.input_len, lv.concurrency) for lv in plan.levels]
    for i, level in enumerate(plan.levels, 1):
        remaining = plan.budget_s - (time.monotonic() - sweep_start)
        partner = i < len(keys) and keys[i] == keys[i - 1]
        share = 2 if partner and (i == 1 or keys[i - 2] != keys[i - 1]) else 1
        result = Path(level.result_file)
        status_file = result.with_suffix(".status.json")
        name = f"[bench] level {i}/{len(keys)}"
        if remaining < share * MIN_LEVEL_S:
            status_file.write_text(json.dumps({"status": "skipped: budget spent"}))
            print(f"{name}: skipped, budget spent")
            continue
        timeout = min(level.timeout_s or plan.timeout_s, remaining / share)
        head = (
            f"{name}: {level.target}, "
            f"{level.input_len} prompt tokens, concurrency {level.concurrency}, "
            f"{level.num_prompts} prompts (at most {timeout:.0f}s)"
        )
        argv = shlex.join(["vllm", "bench", "serve", *bench_serve_args(plan, level)])
        print(f"\n{head}\n[bench] {argv}", flush=True)
        before = kv_transfer.scrape(level.prefill_url) if level.prefill_url else None
        decode = level.decode_url if level.kv_file else None
        decode_before = kv_transfer.scrape(decode) if decode else None
        start = time.monotonic()
        try:
            status = _run_level(parser, plan, level, timeout)
        except Exception as exc:  # a level's failure must not end the sweep
            status = f"failed: {type(exc).__name__}: {exc}"
        took = time.monotonic() - start
        status_file.write_text(json.dumps({"status": status, "seconds": took}))
        failures += status != "ok"
        completed = 0
        if result.exists():
            completed = int(json.loads(result.read_text())["completed"])
        if level.kv_file and before is not None:
            delta = kv_transfer.settle_delta(
                level.prefill_url or "", before, completed, SETTLE_S
            )
            if decode_before is not None:
                delta |= kv_phases.settle_decode(
                    level.decode_url or "", decode_before, completed, SETTLE_S
                )
            Path(level.kv_file).write_text(json.dumps(delta, indent=1))
        print(f"{name}: {status} in {took:.0f}s", flush=True)
    return 1 if failures == len(keys) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run a vllm bench serve sweep")
    parser.add_argument("plan", type=Path)
    opts = parser.parse_args(argv)
    return run(Plan.from_json(json.loads(opts.plan.read_text())))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: triton's bindings print pages of "leaked"
    # nanobind objects at exit, which would bury the results.
    os._exit(code)
