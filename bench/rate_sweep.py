"""Goodput against request rate, P/D and colocated, in one subprocess:

    python -m bench.rate_sweep PLAN.json

First one request per target to warm up (not counted: P/D's first opens
Mooncake's connections), then one request alone per target (the probe):
its end-to-end latency sizes the rates (once, twice, four times ... the
rate one server finishes requests one at a time), and a probe that misses
the SLO alone ends the sweep with an error naming the fix. Then per rate,
lowest first, the same prompts (Poisson arrivals: ``vllm bench serve
--request-rate R --goodput ...``) through P/D and the colocated reference,
alternating which goes first; a target stops climbing once under
bench.slo.GOOD_SHARE of its requests met the SLO. Around every P/D level
decode and prefill are scraped (bench.evidence). Every level's files land
in the plan's directory.
"""

from __future__ import annotations

import contextlib
import functools
import json
import operator
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests

from bench import evidence, slo, topology
from bench.vllm_bench import Level, Plan, _parser, _run_level, bench_serve_args
from pdstack import metrics as m

PROBE = "probe"
WARMUP = "warmup"
TARGETS = ("pd", "colocated")
SETTLE_S = 30.0
# Exit status of a sweep whose SLO no single request meets.
SLO_UNREACHABLE = 3
# Around a P/D level: every decode's and every prefill's /metrics, by URL.
Scrapes = tuple[dict[str, m.Snapshot], dict[str, m.Snapshot]]


@dataclass(frozen=True)
class RatePlan:
    model: str
    tokenizer: str
    input_len: int
    output_len: int
    num_prompts: int
    ttft_ms: float
    tpot_ms: float
    # "pd": the router; "colocated": the reference (prefill itself by default).
    urls: Mapping[str, str]
    # Every prefill and decode behind the router, as this host reaches them:
    # each one's /metrics is read around a P/D level, the evidence summed.
    prefill_urls: Sequence[str]
    decode_urls: Sequence[str]
    steps: int
    level_timeout_s: float
    budget_s: float
    out: str
    seed: int = 0
    trust_remote_code: bool = False
    # For the report: where the SLO came from, what the colocated reference is.
    slo_from: str = ""
    colocated_is: str = ""
    # How the number of prefills and decodes was learnt (bench.topology).
    servers_from: str = ""

    @property
    def slo(self) -> slo.Slo:
        return slo.Slo(self.ttft_ms, self.tpot_ms)

    @property
    def ratio(self) -> str:
        """The P:D ratio the report is labelled with, e.g. 2P:2D."""
        return topology.label(len(self.prefill_urls), len(self.decode_urls))

    def level(
        self,
        target: str,
        name: str,
        rate: float | None,
        n: int,
        seed: int,
        timeout_s: float,
    ) -> Level:
        return Level(
            target,
            self.urls[target],
            self.input_len,
            n,
            n,
            seed,
            str(Path(self.out) / f"{target}-{name}.json"),
            output_len=self.output_len,
            timeout_s=timeout_s,
            request_rate=rate,
            goodput=tuple(self.slo.goodput_args()),
        )

    def bench_plan(self) -> Plan:
        return Plan(
            self.model,
            self.tokenizer,
            self.output_len,
            self.level_timeout_s,
            (),
            self.budget_s,
            self.trust_remote_code,
        )


def rate_name(rate: float) -> str:
    return f"r{rate:.4g}"


def rates(probe_e2el_ms: float, steps: int) -> list[float]:
    """The rate one request at a time allows, then doubling: batching lets a
    server go well past one at a time, and doubling finds where it stops
    within a few levels."""
    base = 1000.0 / max(probe_e2el_ms, 1.0)
    return [base * 2**k for k in range(steps)]


def _figures(data: Mapping[str, Any] | None) -> str:
    if not data:
        return ", no result"
    return (f", {data.get('completed', 0)} done, TTFT p50/p99 "
            f"{data.get('p50_ttft_ms', 0):.0f}/{data.get('p99_ttft_ms', 0):.0f} ms, "
            f"TPOT p50/p99 {data.get('p50_tpot_ms', 0):.0f}/"
            f"{data.get('p99_tpot_ms', 0):.0f} ms")  # fmt: skip


def _loaded(delta: m.Snapshot) -> dict[str, float]:
    """Decode's prompt tokens in (loaded or computed) and failed receives."""
    in_ = delta.total(m.PROMPT_TOKENS_BY_SOURCE)
    return {"in": in_, "failed": delta.total(m.FAILED_RECVS)}


class Sweep:
    def __init__(self, plan: RatePlan) -> None:
        self.plan = plan
        self.out = Path(plan.out)
        self.parser = _parser()
        self.start = time.monotonic()

    def left_s(self) -> float:
        return self.plan.budget_s - (time.monotonic() - self.start)

    def say(self, line: str) -> None:
        spent = (time.monotonic() - self.start) / 60
        left = max(self.left_s(), 0) / 60
        print(f"[bench goodput {spent:4.1f}m, {left:4.1f}m left] {line}", flush=True)

    def run_level(self, level: Level, label: str) -> dict[str, Any] | None:
        """One level; its result (None if none was written), with P/D's
        evidence in ``<result>.evidence.json``."""
        result = Path(level.result_file)
        timeout = min(level.timeout_s or self.plan.level_timeout_s, self.left_s())
        argv = [
            "vllm",
            "bench",
            "serve",
            *bench_serve_args(self.plan.bench_plan(), level),
        ]
        self.say(f"{label} (at most {timeout:.0f}s)\n[bench] {shlex.join(argv)}")
        pd = level.target == "pd"
        before = self._scrape() if pd else None
        started = time.monotonic()
        # vLLM's own printout (its arguments, its result table) to a file:
        # the screen keeps one progress line per level.
        log = result.with_suffix(".log")
        with log.open("w") as out, contextlib.redirect_stdout(out):
            try:
                status = _run_level(self.parser, self.plan.bench_plan(), level, timeout)
            except Exception as exc:  # a level's failure must not end the sweep
                status = f"failed: {type(exc).__name__}: {exc}"
        took = time.monotonic() - started
        data = json.loads(result.read_text()) if result.exists() else None
        if before is not None:
            lens = [int(n) for n in (data or {}).get("input_lens") or []]
            self._evidence(before, sum(lens), result.with_suffix(".evidence.json"))
        result.with_suffix(".status.json").write_text(
            json.dumps({"status": status, "seconds": took})
        )
        return data

    def _scrape(self) -> Scrapes | str:
        """Every decode's and prefill's /metrics, or why one cannot be read
        (the level still runs; its evidence is then not measurable)."""
        try:
            return (
                {url: m.scrape(url) for url in self.plan.decode_urls},
                {url: m.scrape(url) for url in self.plan.prefill_urls},
            )
        except requests.RequestException as exc:
            return f"/metrics unreadable: {type(exc).__name__}: {exc}"[:200]

    def _evidence(self, before: Scrapes | str, tokens: int, path: Path) -> None:
        """The decodes' counters once their loaded tokens together reach the
        prompts' (or a receive failed) and stop moving; the prefills' at that
        moment. Requests spread over the servers: only the sum over every
        one of them is the level's."""
        found: dict[str, Any] = {"plugin": False}
        try:
            if isinstance(before, str):
                raise requests.ConnectionError(before)
            decode0, prefill0 = before
            if tokens:
                done = lambda v: v["in"] / tokens + v["failed"]  # noqa: E731
                summed = functools.reduce(operator.add, decode0.values())
                urls = list(decode0)
                m.settle_counts(urls, summed, _loaded, done, SETTLE_S)
            decodes = {}
            for url, start in decode0.items():
                after = m.scrape(url)
                decodes[url] = (after - start, after)
            prefills = {url: m.scrape(url) - start for url, start in prefill0.items()}
            found = evidence.capture(decodes, prefills)
        except requests.RequestException as exc:
            found["error"] = str(exc)[:200]
        path.write_text(json.dumps(found, indent=1))

    def probe(self) -> float:
        """One request alone per target, after one not counted (P/D's first
        request opens Mooncake's connections); the slower one's end-to-end ms."""
        e2el = []
        for target in TARGETS:
            warm = self.plan.level(target, WARMUP, None, 1, self.plan.seed + 999,
                                   self.plan.level_timeout_s)  # fmt: skip
            self.run_level(warm, f"warm-up: {target}, one request (not counted)")
            level = self.plan.level(
                target, PROBE, None, 1, self.plan.seed, self.plan.level_timeout_s
            )
            data = self.run_level(level, f"probe: {target}, one request alone")
            if not data or not data.get("completed"):
                raise SystemExit(
                    f"bench: the probe request to {target} "
                    f"({self.plan.urls[target]}) failed: "
                    f"{(data or {}).get('errors') or 'no result'}"
                )
            self.say(f"  {target} alone:{_figures(data)[1:]}")
            e2el.append(float(data["mean_e2el_ms"]))
            if slo.good_requests(data) == 0:
                self._unreachable(target, data)
        return max(e2el)

    def _unreachable(self, target: str, data: Mapping[str, Any]) -> None:
        line = (
            f"bench: SLO {self.plan.slo.describe()} is missed by one request alone "
            f"on {target} (TTFT {data['mean_ttft_ms']:.0f} ms, TPOT "
            f"{data['mean_tpot_ms']:.0f} ms, {self.plan.input_len} prompt tokens): "
            "no rate can meet it; raise BENCH_SLO (e.g. BENCH_SLO=ttft="
            f"{2 * data['mean_ttft_ms']:.0f},tpot={2 * data['mean_tpot_ms']:.0f}) "
            "or shorten BENCH_GOODPUT_INPUT_LEN"
        )
        (self.out / "error.txt").write_text(line + "\n")
        print(line, file=sys.stderr, flush=True)
        sys.exit(SLO_UNREACHABLE)

    def sweep(self, levels: Sequence[float]) -> None:
        climbing = set(TARGETS)
        for i, rate in enumerate(levels):
            order = TARGETS if i % 2 == 0 else TARGETS[::-1]
            for target in [t for t in order if t in climbing]:
                if self.left_s() < 30:
                    self.say(
                        f"budget spent: {target} at {rate:.3g} req/s and up skipped"
                    )
                    return
                level = self.plan.level(
                    target,
                    rate_name(rate),
                    rate,
                    self.plan.num_prompts,
                    self.plan.seed + 1 + i,
                    self.plan.level_timeout_s,
                )
                label = (
                    f"level {i + 1}/{len(levels)}: {target} at {rate:.3g} req/s, "
                    f"{self.plan.num_prompts} prompts"
                )
                data = self.run_level(level, label)
                share = slo.good_share(data) if data else 0.0
                self.say(f"  {target} at {rate:.3g} req/s: {share:.0%} within the SLO"
                         + _figures(data))  # fmt: skip
                if share < slo.GOOD_SHARE:
                    climbing.discard(target)
            if not climbing:
                return


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    data = json.loads(Path(args[0]).read_text())
    plan = RatePlan(**data)
    sweep = Sweep(plan)
    chosen = rates(sweep.probe(), plan.steps)
    (sweep.out / "rates.json").write_text(json.dumps(chosen))
    sweep.say("rates (req/s): " + ", ".join(f"{r:.3g}" for r in chosen))
    sweep.sweep(chosen)
    return 0


def write_plan(plan: RatePlan, path: Path) -> None:
    path.write_text(json.dumps(asdict(plan), indent=1))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as bench.vllm_bench: no triton teardown noise
