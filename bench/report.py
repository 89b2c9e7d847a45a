"""The report of one bench run: report.md, report.png and summary.json.

Everything is computed from the JSON files in the run directory, so a report
can be rebuilt (``python -m bench report DIR``) and tested on recorded runs:

- ``raw/<target>-in<L>-c<C>.json``: ``vllm bench serve --save-detailed``
  results (``.status.json``: how the level ended; ``.kv.json``: the prefill's
  transfer counters over a P/D level);
- ``transfer_engine.json``, ``hosts_link.json`` (the engine between hosts),
  ``router_overhead.json``, ``startup.json``,
  ``memory.json``, ``meta.json``: the other measurements and the settings.

The levels and how figures print are bench.levels; the targets are judged in
bench.targets; this module reads the run directory and renders.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import goodput, kv_checksum, kv_path, kv_transfer, transfer_cost
from bench import hosts_link as hl
from bench import transfer_engine as te
from bench.levels import (
    GIB,
    METRICS,
    MIB,
    TARGETS,
    WALL_CLOCK,
    LevelResult,
    Pair,
    fmt,
    fmt_gbps,
    fmt_pct,
    level_name,
    ratio,
    read_json,
    table,
)
from bench.settings import human_bytes
from bench.targets import TUNED, Target, judge
from pdstack import kv_layout

# The engine's series, in the order of the plot's legend and of the engine
# table's GB/s columns: (te.Comparison's field, line style, label).
ENGINE_SERIES = (
    ("engine_bps", "-o", "Mooncake, 1 descriptor"),
    ("kv_blocks_bps", "-^", "Mooncake, 36 KiB descriptors"),
    ("chunked_bps", "-x", "Mooncake, 1 MiB descriptors (stall_guard)"),
    ("tuned_bps", "-v", "Mooncake, 1 MiB TCP slices"),
    ("socket_bps", "--s", "loopback socket"),
    ("memcpy_bps", ":d", "memcpy"),
)


def comparison_table(pairs: Sequence[Pair]) -> list[str]:
    def cells(pair: Pair) -> list[str]:
        out = [str(pair.input_len), str(pair.concurrency)]
        for key, _ in METRICS:
            pd, colo = pair.value("pd", key), pair.value("colocated", key)
            digits = 0 if key == "output_throughput" or (pd or 0) >= 100 else 1
            shown = "n/a" if (r := ratio(pd, colo)) is None else f"{r:.2f}x"
            out.append(f"{fmt(pd, digits)} / {fmt(colo, digits)} ({shown})")
        return out

    head = ["prompt", "conc.", *(title for _, title in METRICS)]
    return table(head, map(cells, pairs))


def kv_table(pairs: Sequence[Pair], model: kv_layout.KVLayout | None) -> list[str]:
    def cells(pair: Pair, cost: kv_transfer.TransferCost) -> list[str]:
        verdict = "n/a (no layout model)"
        if (check := pair.layout(model)) is not None:
            verdict = ("OK: " if check.ok else "MISMATCH: ") + check.detail
        return [
            str(pair.input_len), str(pair.concurrency),
            f"{cost.requests} / {cost.transfers}", f"{cost.bytes_per_request:,.0f}",
            f"{cost.descriptors_per_transfer:.0f}",
            f"{cost.seconds_per_transfer * 1e3:.1f}", fmt_pct(cost.share_of_ttft),
            f"{cost.mb_per_s:.0f}", verdict,
        ]  # fmt: skip

    head = [
        "prompt", "conc.", "requests / transfers", "bytes/request",
        "descriptors/transfer", "ms per transfer",
        f"share of mean TTFT ({WALL_CLOCK})",
        "effective MB/s", "layout check",
    ]  # fmt: skip
    return table(head, (cells(p, c) for p in pairs if (c := p.kv_cost()) is not None))


def engine_table(comparisons: Sequence[te.Comparison]) -> list[str]:
    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0%}"

    def cells(c: te.Comparison) -> list[str]:
        bps = [fmt_gbps(getattr(c, key)) for key, _, _ in ENGINE_SERIES]
        return [human_bytes(c.size), *bps, f"{c.vs_socket:.0%}", f"{c.vs_memcpy:.0%}",
                pct(ratio(c.chunked_bps, c.socket_bps)),
                pct(ratio(c.tuned_bps, c.socket_bps))]  # fmt: skip

    tuned, chunk = TUNED, human_bytes(te.CHUNK_BYTES)
    head = [
        "size", "engine GB/s", "engine, 36 KiB descriptors GB/s",
        f"engine, {chunk} descriptors (stall_guard) GB/s", f"engine, {tuned} GB/s",
        "socket GB/s", "memcpy GB/s", "engine / socket", "engine / memcpy",
        f"{chunk} descriptors / socket", "tuned engine / socket",
    ]  # fmt: skip
    return table(head, map(cells, comparisons))


def targets_table(checks: Sequence[Target]) -> list[str]:
    def cells(t: Target) -> list[str]:
        met = "n/a" if t.met is None else ("yes" if t.met else "**no**")
        return [t.name, t.target, t.measured + (f"<br>{t.note}" if t.note else ""), met]

    return table(["metric", "target", "measured", "met?"], map(cells, checks))


@dataclass(frozen=True)
class Run:
    """A run directory, read once: what the summary, the Markdown and the plot
    are made of."""

    meta: Mapping[str, Any]
    pairs: list[Pair]
    status: dict[str, str]
    comparisons: list[te.Comparison]
    overhead: Mapping[str, Any] | None
    startup: Mapping[str, Any]
    memory: Mapping[str, Any] | None
    model: kv_layout.KVLayout | None
    checksum: kv_checksum.Result | None
    hosts_link: list[hl.Rate]
    kv_path: kv_path.Result | None
    cost: transfer_cost.Result | None = None

    @functools.cached_property
    def checks(self) -> list[Target]:
        return judge(self.pairs, self.overhead, self.comparisons, self.memory,
                     self.checksum, self.hosts_link, self.kv_path,
                     self.cost)  # fmt: skip

    @classmethod
    def read(cls, run_dir: Path) -> Run:
        raw = run_dir / "raw"
        files = sorted(raw.glob("*.json"))
        # Every planned level's status (also failed ones'), then the results.
        status = {
            p.name.removesuffix(".status.json"): read_json(p).get("status", "?")
            for p in files
            if p.name.endswith(".status.json")
        }
        levels = [
            LevelResult.from_json(read_json(p))
            for p in files
            if not p.name.endswith((".status.json", ".kv.json"))
        ]
        by_key = {(lv.target, lv.input_len, lv.concurrency): lv for lv in levels}
        # Each P/D level with the colocated one of the same prompt length and
        # concurrency, and the P/D level's transfer counters (its .kv.json).
        pairs = [
            Pair(n, c, by_key.get(("pd", n, c)), by_key.get(("colocated", n, c)),
                 read_json(raw / f"{level_name('pd', n, c)}.kv.json"))
            for n, c in sorted({(lv.input_len, lv.concurrency) for lv in levels})
        ]  # fmt: skip
        engine = read_json(run_dir / "transfer_engine.json")
        return cls(
            pairs=pairs,
            status=status,
            comparisons=te.compare(te.from_json(engine)) if engine else [],
            overhead=read_json(run_dir / "router_overhead.json"),
            memory=read_json(run_dir / "memory.json"),
            checksum=kv_checksum.read(run_dir),
            hosts_link=hl.from_json(read_json(run_dir / "hosts_link.json") or []),
            kv_path=kv_path.read(run_dir),
            cost=transfer_cost.read(run_dir),
            meta=read_json(run_dir / "meta.json") or {},
            startup=read_json(run_dir / "startup.json") or {},
            model=kv_transfer.layout_from_json(read_json(run_dir / "kv_layout.json")),
        )


def summary(run: Run) -> dict[str, Any]:
    return {
        "meta": run.meta,
        "targets": [asdict(t) for t in run.checks],
        "levels": [
            {
                "input_len": p.input_len,
                "concurrency": p.concurrency,
                "pd": p.pd.values if p.pd else None,
                "colocated": p.colocated.values if p.colocated else None,
                "ratio_pd_over_colocated": {
                    key: ratio(p.value("pd", key), p.value("colocated", key))
                    for key, _ in METRICS
                },
                "kv": asdict(c) if (c := p.kv_cost()) else None,
            }
            for p in run.pairs
        ],
        "level_status": run.status,
        "layout_checks_ok": all(c.ok for p in run.pairs if (c := p.layout(run.model))),
        "startup": run.startup,
        "memory": run.memory,
        "router_overhead": {
            k: v for k, v in (run.overhead or {}).items() if k != "samples"
        },
        "transfer_engine": [asdict(c) for c in run.comparisons],
        "hosts_link": [r.summary() for r in run.hosts_link],
        "kv_checksum": kv_checksum.summary(run.checksum),
        "kv_path": kv_path.summary(run.kv_path, run.comparisons),
        "transfer_cost": transfer_cost.summary(run.cost),
    }


def build(run_dir: Path) -> dict[str, Any]:
    """Write report.md, report.png and summary.json; returns the summary."""
    run = Run.read(run_dir)
    data = summary(run)
    swept = goodput.build(run_dir)
    if swept is not None:
        data = {"answers": swept[2]["answers"], "goodput": swept[2], **data}
    # The P:D ratio measured (bench.topology), first: 2P:2D never reads as 1P:1D.
    data = {"pd_ratio": pd_ratio(run.meta), **data}
    (run_dir / "summary.json").write_text(json.dumps(data, indent=1, default=str))
    plotted = plot(run_dir / "report.png", run.pairs, run.comparisons)
    opening, section = swept[:2] if swept else ([], [])
    (run_dir / "report.md").write_text(markdown(run, plotted, opening, section))
    return data


def pd_ratio(meta: Mapping[str, Any]) -> str | None:
    """The run's P:D ratio (e.g. 2P:2D) as bench.run recorded it; None for
    a run recorded before the bench counted the servers."""
    return (meta.get("servers") or {}).get("ratio")


def section(title: str, body: Sequence[str]) -> list[str]:
    return ["", f"## {title}", "", *body]


def markdown(
    run: Run, plotted: bool, answers: Sequence[str] = (), swept: Sequence[str] = ()
) -> str:
    """The report; ``answers`` (bench.goodput's) open it, the goodput sweep
    (``swept``) comes before the targets."""
    meta, checks, pairs, status = run.meta, run.checks, run.pairs, run.status
    ratio = pd_ratio(meta)
    pd = f"P/D {ratio}" if ratio else "P/D"
    out = [f"# {pd} vs colocated: bench run {meta.get('started', '')}", "", *answers]
    if meta.get("stack"):
        out += [f"Stack: {meta['stack']}. Profile `{meta.get('profile', 'tiny')}`.", ""]
    if meta.get("machine"):
        out += [f"Machine: {meta['machine']}", ""]
    if swept:
        out += [*swept, ""]
    out += ["## Targets", "", *targets_table(checks)]
    if missed := [t for t in checks if t.met is False and t.advice]:
        out += ["", "Where a target is missed:", ""]
        out += [f"- **{t.name}**: {t.advice}" for t in missed]
    out += [
        "",
        "## Latency and throughput: P/D / colocated (ratio P/D over colocated)",
        "",
        "vLLM's `vllm bench serve`, random dataset, "
        f"{meta.get('output_len', '?')} output tokens, greedy, one wave of "
        "requests per level. Below 1x P/D is better for latencies, above 1x for "
        "throughput. p99 over a handful of requests is close to the maximum.",
        "",
        *comparison_table(pairs),
    ]
    ran = [lv for p in pairs for lv in (p.pd, p.colocated) if lv is not None]
    if failed := [lv for lv in ran if lv.failed or lv.errors]:
        out += ["", "Failed requests (servers' logs are in the run directory's stack):"]
        out += [
            f"- {TARGETS[lv.target]} {lv.input_len} x "
            f"{lv.concurrency}: {lv.failed} of {lv.failed + lv.completed}: "
            f"{sorted(set(lv.errors))[0][:160] if lv.errors else ''}"
            for lv in failed
        ]
    if bad := ", ".join(f"{k} ({v})" for k, v in status.items() if v != "ok"):
        out += ["", f"Levels that did not finish: {bad}"]
    if skipped := ", ".join(meta.get("skipped_levels") or []):
        out += ["", f"Skipped (input x concurrency over the token budget): {skipped}"]
    if plotted:
        out += ["", "![latency, throughput and transfer engine](report.png)"]
    out += section(
        "KV transfer (prefill's Mooncake metrics, per P/D level)",
        kv_table(pairs, run.model),
    )
    if run.checksum:
        out += ["", *kv_checksum.markdown(run.checksum)]
    if run.kv_path:
        out += section(
            kv_path.TITLE, kv_path.markdown(run.kv_path, run.comparisons, run.model)
        )
    if run.cost:
        out += section(transfer_cost.TITLE, transfer_cost.markdown(run.cost))
    if run.comparisons:
        out += section(
            "Mooncake transfer engine alone (TCP, loopback, two processes)",
            engine_table(run.comparisons),
        )
    if run.hosts_link:
        out += ["", *hl.markdown(run.hosts_link)]
    if overhead := run.overhead:
        out += section("Router overhead", [])
        runs = {"real stack": overhead, "stub backends": overhead.get("stubs")}
        for label, data in ((k, v) for k, v in runs.items() if v):
            for p in (50, 99):
                routed = fmt(data.get(f"p{p}_router_ms"), 2)
                out.append(
                    f"- {label}, p{p}: router {routed} ms, "
                    f"direct legs {fmt(data.get(f'p{p}_direct_ms'), 2)} ms, "
                    f"overhead {fmt(data.get(f'p{p}_overhead_ms'), 2)} ms "
                    f"(paired {fmt(data.get(f'p{p}_paired_overhead_ms'), 2)} ms)"
                )
        if cap := overhead.get("capture"):
            p_params = (cap.get("prefill_leg") or {}).get("kv_transfer_params")
            d_params = (cap.get("decode_leg") or {}).get("kv_transfer_params")
            answered = json.dumps(cap.get("prefill_response_kv_params"))
            out.append(
                "- protocol seen on the wire (tapped router): prefill leg "
                f"`kv_transfer_params` `{json.dumps(p_params)}`, decode leg "
                f"`{json.dumps(d_params)}`; prefill answered "
                f"`kv_transfer_params: {answered}`; decode leg sent after "
                f"prefill answered: {cap.get('legs_in_order')}"
            )
        if (diffs := overhead.get("protocol_differences")) is not None:
            out.append(
                "- direct legs match the router's: " + ("; ".join(diffs) or "yes")
            )
    if run.startup:
        times = [(k, v) for k, v in run.startup.items() if isinstance(v, (int, float))]
        out += section("Start-up", [f"- {key}: {value:.0f} s" for key, value in times])
    if memory := run.memory:
        rss, pss = (int(memory.get(k, 0)) / GIB for k in ("rss_total", "pss_total"))
        samples = memory.get("samples", 0)
        line = f"- RSS sum {rss:.2f} GiB, PSS sum {pss:.2f} GiB over {samples} samples"
        out += section("Peak memory of the P/D twin", [line])
    if meta.get("notes"):
        out += section("Notes", [f"- {n}" for n in meta["notes"]])
    return "\n".join(out) + "\n"


def plot(
    path: Path, pairs: Sequence[Pair], comparisons: Sequence[te.Comparison]
) -> bool:
    """The PNG: TTFT, TPOT, throughput against concurrency, and the engine."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    concurrencies = sorted({p.concurrency for p in pairs})
    panels = (
        (axes[0][0], "p50_ttft_ms", "TTFT p50 (ms)"),
        (axes[0][1], "p50_tpot_ms", "TPOT p50 (ms)"),
        (axes[1][0], "output_throughput", "output tokens/s"),
    )
    for ax, key, title in panels:
        for i, length in enumerate(sorted({p.input_len for p in pairs})):
            for target, style in (("pd", "-o"), ("colocated", "--s")):
                points = [(p.concurrency, v) for p in pairs if p.input_len == length
                          and (v := p.value(target, key)) is not None]  # fmt: skip
                if points:
                    ax.plot(*zip(*points, strict=True), style,
                            color=colors[i % len(colors)],
                            label=f"{TARGETS[target]}, {length} tok")  # fmt: skip
        ax.set_xscale("log", base=2)
        if concurrencies:
            ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        if key != "output_throughput":
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    ax = axes[1][1]
    if comparisons:
        for key, style, label in ENGINE_SERIES:
            points = [(c.size / MIB, getattr(c, key) / 1e9)
                      for c in comparisons if getattr(c, key)]  # fmt: skip
            if points:
                ax.plot(*zip(*points, strict=True), style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        sizes = [c.size / MIB for c in comparisons]
        ax.set_xticks(sizes, [human_bytes(c.size) for c in comparisons], fontsize=7)
        ax.set_xlabel("transfer size")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    ax.set_title("transfer throughput (GB/s)")
    fig.suptitle("P/D (solid) vs colocated (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
