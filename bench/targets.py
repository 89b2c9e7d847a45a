"""The bench's targets, each judged by the number it names.

Why a missed target is missed and what would move it is prose, kept in
docs/bench.md ("Where a target is missed") and quoted by the report.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import hosts_link as hl
from bench import kv_checksum, kv_path, transfer_cost
from bench import transfer_engine as te
from bench.levels import GIB, MIB, WALL_CLOCK, Pair, fmt, fmt_pct, ratio
from bench.settings import human_bytes

KV_SHARE_TARGET = 0.05
KV_SHARE_INPUT_LEN = 4096
ROUTER_P50_TARGET_MS = 1.0
ENGINE_VS_SOCKET_TARGET = 0.80
ENGINE_LARGE_BYTES = 64 * MIB
MEMORY_TARGET_BYTES = 6 * GIB
CHECKSUM_SHARE_TARGET = 0.02
CHECKSUM_INPUT_LEN = 4096
HOSTS_LINK_TARGET = 0.90
STAGED_VS_ENGINE_TARGET = 0.70
STAGED_RATE_LENS = (1024, 4096)
RATE_LENS = " and ".join(map(str, STAGED_RATE_LENS))
FRAGMENTED_VS_FRESH_TARGET = 0.90
STAGED_SHARE_TARGET = 0.01
STAGED_SHARE_INPUT_LEN = 4096
# The tuned engine's environment, as the report names it.
TUNED = ", ".join(f"{k}={v}" for k, v in te.TUNED_ENV.items())
DOC = Path(__file__).resolve().parent.parent / "docs" / "bench.md"
ADVICE_HEADING = "## Where a target is missed"


@dataclass(frozen=True)
class Target:
    name: str
    target: str
    measured: str
    met: bool | None
    note: str = ""
    # Why a miss happens and what would move it (shown when missed).
    advice: str = ""


@functools.cache
def _advice_by_label() -> dict[str, str]:
    """The doc's ``- **<label>**: <paragraph>`` items under ADVICE_HEADING."""
    section = DOC.read_text().split(ADVICE_HEADING, 1)[1].split("\n#", 1)[0]
    items = re.split(r"^- \*\*", section, flags=re.MULTILINE)[1:]
    return {
        label: " ".join(text.split())
        for label, _, text in (item.partition("**: ") for item in items)
    }


def advice(label: str, **figures: str) -> str:
    return _advice_by_label()[label].format(**figures)


def _kv_share_target(pairs: Sequence[Pair]) -> Target:
    name = (
        f"KV transfer share of TTFT, {KV_SHARE_INPUT_LEN}-token prompts, {WALL_CLOCK}"
    )
    target = f"<= {KV_SHARE_TARGET:.0%}"
    measured = [p for p in pairs if p.input_len == KV_SHARE_INPUT_LEN and p.kv_cost()]
    if not measured:
        return Target(name, target, "not measured", None)
    pair = min(measured, key=lambda p: p.concurrency)
    cost = pair.kv_cost()
    assert cost is not None
    share = cost.share_of_ttft
    if failed := int((pair.kv_counters or {}).get("failed_transfers", 0)):
        name += f" ({failed} transfer(s) failed in that level, not counted)"
    return Target(
        name,
        target,
        f"{fmt_pct(share)} ({cost.seconds_per_transfer * 1e3:.0f} ms of "
        f"{fmt(pair.pd.mean_ttft_ms if pair.pd else None, 0)} ms mean TTFT, "
        f"concurrency {pair.concurrency})",
        None if share is None else share <= KV_SHARE_TARGET,
        f"{human_bytes(cost.bytes_per_request)} per request, "
        f"{cost.descriptors_per_transfer:.0f} descriptors per transfer, "
        f"{cost.mb_per_s:.0f} MB/s",
        advice("KV transfer share", mb_per_s=f"{cost.mb_per_s:.0f}"),
    )


def _stall_target(pairs: Sequence[Pair]) -> Target:
    """A stalled send resent (pd_mooncake.stall_guard) anywhere in the sweep."""
    name = "Mooncake stalls in the sweep (sends resent after no progress)"
    levels = [p for p in pairs if p.kv_counters is not None]
    if not levels:
        return Target(name, "0", "not measured", None)
    stalled = {
        f"{p.input_len} tokens x {p.concurrency}": int(n)
        for p in levels
        if (n := (p.kv_counters or {}).get("retried_transfers", 0))
    }
    total = sum(stalled.values())
    where = ", ".join(f"{level}: {n}" for level, n in stalled.items())
    measured = f"{total} in {len(levels)} P/D levels" + (f" ({where})" if where else "")
    miss = advice("Mooncake stalls") if total else ""
    return Target(name, "0", measured, total == 0, "", miss)


def _router_met(real: Sequence[Any], stubs: Sequence[Any]) -> bool | None:
    """Met only where a 95% interval of the p50 overhead lies wholly within
    the target, missed where one lies wholly above it, else unresolved (None).

    The real stack decides when its interval does; the stub measurement (legs
    that cost nothing, so the router's own cost) resolves what the real
    stack's noise cannot. A point figure never decides, nor does the real
    stack's lower bound alone (on a noisy host it is below any target).
    """
    for low, high in (real, stubs):
        if low is None or high is None or math.isnan(low) or math.isnan(high):
            continue
        if low > ROUTER_P50_TARGET_MS or high <= ROUTER_P50_TARGET_MS:
            return low <= ROUTER_P50_TARGET_MS
    return None


def _router_target(overhead: Mapping[str, Any] | None) -> Target:
    name = "Router overhead p50"
    target = f"<= {ROUTER_P50_TARGET_MS:g} ms"
    if not overhead:
        return Target(name, target, "not measured", None)
    p50 = overhead.get("p50_overhead_ms")
    low, high = (overhead.get("p50_overhead_interval_ms") or [None, None])[:2]
    stubs = overhead.get("stubs") or {}
    measured = (
        f"real stack {fmt(p50, 2)} ms (95% interval {fmt(low, 1)} to "
        f"{fmt(high, 1)} ms; p99 {fmt(overhead.get('p99_overhead_ms'), 1)} ms)"
    )
    if (stub_p50 := stubs.get("p50_overhead_ms")) is not None:
        measured += (
            f"; stub backends {fmt(stub_p50, 2)} ms "
            f"(p99 {fmt(stubs.get('p99_overhead_ms'), 2)} ms)"
        )
    stub_low, stub_high = (stubs.get("p50_overhead_interval_ms") or [None, None])[:2]
    if stub_low is not None:
        measured += f", 95% interval {fmt(stub_low, 2)} to {fmt(stub_high, 2)} ms"
    met = _router_met((low, high), (stub_low, stub_high))
    n = overhead.get("pairs") or len(overhead.get("samples", {}).get("router_ms", []))
    own = overhead.get("p50_router_own_ms")
    note = (
        f"{n} pairs on the real stack, {stubs.get('pairs', 0)} on stubs; router's "
        f"own time between its legs through recording proxies {fmt(own, 1)} ms"
    )
    return Target(name, target, measured, met, note, advice("Router overhead"))


def _engine_target(comparisons: Sequence[te.Comparison]) -> Target:
    name = "Transfer engine vs loopback socket, >= 64 MiB"
    target = f">= {ENGINE_VS_SOCKET_TARGET:.0%}"
    large = [c for c in comparisons if c.size >= ENGINE_LARGE_BYTES]
    if not large:
        return Target(name, target, "not measured", None)
    measured = ", ".join(
        f"{human_bytes(c.size)}: {c.vs_socket:.0%} "
        f"({c.engine_bps / 1e9:.2f} vs {c.socket_bps / 1e9:.2f} GB/s)"
        for c in large
    )
    tuned = ", ".join(
        f"{human_bytes(c.size)} {fmt_pct(ratio(c.tuned_bps, c.socket_bps))}"
        for c in large
    )
    met = min(c.vs_socket for c in large) >= ENGINE_VS_SOCKET_TARGET
    return Target(name, target, measured, met, f"tuned ({TUNED}): {tuned}",
                  advice("Engine vs socket"))  # fmt: skip


def _memory_target(memory: Mapping[str, Any] | None) -> Target:
    """Judged on PSS, the memory the processes occupy together: RSS counts the
    pages they share (torch's libraries, in six processes) once per process."""
    name = "Peak resident memory of the P/D twin (sum over its processes, PSS)"
    target = f"<= {human_bytes(MEMORY_TARGET_BYTES)}"
    if not memory or not memory.get("rss_total"):
        return Target(name, target, "not measured", None)
    rss = int(memory["rss_total"])
    pss = int(memory.get("pss_total") or 0)
    peak = pss or rss
    measured = f"{peak / GIB:.2f} GiB" + ("" if pss else " (RSS; PSS not sampled)")
    groups = ", ".join(
        f"{k} {v / GIB:.2f}" for k, v in memory.get("rss_by_group", {}).items()
    )
    note = f"RSS sum {rss / GIB:.2f} GiB (shared pages counted in every process): "
    met = peak <= MEMORY_TARGET_BYTES
    return Target(name, target, measured, met, f"{note}{groups} GiB", advice("Memory"))


def _checksum_target(result: kv_checksum.Result | None) -> Target:
    """TTFT p50 with the checksum on minus off, as a share of off's, at
    CHECKSUM_INPUT_LEN; the digest's own time (one thread, prefill and decode
    each once) says what of it the digest explains."""
    name = f"KV checksum's cost, share of TTFT, {CHECKSUM_INPUT_LEN}-token prompts"
    target = f"<= {CHECKSUM_SHARE_TARGET:.0%}"
    cost = result.ttft_cost(CHECKSUM_INPUT_LEN) if result else None
    if result is None or cost is None:
        return Target(name, target, "not measured", None)
    on, off = (result.side(k, CHECKSUM_INPUT_LEN) for k in kv_checksum.STATES)
    assert on is not None and off is not None
    note = (
        f"transfer p50 on / off {fmt(on.p50_transfer(), 1)} / "
        f"{fmt(off.p50_transfer(), 1)} ms; "
        f"{len(on.ttft_ms)} / {len(off.ttft_ms)} requests"
    )
    if (digest_s := kv_checksum.digest_seconds(result)) is not None:
        share = 2 * digest_s * 1e3 / (off.p50_ttft() or float("nan"))
        note += (
            f"; the digest alone (one thread, prefill and decode once each): "
            f"{2 * digest_s * 1e3:.0f} ms = {fmt_pct(share)}"
        )
    if wrong := result.as_intended():
        note = f"not judged: {wrong}; {note}"
    measured = (
        f"{fmt_pct(cost[1])} ({cost[0]:+,.0f} ms: TTFT p50 "
        f"{fmt(on.p50_ttft(), 0)} on vs {fmt(off.p50_ttft(), 0)} ms off)"
    )
    met = None if wrong else cost[1] <= CHECKSUM_SHARE_TARGET
    return Target(name, target, measured, met, note, advice("KV checksum cost"))


def _hosts_link_target(rates: Sequence[hl.Rate]) -> Target:
    """The engine against the shaped rate, judged only where the link is the
    limit (the socket reaches hl.LINK_LIMITED of it); a failed rate misses."""
    name = "Engine between hosts vs shaped link"
    target = f">= {HOSTS_LINK_TARGET:.0%} where the link is the limit"
    shaped = [r for r in rates if r.rate is not None]
    if not shaped:
        return Target(name, target, "not measured", None)
    # The rest are CPU-bound: their figures say so, no verdict.
    judged = [r for r in shaped if r.link_limited or r.error]
    parts = []
    for r in shaped:
        if r.error:
            parts.append(f"{r.label}: failed ({r.error[:120]})")
        elif r.link_limited:
            parts.append(
                f"{r.label}: {fmt_pct(r.engine_vs_link)} ({r.engine_bps / 1e9:.3f} "
                f"GB/s; socket {fmt_pct(r.socket_vs_link)})"
            )
        else:
            parts.append(
                f"{r.label} not judged, {hl.limit(r)} "
                f"(engine {fmt_pct(r.engine_vs_link)})"
            )
    others = [
        f"unshaped: engine {r.engine_bps / 1e9:.2f} vs socket "
        f"{r.socket_bps / 1e9:.2f} GB/s ({fmt_pct(r.engine_vs_socket)})"
        for r in rates
        if r.rate is None and not r.error
    ]
    reached = [not r.error and (r.engine_vs_link or 0) >= HOSTS_LINK_TARGET
               for r in judged]  # fmt: skip
    met = all(reached) if judged else None
    worst = min((r.engine_vs_link or 0.0 for r in judged), default=0.0)
    miss = advice("Engine between hosts", share=fmt_pct(worst)) if met is False else ""
    return Target(name, target, "; ".join(parts), met, "; ".join(others), miss)


def _kv_path_verdict(
    name: str,
    target: str,
    parts: Sequence[tuple[str, float | None]],
    threshold: float,
    result: kv_path.Result,
    label: str,
    note: str = "",
    at_most: bool = False,
) -> Target:
    """Missed where a part misses ``threshold`` (reaches it, or stays at or
    under it: ``at_most``), met where every part is measured and meets it,
    else unresolved; the staging note (kv_path.Result.staging_note) rides along."""
    present = [(where, v) for where, v in parts if v is not None]
    if not present:
        return Target(name, target, "not measured", None)
    reached = [(v <= threshold) if at_most else (v >= threshold) for _, v in present]
    missing = [where for where, v in parts if v is None]
    met = False if not all(reached) else (None if missing else True)
    notes = [n for n in (note, result.staging_note()) if n]
    if missing:
        notes.append("not measured: " + ", ".join(missing))
    measured = "; ".join(f"{where}: {fmt_pct(v)}" for where, v in present)
    miss = "" if met is not False else advice(label)
    return Target(name, target, measured, met, "; ".join(notes), miss)


def _staged_rate_target(
    result: kv_path.Result | None, comparisons: Sequence[te.Comparison]
) -> Target:
    """The staged stack's rate (p50 bytes / transfer seconds) against the
    engine alone with one descriptor at the nearest size, both passes."""
    name = f"KV staging: stack rate vs engine bulk, {RATE_LENS}-token prompts"
    target = f">= {STAGED_VS_ENGINE_TARGET:.0%}"
    if result is None or not comparisons:
        why = "not measured" if result is None else "not measured (no engine results)"
        return Target(name, target, why, None)
    parts, rates = [], []
    for n in STAGED_RATE_LENS:
        for pass_ in kv_path.PASSES:
            cell = result.cell("staged", pass_, n)
            share = kv_path.vs_engine(cell, comparisons)
            parts.append((f"{n} {pass_}", share[0] if share else None))
            if share and cell:
                rates.append(
                    f"{n} {pass_} {fmt(cell.mb_per_s(), 0)} vs "
                    f"{share[1].engine_bps / 1e6:,.0f} MB/s "
                    f"({human_bytes(share[1].size)})"
                )
    return _kv_path_verdict(name, target, parts, STAGED_VS_ENGINE_TARGET, result,
                            "KV staging rate", "; ".join(rates))  # fmt: skip


def _fragmentation_target(result: kv_path.Result | None) -> Target:
    """Staged: the fragmented pass's rate over the fresh pass's; direct's
    ratio as the note (what staging is for)."""
    name = f"KV staging: fragmented rate vs fresh, {RATE_LENS}-token prompts"
    target = f">= {FRAGMENTED_VS_FRESH_TARGET:.0%}"
    if result is None:
        return Target(name, target, "not measured", None)
    parts = [
        (f"{n}", result.fragmented_vs_fresh("staged", n)) for n in STAGED_RATE_LENS
    ]
    direct = "direct: " + ", ".join(
        f"{n} {fmt_pct(result.fragmented_vs_fresh('direct', n))}"
        for n in STAGED_RATE_LENS
    )
    return _kv_path_verdict(name, target, parts, FRAGMENTED_VS_FRESH_TARGET, result,
                            "KV fragmentation", direct)  # fmt: skip


def _staged_share_target(result: kv_path.Result | None) -> Target:
    """Staged, both passes: transfer p50 as a share of TTFT p50."""
    n = STAGED_SHARE_INPUT_LEN
    name = f"KV staging: transfer share of TTFT, {n}-token prompts, {WALL_CLOCK}"
    target = f"<= {STAGED_SHARE_TARGET:.0%}"
    if result is None:
        return Target(name, target, "not measured", None)
    cells = [(p, result.cell("staged", p, n)) for p in kv_path.PASSES]
    parts = [(p, cell.share() if cell else None) for p, cell in cells]
    times = "; ".join(
        f"{p} {fmt(c.transfer_ms(), 0)} of {fmt(c.ttft_ms(), 0)} ms"
        for p, c in cells
        if c
    )
    return _kv_path_verdict(name, target, parts, STAGED_SHARE_TARGET, result,
                            "KV staging share", times, at_most=True)  # fmt: skip


def _descriptor_target(result: transfer_cost.Result | None) -> Target:
    """Staged sends, every prompt length, fresh and fragmented: descriptors
    per request within ceil(bytes / 1 MiB) + one per region."""
    name = "KV transfer cost: descriptors per request, 128 tokens to max-model-len"
    target = "<= ceil(bytes / 1 MiB) + one per region"
    staged = [s for s in result.samples if s.state == "staged"] if result else []
    if result is None or not staged or result.regions is None:
        return Target(name, target, "not measured", None)
    over = result.over_bound()
    worst = max(staged, key=lambda s: s.descriptors - (result.bound(s.nbytes) or 0))
    measured = (
        f"{len(staged) - len(over)} of {len(staged)} within; closest "
        f"{worst.descriptors:.0f} of {result.bound(worst.nbytes)} "
        f"({worst.input_len} tokens, {worst.name})"
    )
    direct = [s for s in result.samples if s.state == "direct"]
    note = ""
    if direct:
        top = max(direct, key=lambda s: s.descriptors)
        note = (f"direct: up to {top.descriptors:.0f} descriptors ({top.input_len} "
                f"tokens, {top.name}), {len(result.over_bound('direct'))} of "
                f"{len(direct)} over the bound")  # fmt: skip
    return Target(name, target, measured, not over, note,
                  "" if not over else advice("KV staging descriptors"))  # fmt: skip


def _cpu_target(result: transfer_cost.Result | None) -> Target:
    """Staged, every request: both servers' transfer threads' CPU-seconds per
    GiB (net of their idle rate) over the engine alone's for the same bytes."""
    limit = transfer_cost.CPU_RATIO_TARGET
    name = "KV transfer cost: transfer threads' CPU-s per GiB vs engine alone"
    target = f"<= {limit:g}x"
    figures = result.cpu_per_gib("staged") if result else {}
    if not figures or figures.get("ratio") is None:
        return Target(name, target, "not measured", None)
    ratio_ = figures["ratio"]
    measured = (f"{ratio_:.2f}x ({figures['net']:.2f} vs "
                f"{figures['engine_alone']:.2f} CPU-s/GiB)")  # fmt: skip
    direct = result.cpu_per_gib("direct") if result else {}
    note = f"raw (idle not taken out): {figures['raw']:.2f} CPU-s/GiB"
    if (own := figures.get("ratio_threads")) is not None:
        # The engine alone less its caller's spin (transfer_cost's docstring).
        note += (f"; against the engine's own threads "
                 f"({figures['engine_threads']:.2f}): {own:.2f}x")  # fmt: skip
    unchecked = result.cpu_per_gib(transfer_cost.UNCHECKED) if result else {}
    if unchecked.get("ratio") is not None:
        note += (f"; KV checksum off: {unchecked['net']:.2f} CPU-s/GiB, "
                 f"{unchecked['ratio']:.2f}x")  # fmt: skip
    if direct.get("ratio") is not None:
        note += f"; direct: {direct['net']:.2f} CPU-s/GiB, {direct['ratio']:.2f}x"
    met = ratio_ <= limit
    return Target(name, target, measured, met, note,
                  "" if met else advice("KV transfer CPU"))  # fmt: skip


def judge(
    pairs: Sequence[Pair],
    overhead: Mapping[str, Any] | None,
    comparisons: Sequence[te.Comparison],
    memory: Mapping[str, Any] | None,
    checksum: kv_checksum.Result | None = None,
    hosts_link: Sequence[hl.Rate] = (),
    kv_paths: kv_path.Result | None = None,
    cost: transfer_cost.Result | None = None,
) -> list[Target]:
    return [
        _kv_share_target(pairs),
        _router_target(overhead),
        _engine_target(comparisons),
        _memory_target(memory),
        _checksum_target(checksum),
        _stall_target(pairs),
        _hosts_link_target(hosts_link),
        _staged_rate_target(kv_paths, comparisons),
        _fragmentation_target(kv_paths),
        _staged_share_target(kv_paths),
        _descriptor_target(cost),
        _cpu_target(cost),
    ]
