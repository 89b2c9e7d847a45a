"""What vllm-router adds: its latency against the same two legs sent directly.

The legs are the ones the router sends (bench.router_capture reads them off
the wire and checks them). Router and direct requests alternate on the same
prompts; overhead = percentile of router end-to-end latency minus the same
percentile of the two direct legs. The same against stub backends (the real
router in between) isolates the router's own cost from the servers' variance.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from bench import router_capture
from pdstack.supervisor import HOST

RESAMPLES = 1000


@dataclass
class Overhead:
    router_ms: list[float] = field(default_factory=list)
    direct_ms: list[float] = field(default_factory=list)
    prefill_leg_ms: list[float] = field(default_factory=list)
    decode_leg_ms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def percentile(self, values: Sequence[float], p: float) -> float:
        return float(np.percentile(values, p)) if values else float("nan")


class Connection(http.client.HTTPConnection):
    """A kept-alive HTTP/1.1 connection with the least client-side cost
    (http.client, bodies serialized before the clock starts): the client's own
    time is in both paths, once more in the direct one (two requests)."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        timeout = router_capture.REQUEST_TIMEOUT_S
        super().__init__(parts.hostname or HOST, parts.port or 80, timeout=timeout)

    def post(self, path: str, body: bytes) -> bytes:
        for attempt in (1, 2):
            try:
                self.request("POST", path, body, {"Content-Type": "application/json"})
                answer = self.getresponse()
                data = answer.read()
                break
            except (http.client.HTTPException, ConnectionError):
                self.close()
                if attempt == 2:
                    raise
        if answer.status != 200:
            raise router_capture.ProtocolError(
                f"{self.host}:{self.port}{path}: HTTP {answer.status}: {data[:300]!r}"
            )
        return data


def measure(
    router_url: str,
    prefill_url: str,
    decode_url: str,
    bootstrap: str,
    model: str,
    pairs: int,
    max_tokens: int = 2,
    warmup: int = 3,
    progress: router_capture.Progress = print,
) -> Overhead:
    """Alternate router and direct requests on the same prompts."""
    engine = router_capture.engine_id(bootstrap)
    via_router = Connection(router_url)
    to_prefill, to_decode = Connection(prefill_url), Connection(decode_url)
    path = "/v1/completions"
    result = Overhead()
    last_note = time.monotonic()

    def router_once(routed: bytes) -> float:
        start = time.perf_counter()
        via_router.post(path, routed)
        return (time.perf_counter() - start) * 1e3

    def direct_once(legs: list[bytes]) -> tuple[float, float, float]:
        start = time.perf_counter()
        to_prefill.post(path, legs[0])
        mid = time.perf_counter()
        to_decode.post(path, legs[1])
        end = time.perf_counter()
        return (end - start) * 1e3, (mid - start) * 1e3, (end - mid) * 1e3

    try:
        for i in range(warmup + pairs):
            body = {"model": model, "prompt": f"{i} {router_capture.PROMPT}",
                    "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True}  # fmt: skip
            routed = json.dumps(body).encode()
            prefill, decode = router_capture.build_legs(body, engine, bootstrap)
            legs = [json.dumps(prefill).encode(), json.dumps(decode).encode()]
            # Alternate which path goes first, so neither always finds the
            # servers just woken (or just busy).
            try:
                if i % 2:
                    router = router_once(routed)
                    direct = direct_once(legs)
                else:
                    direct = direct_once(legs)
                    router = router_once(routed)
            except router_capture.ProtocolError as exc:
                # A failed request (e.g. a KV transfer timing out on a busy
                # host) drops its pair; many of them end the measurement.
                result.failures.append(str(exc)[:300])
                if len(result.failures) > max(3, pairs // 5):
                    raise
                continue
            if i >= warmup:
                result.router_ms.append(router)
                result.direct_ms.append(direct[0])
                result.prefill_leg_ms.append(direct[1])
                result.decode_leg_ms.append(direct[2])
            if time.monotonic() - last_note > 15:
                progress(f"  ... {i + 1 - warmup}/{pairs} pairs")
                last_note = time.monotonic()
    finally:
        for conn in (via_router, to_prefill, to_decode):
            conn.close()
    return result


def measure_on_stubs(
    model: str, pairs: int, run_dir: Path, progress: router_capture.Progress = print
) -> Overhead:
    """Router vs direct legs against stub backends (router_capture.stub_vllm)."""
    taps = router_capture.stub_taps(model)
    router = router_capture.router_behind(taps, run_dir, "router-stubs", progress)
    with router as (router_url, _):
        return measure(
            router_url, taps[0].url, taps[1].url, taps[2].url, model, pairs,
            warmup=20, progress=progress,
        )  # fmt: skip


def p50_interval(overhead: Overhead) -> tuple[float, float]:
    """95% bootstrap interval of p50(router) - p50(direct), over RESAMPLES."""
    router, direct = np.asarray(overhead.router_ms), np.asarray(overhead.direct_ms)
    if len(router) < 2 or len(direct) < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(0)
    diffs = [
        np.median(rng.choice(router, len(router)))
        - np.median(rng.choice(direct, len(direct)))
        for _ in range(RESAMPLES)
    ]
    low, high = np.percentile(diffs, [2.5, 97.5])
    return float(low), float(high)


def summary(overhead: Overhead) -> dict[str, Any]:
    data: dict[str, Any] = {
        "pairs": len(overhead.router_ms),
        "failed_pairs": len(overhead.failures),
    }
    # The paired figure: per-pair differences (same prompt, back to back).
    pairs = zip(overhead.router_ms, overhead.direct_ms, strict=False)
    paired = [r - d for r, d in pairs]
    for p in (50, 99):
        data[f"p{p}_router_ms"] = overhead.percentile(overhead.router_ms, p)
        data[f"p{p}_direct_ms"] = overhead.percentile(overhead.direct_ms, p)
        data[f"p{p}_overhead_ms"] = data[f"p{p}_router_ms"] - data[f"p{p}_direct_ms"]
        data[f"p{p}_paired_overhead_ms"] = overhead.percentile(paired, p)
    data["p50_overhead_interval_ms"] = list(p50_interval(overhead))
    return data


def to_json(
    overhead: Overhead,
    capture_result: router_capture.Capture | None,
    stubs: Overhead | None = None,
) -> dict[str, Any]:
    data: dict[str, Any] = {"samples": asdict(overhead), **summary(overhead)}
    if stubs is not None:
        data["stubs"] = summary(stubs)
        data["stubs_samples"] = asdict(stubs)
    if capture_result is not None:
        data["capture"] = asdict(capture_result)
        own = capture_result.router_own_ms
        data["p50_router_own_ms"] = float(np.percentile(own, 50)) if own else None
    return data
