"""The goodput sweep's answers, table and plot, read from ``<run>/goodput/``
(what bench.rate_sweep wrote): does P/D pay at the user's SLOs?

The report opens with three sentences: the highest rate each target
sustains within the SLO (>= bench.slo.GOOD_SHARE of its requests met both
bounds) and their ratio, the KV transfer's share of P/D's TTFT for one
request alone, and whether every request's KV crossed and was verified. A
P/D level whose evidence failed never counts as sustained.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import evidence, slo, topology
from bench.levels import WALL_CLOCK, fmt, read_json, table
from bench.rate_sweep import PROBE, TARGETS, rate_name

DIR = "goodput"
TITLE = {"pd": "P/D", "colocated": "colocated"}
PCTS = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl")
PLOT = "goodput.png"


@dataclass(frozen=True)
class Point:
    target: str
    rate: float | None  # None: the probe (one request alone)
    result: Mapping[str, Any] | None
    status: str
    verdict: evidence.Verdict | None  # P/D only

    @property
    def share(self) -> float:
        return slo.good_share(self.result) if self.result else 0.0

    @property
    def holds(self) -> bool:
        """Within the SLO, and (P/D) its KV evidence not failed."""
        ok = self.status == "ok" and self.share >= slo.GOOD_SHARE
        return ok and not (self.verdict and self.verdict.failed)

    def value(self, key: str) -> float | None:
        v = (self.result or {}).get(key)
        return None if v is None else float(v)


def _point(where: Path, target: str, rate: float | None) -> Point:
    name = f"{target}-{PROBE if rate is None else rate_name(rate)}"
    result = read_json(where / f"{name}.json")
    status = (read_json(where / f"{name}.status.json") or {}).get("status", "not run")
    verdict = None
    if target == "pd" and result is not None:
        lens = [int(n) for n in result.get("input_lens") or []]
        errors = result.get("errors") or [""] * len(lens)
        done = [n for n, e in zip(lens, errors, strict=False) if not e]
        verdict = evidence.judge(read_json(where / f"{name}.evidence.json"), done)
    return Point(target, rate, result, status, verdict)


@dataclass(frozen=True)
class Sweep:
    where: Path
    meta: Mapping[str, Any]
    rates: list[float]
    points: list[Point]
    error: str | None

    @classmethod
    def read(cls, run_dir: Path) -> Sweep | None:
        where = run_dir / DIR
        if not where.is_dir():
            return None
        meta = read_json(where / "plan.json") or {}
        rates = read_json(where / "rates.json") or []
        error = (
            (where / "error.txt").read_text().strip()
            if (where / "error.txt").exists()
            else None
        )
        points = [_point(where, t, r) for r in [None, *rates] for t in TARGETS]
        return cls(
            where, meta, rates, [p for p in points if p.status != "not run"], error
        )

    def of(self, target: str) -> list[Point]:
        return [p for p in self.points if p.target == target and p.rate is not None]

    def sustained(self, target: str) -> float | None:
        """The highest rate held, every lower one held too (a rate held only
        above a missed one is noise, not capacity)."""
        best = None
        for p in sorted(self.of(target), key=lambda p: p.rate or 0):
            if not p.holds:
                break
            best = p.rate
        return best

    def probe(self, target: str) -> Point | None:
        return next(
            (p for p in self.points if p.target == target and p.rate is None), None
        )


def ratio(plan: Mapping[str, Any]) -> str | None:
    """The P:D ratio the sweep ran on (e.g. 2P:2D), from its plan; None for
    a plan written before the bench counted the servers."""
    if "prefill_urls" not in plan:
        return None
    return topology.label(len(plan["prefill_urls"]), len(plan["decode_urls"]))


def _pd(plan: Mapping[str, Any]) -> str:
    """ "P/D" with its ratio where known: a report of 2P:2D never reads as
    one of 1P:1D."""
    return f"P/D {r}" if (r := ratio(plan)) else "P/D"


def _bounds(plan: Mapping[str, Any]) -> str:
    return (
        f"TTFT <= {plan.get('ttft_ms', 0):g} ms, TPOT <= {plan.get('tpot_ms', 0):g} ms"
    )


def _rate(rate: float | None) -> str:
    return "none of the tested rates" if rate is None else f"{rate:.3g} req/s"


def answers(sweep: Sweep) -> list[str]:
    """The report's opening sentences."""
    if sweep.error:
        return [f"No answer: {sweep.error}"]
    plan = sweep.meta
    within = f"within the SLO ({_bounds(plan)}, {slo.GOOD_SHARE:.0%} of requests)"
    pd, colo = sweep.sustained("pd"), sweep.sustained("colocated")
    ratio = f"{pd / colo:.2f}x" if pd and colo else "n/a"
    tested = ", ".join(f"{r:.3g}" for r in sweep.rates) or "none"
    top = max(sweep.rates, default=None)
    ceiling = [TITLE[t] for t, r in (("pd", pd), ("colocated", colo)) if r == top]
    held = " and ".join(ceiling)
    held = held[:1].upper() + held[1:]
    out = [
        f"{_pd(plan)} sustains {_rate(pd)} {within} against {_rate(colo)} colocated "
        f"(ratio {ratio}; rates tried: {tested} req/s)."
        + (f" {held} held the highest rate tried, so the limit lies "
           "higher (BENCH_GOODPUT_STEPS=N tries more)." if ceiling else "")
    ]  # fmt: skip
    probe = sweep.probe("pd")
    ev = read_json(sweep.where / f"pd-{PROBE}.evidence.json") if probe else None
    seconds, transfers = (ev or {}).get("transfer_seconds"), (ev or {}).get("transfers")
    ttft = probe.value("mean_ttft_ms") if probe else None
    if seconds and transfers and ttft:
        ms = seconds / transfers * 1e3
        out.append(
            f"KV transfer is {ms / ttft:.1%} of P/D's TTFT at "
            f"{plan.get('input_len')} tokens ({ms:.1f} of {ttft:.0f} ms, one "
            f"request alone; {WALL_CLOCK})."
        )
    else:
        out.append("KV transfer's share of TTFT: not measurable (no transfer "
                   "counters on prefill).")  # fmt: skip
    out.append(evidence_sentence(sweep))
    return out


def evidence_sentence(sweep: Sweep) -> str:
    judged = [(p, p.verdict) for p in sweep.points if p.verdict]
    if not judged:
        return "KV evidence: no P/D level ran."
    if failed := [(p, v) for p, v in judged if v.failed]:
        where = "; ".join(f"{_where(p)}: {v.detail}" for p, v in failed)
        return (
            f"KV evidence FAILED in {len(failed)} of {len(judged)} P/D levels "
            f"({where}); those levels count as failed, not as results."
        )
    if all(v.status == evidence.UNMEASURABLE for _, v in judged):
        return f"Whether KV crossed is not measurable: {judged[0][1].detail}."
    requests = sum(int((p.result or {}).get("completed", 0)) for p, _ in judged)
    return (
        f"Every request's KV crossed and was verified ({requests} requests in "
        f"{len(judged)} P/D levels; per level: {judged[-1][1].detail})."
    )


def _where(p: Point) -> str:
    return "one request alone" if p.rate is None else f"{p.rate:.3g} req/s"


def level_table(sweep: Sweep) -> list[str]:
    def cells(p: Point) -> list[str]:
        lat = [fmt(p.value(f"p{q}_{k}_ms"), 0) for k in LATENCIES for q in PCTS]
        ev = "-"
        if (v := p.verdict) is not None:
            ev = f"**{v.status}**: {v.detail}" if v.failed else v.status
        status = p.status if p.status == "ok" else f"**{p.status}**"
        rate = "alone" if p.rate is None else f"{p.rate:.3g}"
        rates = [fmt(p.value(k), 3) for k in ("request_goodput", "request_throughput")]
        tokens = fmt(p.value("output_throughput"), 1)
        return [
            TITLE[p.target],
            rate,
            status,
            f"{p.share:.0%}",
            *rates,
            tokens,
            *lat,
            ev,
        ]

    head = [
        "target", "req/s", "level", "within SLO", "goodput req/s", "req/s done",
        "output tok/s", *(f"{k.upper()} p{q} ms" for k in LATENCIES for q in PCTS),
        "KV evidence",
    ]  # fmt: skip
    return table(head, map(cells, sweep.points))


def markdown(sweep: Sweep, plotted: bool) -> list[str]:
    plan = sweep.meta
    out = [f"## Goodput against request rate: {_pd(plan)} and colocated", ""]
    if r := ratio(plan):
        decodes = ", ".join(plan["decode_urls"])
        out += [
            f"P/D: {r} ({len(plan['prefill_urls'])} prefill, "
            f"{len(plan['decode_urls'])} decode behind the router; counted from "
            f"{plan.get('servers_from') or '?'}). KV evidence per level is summed "
            f"over every decode ({decodes}) and every prefill "
            f"({', '.join(plan['prefill_urls'])}).",
            "",
        ]
    out.append(
        f"`vllm bench serve --goodput ttft:{plan.get('ttft_ms', 0):g} "
        f"tpot:{plan.get('tpot_ms', 0):g}` (SLO from {plan.get('slo_from', '?')}), "
        f"random prompts of {plan.get('input_len')} tokens, "
        f"{plan.get('output_len')} output tokens, {plan.get('num_prompts')} "
        "requests per rate arriving as a Poisson process; the same prompts for "
        "both targets at a rate. A target stops climbing once under "
        f"{slo.GOOD_SHARE:.0%} of its requests met both bounds; a P/D level "
        "whose KV evidence failed does not count as held."
    )
    out += ["", f"Colocated reference: {plan.get('colocated_is', '?')}", ""]
    out += level_table(sweep)
    if plotted:
        out += ["", f"![goodput and latency percentiles against rate]({DIR}/{PLOT})"]
    return out


def summary(sweep: Sweep) -> dict[str, Any]:
    def level(p: Point) -> dict[str, Any]:
        v = p.verdict
        keys = ["request_goodput", "request_throughput", "output_throughput"]
        keys += [f"p{q}_{k}_ms" for k in LATENCIES for q in PCTS]
        return {
            "target": p.target, "rate": p.rate, "status": p.status,
            "within_slo": p.share, "holds": p.holds,
            "evidence": v and {"status": v.status, "detail": v.detail},
            **{k: p.value(k) for k in keys},
        }  # fmt: skip

    return {
        "answers": answers(sweep),
        "pd_ratio": ratio(sweep.meta),
        "servers": {
            k: sweep.meta.get(k)
            for k in ("prefill_urls", "decode_urls", "servers_from")
        },
        "slo": {k: sweep.meta.get(k) for k in ("ttft_ms", "tpot_ms", "slo_from")},
        "colocated_is": sweep.meta.get("colocated_is"),
        "sustained_req_per_s": {t: sweep.sustained(t) for t in TARGETS},
        "rates": sweep.rates,
        "error": sweep.error,
        "levels": [level(p) for p in sweep.points],
    }


def plot(sweep: Sweep, path: Path) -> bool:
    """Goodput, TTFT and TPOT percentiles against rate, both targets."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not any(sweep.of(t) for t in TARGETS):
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    styles = {"pd": ("-o", "tab:blue"), "colocated": ("--s", "tab:orange")}
    names = {**TITLE, "pd": _pd(sweep.meta)}
    for target in TARGETS:
        points = sorted(sweep.of(target), key=lambda p: p.rate or 0)
        style, color = styles[target]
        xs = [p.rate for p in points]
        axes[0].plot(
            xs,
            [p.value("request_goodput") or 0 for p in points],
            style,
            color=color,
            label=f"{names[target]} goodput",
        )
        axes[0].plot(
            xs,
            [p.value("request_throughput") or 0 for p in points],
            ":",
            marker=".",  # a target that stopped at its first rate: one point
            color=color,
            alpha=0.6,
            label=f"{names[target]} completed",
        )
        for ax, key in ((axes[1], "ttft"), (axes[2], "tpot")):
            for q, alpha in zip(PCTS, (1.0, 0.6, 0.35), strict=True):
                ax.plot(
                    xs,
                    [p.value(f"p{q}_{key}_ms") for p in points],
                    style,
                    color=color,
                    alpha=alpha,
                    label=f"{names[target]} p{q}",
                )
        for p in points:
            if p.verdict and p.verdict.failed:
                axes[0].plot(
                    [p.rate], [p.value("request_goodput") or 0], "rx", markersize=14
                )
    axes[0].set_title("goodput (req/s within SLO)")
    fig.suptitle(
        f"{_pd(sweep.meta)} against colocated: goodput and latency "
        f"percentiles ({sweep.meta.get('input_len')}-token prompts)"
    )
    axes[0].set_ylabel("req/s")
    for ax, key, bound in (
        (axes[1], "TTFT", sweep.meta.get("ttft_ms")),
        (axes[2], "TPOT", sweep.meta.get("tpot_ms")),
    ):
        if bound:
            ax.axhline(bound, color="red", linestyle="-.", label=f"SLO {bound:g} ms")
        ax.set_title(f"{key} percentiles (ms)")
    for ax in axes:
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.94))  # room for the title
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def build(run_dir: Path) -> tuple[list[str], list[str], dict[str, Any]] | None:
    """The answers' lines (the report opens with them), the goodput
    section's and the summary; None where the run has no goodput sweep."""
    sweep = Sweep.read(run_dir)
    if sweep is None:
        return None
    plotted = plot(sweep, run_dir / DIR / PLOT)
    head = ["## Answers", "", *(f"- {a}" for a in answers(sweep)), ""]
    return head, markdown(sweep, plotted), summary(sweep)
