"""Staged against direct KV sends, on fresh and on fragmented block lists;
docs/bench.md ("The KV path") says what is measured, why, and how to read it.

Per state (STATE_ENV), on a stack just (re)started (bench.stack.restart_pd),
one ``vllm bench serve`` sweep (plan). Per request: prefill's counter deltas
(bench.kv_transfer), the staged send's phases (bench.kv_phases) and TTFT;
p50s per state x pass x prompt length (Cell), against the transfer engine's
rates (bench.transfer_engine) where the run has them; bench.targets judges
them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import kv_phases, kv_transfer, single_requests
from bench import transfer_engine as te
from bench.levels import WALL_CLOCK, fmt, fmt_pct, ratio, read_json, table
from bench.settings import Settings, human_bytes
from bench.single_requests import Request, p50
from bench.vllm_bench import Level, Plan
from pdstack import kv_layout

ENV = "PD_MOONCAKE_KV_STAGING_MIB"
STATES = ("staged", "direct")
# What each state's stack is (re)started with, on top of the environment.
STATE_ENV: dict[str, dict[str, str]] = {"staged": {}, "direct": {ENV: "0"}}
PASSES = ("fresh", "fragmented")
DIR = "kv_path"
STATE_FILE = "state.json"
BURST = "burst"
# Seeds, clear of the main sweep's (seed + level) and the checksum's (+1000).
SEEDS = {"fresh": 2000, "fragmented": 3000, BURST: 4000}
# An engine result this far from a transfer's size (either way) is not its own.
NEAREST_FACTOR = 4.0
# Descriptor counts within this factor of each other are "as many".
SAME_DESCRIPTORS = 1.5


@dataclass(frozen=True)
class Burst:
    """The fragmentation warm-up: ``prompts`` requests, ``concurrency`` at a
    time, prompt and output lengths drawn from [1 - r, 1 + r] times
    ``input_len`` and ``output_len``, within ``timeout_s``."""

    prompts: int = 16
    concurrency: int = 8
    input_len: int = 1024
    output_len: int = 48
    range_ratio: float = 0.9
    timeout_s: float = 300.0


def state_dir(run_dir: Path, state: str) -> Path:
    return run_dir / DIR / state


def plan(
    s: Settings,
    router: str,
    prefill: str,
    where: Path,
    tokenizer: str,
    burst: Burst = Burst(),
    decode: str | None = None,
) -> Plan:
    """Fresh pass, burst, fragmented pass: one sweep for one state; the same
    prompts in either state; ``decode`` scraped around every request too (the
    scatter phase). Creates the passes' directories."""

    def single(name: str, warmup: bool) -> list[Level]:
        (where / name).mkdir(parents=True, exist_ok=True)
        return single_requests.levels(s, router, prefill, where / name,
                                      s.seed + SEEDS[name], s.kv_path_requests,
                                      warmup)  # fmt: skip

    mixed = Level("pd", router, burst.input_len, burst.concurrency, burst.prompts,
                  s.seed + SEEDS[BURST], str(where / f"{BURST}.json"), prefill,
                  str(where / f"{BURST}.kv.json"), output_len=burst.output_len,
                  range_ratio=burst.range_ratio, timeout_s=burst.timeout_s)  # fmt: skip
    chosen = [*single("fresh", warmup=True), mixed, *single("fragmented", False)]
    chosen = [dataclasses.replace(lv, decode_url=decode) for lv in chosen]
    return single_requests.plan(s, tokenizer, chosen)


def describe(s: Settings, burst: Burst = Burst()) -> str:
    n = s.kv_path_requests
    lens = ", ".join(map(str, sorted(s.input_lens)))
    return (
        f"a warm-up, {n} single requests at each of {lens} tokens (fresh), "
        f"{burst.prompts} mixed requests {burst.concurrency} at a time "
        f"(at most {burst.timeout_s:.0f} s), {n} single requests each again "
        "(fragmented)"
    )


def state_json(env: Mapping[str, str], restart_s: float) -> dict[str, Any]:
    """What a state's stack ran with: the staging setting (None: unset, as
    configs/vllm has it) and the seconds its (re)start took."""
    return {"env": {ENV: env.get(ENV, os.environ.get(ENV))}, "restart_s": restart_s}


# -- reading a run directory ------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One state x pass x prompt length: its requests' p50s."""

    requests: list[Request]

    def counter(self, key: str) -> float | None:
        """A transfer counter's p50 over the requests that sent."""
        sent = (r for r in self.requests if r.transfer_ms() is not None)
        return p50(r.counters.get(key) for r in sent)

    def transfer_ms(self) -> float | None:
        return p50(r.transfer_ms() for r in self.requests)

    def mb_per_s(self) -> float | None:
        return p50(r.mb_per_s() for r in self.requests)

    def ttft_ms(self) -> float | None:
        return p50(r.ttft_ms for r in self.requests)

    def share(self) -> float | None:
        return ratio(self.transfer_ms(), self.ttft_ms())

    def staged(self) -> int | None:
        """Requests sent staged; None if the run recorded no phases."""
        flags = [kv_phases.staged(r.counters) for r in self.requests]
        return None if all(f is None for f in flags) else sum(map(bool, flags))

    def phase_ms(self, phase: str) -> float | None:
        """A phase's p50 (ms) over the requests sent staged."""
        sent = (r.counters for r in self.requests if kv_phases.staged(r.counters))
        return p50(c.get(kv_phases.key(phase), 0.0) * 1e3 for c in sent)


@dataclass(frozen=True)
class Result:
    # state -> pass -> prompt length
    cells: dict[str, dict[str, dict[int, Cell]]]
    states: dict[str, dict[str, Any]]
    bursts: dict[str, dict[str, Any]]

    def cell(self, state: str, name: str, length: int) -> Cell | None:
        return self.cells.get(state, {}).get(name, {}).get(length)

    def lengths(self) -> list[int]:
        return sorted({n for by in self.cells.values() for c in by.values() for n in c})

    def fragmented_vs_fresh(self, state: str, length: int) -> float | None:
        """The fragmented pass's rate over the fresh pass's (p50s)."""
        fresh, frag = (self.cell(state, name, length) for name in PASSES)
        return ratio(*(c.mb_per_s() if c else None for c in (frag, fresh)))

    def staging_note(self) -> str | None:
        """Why the 'staged' state was probably not staged, if so: at the
        longest prompt measured in both states, it sent as many descriptors
        per request as 'direct' (within SAME_DESCRIPTORS) in every pass
        (docs/bench.md, "The KV path", says why they differ)."""
        both = [
            (name, a, b)
            for name in PASSES
            for n in self.lengths()[-1:]
            if (a := _descriptors(self.cell("staged", name, n))) is not None
            and (b := _descriptors(self.cell("direct", name, n)))
        ]
        if not both or any(not a or max(a, b) / min(a, b) > SAME_DESCRIPTORS
                           for _, a, b in both):  # fmt: skip
            return None
        seen = ", ".join(f"{name} {a:.0f} vs {b:.0f}" for name, a, b in both)
        return (
            f"'staged' sent as many descriptors per request as 'direct' "
            f"({self.lengths()[-1]} tokens: {seen}): staging was probably not "
            f"in effect (is {ENV} known to the plugin and configs?)"
        )


def _descriptors(cell: Cell | None) -> float | None:
    return cell.counter("descriptors") if cell else None


def _burst(where: Path) -> dict[str, Any]:
    result, status, kv = (
        read_json(where / f"{BURST}{suffix}") or {}
        for suffix in (".json", ".status.json", ".kv.json")
    )
    if not (result or status):
        return {}

    def span(key: str) -> list[int]:
        values = [int(v) for v in result.get(key) or []]
        return [min(values), max(values)] if values else []

    return {
        "status": status.get("status", "?"), "seconds": status.get("seconds"),
        "completed": int(result.get("completed", 0)),
        "failed": int(result.get("failed", 0)),
        "input_lens": span("input_lens"), "output_lens": span("output_lens"),
        "transfers": kv.get("transfers"), "descriptors": kv.get("descriptors"),
    }  # fmt: skip


def read(run_dir: Path) -> Result | None:
    root = run_dir / DIR
    if not root.exists():
        return None
    cells = {
        state: {
            name: {n: Cell(got) for n, got in single_requests.read(where).items()}
            for name in PASSES
            for where in [root / state / name]
        }
        for state in STATES
    }
    states = {
        s: d for s in STATES if (d := read_json(root / s / STATE_FILE)) is not None
    }
    bursts = {state: burst for state in STATES if (burst := _burst(root / state))}
    return Result(cells, states, bursts)


def engine_for(
    comparisons: Sequence[te.Comparison], nbytes: float | None
) -> te.Comparison | None:
    """The transfer engine's result at the size nearest ``nbytes`` (by ratio),
    if one is within NEAREST_FACTOR of it."""
    if not comparisons or not nbytes or nbytes <= 0:
        return None
    best = min(comparisons, key=lambda c: abs(math.log(c.size / nbytes)))
    far = abs(math.log(best.size / nbytes)) > math.log(NEAREST_FACTOR)
    return None if far else best


def vs_engine(
    cell: Cell | None, comparisons: Sequence[te.Comparison]
) -> tuple[float, te.Comparison] | None:
    """The cell's rate as a share of the engine's bulk rate (one descriptor)
    at the nearest size, and that size's result."""
    rate = cell.mb_per_s() if cell else None
    engine = engine_for(comparisons, cell.counter("bytes") if cell else None)
    if rate is None or engine is None or not engine.engine_bps:
        return None
    return rate * 1e6 / engine.engine_bps, engine


def vs_chunked(cell: Cell | None, comparisons: Sequence[te.Comparison]) -> float | None:
    """The cell's rate as a share of the engine's with 1 MiB descriptors
    through stall_guard, at vs_engine's size."""
    bulk = vs_engine(cell, comparisons)
    if bulk is None or not bulk[1].chunked_bps:
        return None
    return bulk[0] * bulk[1].engine_bps / bulk[1].chunked_bps


def sizes_for(result: Result | None, sizes: Sequence[int]) -> tuple[int, ...]:
    """Of ``sizes``, the nearest to each prompt length's transfer (for an
    engine measurement that covers the run's cells)."""
    engines = [te.Comparison(n, 1, 1, 1, None) for n in sizes]
    cells = _cells(result) if result else []
    picks = (engine_for(engines, cell.counter("bytes")) for *_, cell in cells)
    return tuple(sorted({pick.size for pick in picks if pick}))


def summary(
    result: Result | None, comparisons: Sequence[te.Comparison] = ()
) -> dict[str, Any] | None:
    if result is None:
        return None
    rows = [{
        "state": state, "pass": name, "input_len": n,
        "requests": len(cell.requests),
        "descriptors_p50": cell.counter("descriptors"),
        "bytes_p50": cell.counter("bytes"), "transfer_ms_p50": cell.transfer_ms(),
        "mb_per_s_p50": cell.mb_per_s(), "ttft_ms_p50": cell.ttft_ms(),
        "share_of_ttft": cell.share(),
        "vs_engine_bulk": bulk[0] if (bulk := vs_engine(cell, comparisons)) else None,
        "vs_engine_chunked": vs_chunked(cell, comparisons),
        "staged_requests": cell.staged(),
        **{f"{p}_ms_p50": cell.phase_ms(p) for p in kv_phases.PHASES},
    } for state, name, n, cell in _cells(result)]  # fmt: skip
    return {"cells": rows, "states": result.states, "bursts": result.bursts,
            "staging_note": result.staging_note()}  # fmt: skip


def _cells(result: Result) -> list[tuple[str, str, int, Cell]]:
    return [
        (state, name, n, cell)
        for state in STATES
        for name in PASSES
        for n in result.lengths()
        if (cell := result.cell(state, name, n))
    ]


# -- the report's section -----------------------------------------------------------
TITLE = "KV path: staged / direct sends, fresh / fragmented block lists"
HEAD = ("state", "pass", "prompt", "requests", "descriptors p50", "transfer p50 ms",
        "rate p50 MB/s", "TTFT p50 ms", f"transfer / TTFT ({WALL_CLOCK})",
        "rate / engine bulk (size)",
        f"rate / engine {human_bytes(te.CHUNK_BYTES)} descriptors")  # fmt: skip
PHASE_HEAD = ("state", "pass", "prompt", "staged requests",
              *(f"{p} p50 ms" for p in kv_phases.PHASES), "transfer p50 ms",
              "TTFT p50 ms")  # fmt: skip


def markdown(
    result: Result,
    comparisons: Sequence[te.Comparison],
    model: kv_layout.KVLayout | None,
) -> list[str]:
    def cells(row: tuple[str, str, int, Cell]) -> list[str]:
        state, name, n, cell = row
        engine = vs_engine(cell, comparisons)
        return [
            state, name, str(n), str(len(cell.requests)),
            fmt(cell.counter("descriptors"), 0), fmt(cell.transfer_ms(), 1),
            fmt(cell.mb_per_s(), 0), fmt(cell.ttft_ms(), 0), fmt_pct(cell.share()),
            "n/a" if engine is None
            else f"{fmt_pct(engine[0])} ({human_bytes(engine[1].size)})",
            fmt_pct(vs_chunked(cell, comparisons)),
        ]  # fmt: skip

    def phase_cells(row: tuple[str, str, int, Cell]) -> list[str]:
        state, name, n, cell = row
        staged = cell.staged()
        blank = "n/a" if staged is None else None if staged else "-"
        phases = [blank or fmt(cell.phase_ms(p), 1) for p in kv_phases.PHASES]
        return [state, name, str(n), "n/a" if staged is None else str(staged), *phases,
                fmt(cell.transfer_ms(), 1), fmt(cell.ttft_ms(), 0)]  # fmt: skip

    rows = _cells(result)
    out = [
        "Per state a stack just (re)started: 'staged' with the environment as "
        f"it was, 'direct' with `{ENV}=0`. Single requests one at a time "
        f"({single_requests.OUTPUT_LEN} output tokens) right after start-up "
        "(fresh), then again after a burst of mixed requests that shuffles "
        "both servers' free block lists (fragmented); p50 over the requests, "
        "from prefill's counters around each. Rate: bytes / transfer seconds; "
        "engine bulk: the transfer engine alone, one descriptor of the "
        "nearest size; beside it the engine with 1 MiB descriptors through "
        "stall_guard, as staged sends submit them (transfer-engine table).",
        "",
        *(table(HEAD, map(cells, rows)) if rows else ["No request completed."]),
        "",
    ]
    if rows:
        out += [
            "Per phase of a staged send (bench.kv_phases): gather (prefill: blocks "
            "into its staging buffer), write (prefill: the record to decode's "
            "staging buffer in 1 MiB descriptors), scatter (decode: the record into "
            "its blocks); p50 ms over the requests sent staged, '-' where none was "
            "(direct sends have no phases), n/a where the run recorded none. "
            "Prefill's transfer spans gather and write; the scatter adds to TTFT.",
            "",
            *table(PHASE_HEAD, map(phase_cells, rows)),
            "",
        ]
    for state in STATES:
        data = result.states.get(state, {})
        setting = (data.get("env") or {}).get(ENV)
        line = f"- {state}: " + (f"`{ENV}` unset" if setting is None
                                 else f"`{ENV}={setting}`")  # fmt: skip
        if data.get("restart_s") is not None:
            line += f", stack (re)started in {data['restart_s']:.0f} s"
        if burst := result.bursts.get(state):
            line += (
                f"; fragmentation warm-up {burst['completed']} of "
                f"{burst['completed'] + burst['failed']} requests, prompts "
                f"{_span(burst['input_lens'])}, outputs {_span(burst['output_lens'])} "
                f"tokens, {burst['status']} in {fmt(burst.get('seconds'), 0)} s"
            )
        out.append(line)
    # Every request's bytes against whole blocks of the layout.
    checks = [
        check
        for *_, cell in rows
        for r in cell.requests
        if (check := kv_transfer.check_layout(r.input_lens, r.counters, model))
    ]
    bad = [c for c in checks if not c.ok]
    if model is None:
        out.append("- bytes per request not checked (no layout model)")
    elif bad:
        out.append(
            f"- bytes per request: {len(bad)} of {len(checks)} MISMATCH the layout, "
            f"first: {bad[0].detail}"
        )
    else:
        out.append(
            f"- bytes per request: all {len(checks)} equal the layout's whole blocks"
        )
    if note := result.staging_note():
        out.append(f"- {note}")
    return out


def _span(values: Sequence[int]) -> str:
    return f"{values[0]}-{values[1]}" if values else "n/a"
