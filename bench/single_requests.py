"""Passes of single requests through P/D, one at a time: their plan, and the
requests read back from what the sweep wrote.

Each request is its own ``vllm bench serve`` level of one prompt at
concurrency 1, so the prefill's transfer counters around it (bench.kv_transfer)
are that request's own: its transfer time, bytes and descriptors, not a mean
over a level, and the servers handle one request at a time, as a quiet server
does. Every request has its own seed (the random dataset's prompts of one seed
are prefixes of each other, and a prefix-cache hit would shorten a prefill).
bench.kv_checksum (checksum on / off) and bench.kv_path (staged / direct,
fresh / fragmented) measure this way.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.levels import LevelResult, level_name, read_json
from bench.settings import Settings
from bench.vllm_bench import Level, Plan

# Only TTFT is measured: two output tokens keep each request short.
OUTPUT_LEN = 2


def levels(
    s: Settings,
    router: str,
    prefill: str,
    out: Path,
    seed: int,
    requests: int,
    warmup: bool = True,
) -> list[Level]:
    """One warm-up request (not counted; seed ``seed - 1``) unless not
    ``warmup``, then ``requests`` single-request levels per prompt length,
    shortest first, with seeds ``seed``, ``seed + 1``, ..."""

    def level(name: str, length: int, seed: int) -> Level:
        return Level("pd", router, length, 1, 1, seed, str(out / f"{name}.json"),
                     prefill, str(out / f"{name}.kv.json"))  # fmt: skip

    first = min(s.input_lens)
    chosen = [level(f"warmup-in{first}", first, seed - 1)] if warmup else []
    runs = [(n, i) for n in sorted(s.input_lens) for i in range(requests)]
    return chosen + [
        level(f"{level_name('pd', n, 1)}-r{i}", n, seed + k)
        for k, (n, i) in enumerate(runs)
    ]


def plan(s: Settings, tokenizer: str, chosen: Iterable[Level]) -> Plan:
    return Plan(s.model, tokenizer, OUTPUT_LEN, s.level_timeout_s, tuple(chosen),
                budget_s=s.sweep_budget_s)  # fmt: skip


@dataclass(frozen=True)
class Request:
    """One completed request: its TTFT and the prefill's transfer counters
    (bench.kv_transfer.COUNTERS' keys) over it."""

    ttft_ms: float
    # Server-reported prompt lengths (for the layout check).
    input_lens: list[int]
    counters: Mapping[str, float]

    def transfer_ms(self) -> float | None:
        """What the request waited for its KV: its transfer's duration."""
        transfers = self.counters.get("transfers", 0)
        return self.counters["seconds"] / transfers * 1e3 if transfers else None

    def mb_per_s(self) -> float | None:
        seconds = self.counters.get("seconds", 0.0)
        return self.counters.get("bytes", 0.0) / seconds / 1e6 if seconds else None


def read(where: Path) -> dict[int, list[Request]]:
    """The completed requests of one pass directory, by prompt length (the
    warm-up is not among them)."""
    out: dict[int, list[Request]] = {}
    for path in sorted(where.glob("pd-in*-c1-r*.json")):
        if path.name.endswith((".status.json", ".kv.json")):
            continue
        level = LevelResult.from_json(read_json(path))
        if not level.completed or "p50_ttft_ms" not in level.values:
            continue
        counters = read_json(path.with_suffix(".kv.json")) or {}
        request = Request(level.values["p50_ttft_ms"], level.input_lens, counters)
        out.setdefault(level.input_len, []).append(request)
    return out


def p50(values: Iterable[float | None]) -> float | None:
    """The median of the values that are there (None: no value at all)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None
