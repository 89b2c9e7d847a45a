"""The service-level objectives goodput is judged against.

``BENCH_SLO=ttft=MS,tpot=MS`` (``python -m bench run --slo ...``) or the
target's defaults (``bench.slo`` in configs/targets/<target>.yaml, justified
there). vLLM's own ``vllm bench serve --goodput ttft:MS tpot:MS`` counts the
requests that meet both; this module only states them and reads the count.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdstack import config

# A rate "holds" the SLO where at least this share of its requests met both.
GOOD_SHARE = 0.9
KEYS = ("ttft", "tpot")


class SloError(ValueError):
    pass


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float

    def goodput_args(self) -> list[str]:
        """``vllm bench serve``'s ``--goodput`` values."""
        return [f"ttft:{self.ttft_ms:g}", f"tpot:{self.tpot_ms:g}"]

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_ms:g} ms and TPOT <= {self.tpot_ms:g} ms"


def parse(text: str) -> Slo:
    """``ttft=2000,tpot=50`` (milliseconds; ``:`` as vLLM writes it works too)."""
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\w+)\s*[=:]\s*([0-9.]+)\s*(?:ms)?", part)
        if not match or match.group(1).lower() not in KEYS:
            raise SloError(
                f"BENCH_SLO: {part!r} is not ttft=MS or tpot=MS "
                "(example: BENCH_SLO=ttft=2000,tpot=50)"
            )
        values[match.group(1).lower()] = float(match.group(2))
    if missing := [k for k in KEYS if k not in values]:
        raise SloError(f"BENCH_SLO: give {' and '.join(missing)} too (ttft=MS,tpot=MS)")
    if any(v <= 0 for v in values.values()):
        raise SloError(f"BENCH_SLO: every bound must be positive, got {text!r}")
    return Slo(values["ttft"], values["tpot"])


def default(target: str) -> Slo:
    """The target's SLOs (configs/targets/<target>.yaml, ``bench.slo``)."""
    data: Mapping[str, Any] = config.target(target).get("bench", {}).get("slo", {})
    return Slo(float(data["ttft_ms"]), float(data["tpot_ms"]))


def chosen(text: str, target: str) -> tuple[Slo, str]:
    """The SLO and where it came from, for the report."""
    if text.strip():
        return parse(text), "BENCH_SLO"
    return default(target), f"configs/targets/{target}.yaml (bench.slo)"


def good_requests(result: Mapping[str, Any]) -> int:
    """Requests of a saved ``vllm bench serve --goodput`` result that met
    every SLO: vLLM reports them as a rate over the run's duration."""
    goodput = result.get("request_goodput")
    if goodput is None:
        raise SloError("the result has no request_goodput: run without --goodput?")
    return round(float(goodput) * float(result["duration"]))


def good_share(result: Mapping[str, Any]) -> float:
    """Met SLO / sent (failed requests count as missed)."""
    sent = int(result.get("completed", 0)) + int(result.get("failed", 0))
    sent = sent or int(result.get("num_prompts", 0))
    return good_requests(result) / sent if sent else 0.0
