"""What a bench run measured per level: ``vllm bench serve`` results, each P/D
level paired with the colocated one on the same prompts, and how a figure
prints. The report (bench.report) and the targets (bench.targets) read these.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import kv_transfer
from pdstack import kv_layout

GIB = 1 << 30
MIB = 1 << 20
# Shares of TTFT are wall clock: they move with how busy the cores are (the
# twin's two servers, router and bench share 2 cores). The figures that do
# not are bench.transfer_cost's.
WALL_CLOCK = "2-core wall clock"


class ReportError(ValueError):
    pass


# (key in vllm bench's result, column title)
METRICS = (
    ("p50_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("p50_tpot_ms", "TPOT p50 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
    ("p50_itl_ms", "ITL p50 ms"),
    ("p99_itl_ms", "ITL p99 ms"),
    ("output_throughput", "output tok/s"),
)
# Each target a level runs against, and its name in the report.
TARGETS = {"pd": "P/D", "colocated": "colocated"}


@dataclass(frozen=True)
class LevelResult:
    target: str
    input_len: int
    concurrency: int
    completed: int
    failed: int
    values: dict[str, float]
    mean_ttft_ms: float | None
    input_lens: list[int]
    errors: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LevelResult:
        try:
            target = str(data["target"])
            input_len = int(data["input_len"])
            concurrency = int(data["concurrency"])
            completed = int(data["completed"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ReportError(f"not a bench level result: missing {exc}") from exc
        if target not in TARGETS:
            raise ReportError(f"unknown target {target!r}")
        values = {key: float(data[key]) for key, _ in METRICS
                  if completed and data.get(key) is not None}  # fmt: skip
        return cls(
            target=target,
            input_len=input_len,
            concurrency=concurrency,
            completed=completed,
            failed=int(data.get("failed", 0)),
            values=values,
            mean_ttft_ms=float(ttft) if (ttft := data.get("mean_ttft_ms")) else None,
            input_lens=kv_transfer.from_result(data),
            errors=[str(e) for e in data.get("errors") or [] if e],
        )


@dataclass(frozen=True)
class Pair:
    input_len: int
    concurrency: int
    pd: LevelResult | None
    colocated: LevelResult | None
    kv_counters: dict[str, float] | None

    def value(self, target: str, key: str) -> float | None:
        """``key`` of the level of ``target`` (one of TARGETS), if it has one."""
        level = getattr(self, target)
        return level.values.get(key) if level else None

    def kv_cost(self) -> kv_transfer.TransferCost | None:
        if self.kv_counters is None or self.pd is None:
            return None
        return kv_transfer.cost(
            self.kv_counters, len(self.pd.input_lens), self.pd.mean_ttft_ms
        )

    def layout(
        self, model: kv_layout.KVLayout | None
    ) -> kv_transfer.LayoutCheck | None:
        if self.kv_counters is None or self.pd is None:
            return None
        return kv_transfer.check_layout(self.pd.input_lens, self.kv_counters, model)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}"


def fmt_gbps(bps: float | None, digits: int = 2) -> str:
    return "n/a" if bps is None else f"{bps / 1e9:.{digits}f}"


def fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f}%"


def read_json(path: Path) -> Any:
    """A run directory's JSON file, None where the run did not write it."""
    return json.loads(path.read_text()) if path.exists() else None


def level_name(target: str, input_len: int, concurrency: int) -> str:
    return f"{target}-in{input_len}-c{concurrency}"


def table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """Every table of the report: a header, its rule, one line per row."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    return [line(head), "|" + " --- |" * len(head), *map(line, rows)]
