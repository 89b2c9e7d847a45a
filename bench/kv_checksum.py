"""What the plugin's KV checksum (pd_mooncake.checksum) costs, two measurements
for the report's "KV checksum" section; docs/bench.md ("The KV checksum's
cost") says how and why: the same single requests (bench.single_requests: one
at a time, as on a quiet server) through P/D with the checksum on and, after a
restart, off; and the digest alone, in-process (digest_benchmark).
"""

from __future__ import annotations

import json
import statistics
import timeit
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import single_requests
from bench.levels import fmt, fmt_pct, read_json, table
from bench.settings import Settings, human_bytes
from bench.single_requests import p50
from bench.vllm_bench import Plan
from pdstack import kv_layout
from pdstack import metrics as m

ENV = "PD_MOONCAKE_KV_CHECKSUM"
STATES = ("on", "off")
DIR = "kv_checksum"
DIGEST_FILE = "digest.json"
STATE_FILE = "state.json"
# Seeds of the checksum's requests: clear of the main sweep's (seed + level).
SEED_OFFSET = 1000
DIGEST_METHODS = ("digest", "gather", "read", "copy")


def pass_dir(run_dir: Path, state: str) -> Path:
    return run_dir / DIR / state


def plan(s: Settings, router: str, prefill: str, out: Path, tokenizer: str) -> Plan:
    """One warm-up request, then ``checksum_requests`` single-request levels
    per prompt length, shortest first; the same prompts for either state."""
    chosen = single_requests.levels(s, router, prefill, out, s.seed + SEED_OFFSET,
                                    s.checksum_requests)  # fmt: skip
    return single_requests.plan(s, tokenizer, chosen)


def state_json(before: m.Snapshot, after: m.Snapshot) -> dict[str, float]:
    """Decode's checksum over a pass: the gauge as it stands, the counters'
    deltas (regions verified, regions that differed)."""
    delta = after - before
    return {
        "enabled": after.total(m.CHECKSUM_ENABLED),
        "matched_regions": delta.total(m.CHECKSUM_MATCH),
        "mismatched_regions": delta.total(m.CHECKSUM_MISMATCH),
    }


# -- reading a run directory ------------------------------------------------------
@dataclass(frozen=True)
class Side:
    """One state at one prompt length: per request, TTFT and transfer time."""

    ttft_ms: list[float]
    transfer_ms: list[float]

    def p50_ttft(self) -> float | None:
        return p50(self.ttft_ms)

    def p50_transfer(self) -> float | None:
        return p50(self.transfer_ms)


@dataclass(frozen=True)
class Result:
    sides: dict[str, dict[int, Side]]
    states: dict[str, dict[str, float]]
    digest: Mapping[str, Any] | None

    def lengths(self) -> list[int]:
        return sorted({n for by_len in self.sides.values() for n in by_len})

    def side(self, state: str, length: int) -> Side | None:
        return self.sides.get(state, {}).get(length)

    def ttft_cost(self, length: int) -> tuple[float, float] | None:
        """(ms, share of the off TTFT) the checksum adds at ``length``, p50s."""
        a, b = (s.p50_ttft() if (s := self.side(k, length)) else None for k in STATES)
        if a is None or b is None or b <= 0:
            return None
        return a - b, (a - b) / b

    def as_intended(self) -> str | None:
        """Why a pass was not what its name says, if it was not."""
        for state, want in (("on", 1.0), ("off", 0.0)):
            got = self.states.get(state, {}).get("enabled")
            if got is not None and (got > 0) != bool(want):
                return f"the '{state}' pass had decode's checksum gauge at {got:g}"
        return None


def read(run_dir: Path) -> Result | None:
    root = run_dir / DIR
    if not root.exists():
        return None
    sides = {
        state: {
            n: Side(
                [r.ttft_ms for r in got],
                [t for r in got if (t := r.transfer_ms()) is not None],
            )
            for n, got in single_requests.read(root / state).items()
        }
        for state in STATES
    }
    states = {
        s: d for s in STATES if (d := read_json(root / s / STATE_FILE)) is not None
    }
    return Result(sides, states, read_json(root / DIGEST_FILE))


def summary(result: Result | None) -> dict[str, Any] | None:
    if result is None:
        return None
    return {
        "levels": [
            {
                "input_len": n,
                **{
                    f"{key}_{state}": getattr(side, key)()
                    for state in STATES
                    if (side := result.side(state, n))
                    for key in ("p50_ttft", "p50_transfer")
                },
                "ttft_cost_ms_and_share": result.ttft_cost(n),
            }
            for n in result.lengths()
        ],
        "states": result.states,
        "digest": result.digest,
    }


# -- the report's section -----------------------------------------------------------
HEAD = ("prompt", "requests on / off", "TTFT p50 on / off ms",
        "checksum's cost, ms (% of TTFT off)", "transfer p50 on / off ms")  # fmt: skip


def markdown(result: Result) -> list[str]:
    out = ["## KV checksum: on / off", ""]

    def cells(n: int) -> list[str]:
        on, off = (result.side(state, n) or Side([], []) for state in STATES)
        cost = result.ttft_cost(n)
        return [
            str(n),
            f"{len(on.ttft_ms)} / {len(off.ttft_ms)}",
            f"{fmt(on.p50_ttft(), 0)} / {fmt(off.p50_ttft(), 0)}",
            "n/a" if cost is None else f"{cost[0]:+,.0f} ({fmt_pct(cost[1])})",
            f"{fmt(on.p50_transfer(), 1)} / {fmt(off.p50_transfer(), 1)}",
        ]

    if result.lengths():
        out += [
            "The same prompts through the P/D stack with the checksum on, then "
            f"restarted with `{ENV}=0`; one request at a time (concurrency 1), "
            f"{single_requests.OUTPUT_LEN} output tokens; p50 over the requests.",
            "",
            *table(HEAD, map(cells, result.lengths())),
        ]
    for state, data in result.states.items():
        restart = data.get("restart_s")
        out.append(
            f"- decode, pass '{state}': checksum gauge {data.get('enabled', 0):g}, "
            f"{data.get('matched_regions', 0):.0f} regions verified, "
            f"{data.get('mismatched_regions', 0):.0f} mismatched"
            + ("" if restart is None else f"; stack restarted in {restart:.0f} s")
        )
    if result.digest:
        out += ["", *digest_markdown(result.digest)]
    return out


def digest_markdown(data: Mapping[str, Any]) -> list[str]:
    rows: dict[int, dict[str, Mapping[str, Any]]] = {}
    for r in data.get("results", []):
        rows.setdefault(int(r["threads"]), {})[r["method"]] = r

    def cells(threads: int) -> list[str]:
        by = rows[threads]
        gbps = [fmt(by[k]["GBps"], 2) if k in by else "n/a" for k in DIGEST_METHODS]
        digest_s = by.get("digest", {}).get("seconds")
        read = by.get("read", {}).get("GBps")
        share = by["digest"]["GBps"] / read if read and "digest" in by else None
        return [str(threads), *gbps, fmt_pct(share),
                fmt(digest_s * 1e3 if digest_s else None, 1)]  # fmt: skip

    head = ["threads", "digest GB/s", "gather GB/s", "plain read (int64 sum) GB/s",
            "copy GB/s", "digest / read", "ms per request"]  # fmt: skip
    return [
        f"The digest alone (in-process): one {data.get('tokens')}-token request, "
        f"{human_bytes(float(data.get('bytes', 0)))} in {data.get('regions')} KV "
        f"regions of {data.get('cache_blocks')} blocks each, its blocks scattered; "
        f"median of {data.get('rounds')} rounds. Prefill and decode each digest a "
        "request once.",
        "",
        *table(head, map(cells, sorted(rows))),
    ]


# -- the digest micro-benchmark -------------------------------------------------------
def digest_benchmark(
    layout: kv_layout.KVLayout,
    cache_bytes: int,
    tokens: int = 4096,
    rounds: int = 7,
) -> dict[str, Any]:
    """GB/s of the plugin's digest over one request's blocks in real tensors
    of ``layout``'s regions, against a read, a copy and a gather of them."""
    import torch

    from pd_mooncake import checksum  # imports vLLM's Mooncake connector

    blocks = layout.blocks(tokens)
    cache_blocks = max(blocks, cache_bytes // layout.bytes_per_block())
    gen = torch.Generator().manual_seed(0)
    regions = []
    for region in layout.regions:
        words = region.bytes_per_token * layout.block_size // 4
        for _ in range(region.layers):
            pages = torch.randint(-(2**31), 2**31 - 1, (cache_blocks, words),
                                  dtype=torch.int32, generator=gen)  # fmt: skip
            ids = torch.randperm(cache_blocks, generator=gen)[:blocks]
            regions.append((pages, ids))
    gathered = [pages.index_select(0, ids) for pages, ids in regions]
    wide = [g.view(torch.int64) if g.shape[1] % 2 == 0 else g for g in gathered]
    methods: dict[str, Callable[[], Any]] = {
        "digest": lambda: [checksum.digest(p, i) for p, i in regions],
        "gather": lambda: [p.index_select(0, i) for p, i in regions],
        "read": lambda: [g.sum(dtype=torch.int64) for g in wide],
        "copy": lambda: [g.clone() for g in gathered],
    }
    nbytes = sum(g.numel() * g.element_size() for g in gathered)
    default = torch.get_num_threads()
    results, digests = [], set()
    try:
        for threads in sorted({1, default}):
            torch.set_num_threads(threads)
            digests.add(tuple(int(d) for d in methods["digest"]()))
            for name in DIGEST_METHODS:
                methods[name]()  # warm: the digest's weight tables, the allocator
                runs = timeit.repeat(methods[name], number=1, repeat=rounds)
                took = statistics.median(runs)
                gbps = nbytes / took / 1e9
                results.append(
                    {"threads": threads, "method": name, "seconds": took, "GBps": gbps}
                )
    finally:
        torch.set_num_threads(default)
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "regions": len(regions),
        "cache_blocks": cache_blocks,
        "rounds": rounds,
        "default_threads": default,
        "same_digest_on_every_thread_count": len(digests) == 1,
        "results": results,
    }


def digest_seconds(result: Result | None, threads: int = 1) -> float | None:
    for r in (result.digest or {}).get("results", []) if result else []:
        if r["method"] == "digest" and int(r["threads"]) == threads:
            return float(r["seconds"])
    return None


def digest_command(profile: str, layout_file: Path | None, out: Path | None) -> int:
    """``python -m bench checksum --digest-only``: print the table, keep the JSON;
    the layout a run's served one (kv_layout.json), else the twin's from its
    models; the cache as large as prefill's."""
    from bench import kv_transfer
    from pdstack import config, tiny_model

    flags = config.vllm_flags("prefill", profile, "cpu")
    layout = None
    if layout_file is not None and layout_file.exists():
        layout = kv_transfer.layout_from_json(read_json(layout_file))
    elif config.profile(profile).get("generate") == "tiny":
        models = tiny_model.ensure_models(progress=lambda _: None)
        target = kv_layout.read_config(models.target)
        dtype = str(target.get("torch_dtype") or target.get("dtype") or "float32")
        draft = kv_layout.read_config(models.draft)
        layout = kv_layout.layout(target, draft, dtype, int(flags["block-size"]))
    if layout is None:
        print(f"bench: no KV layout for profile {profile!r}: give --layout FILE")
        return 2
    cache = int(flags.get("kv-cache-memory-bytes") or 512 << 20)
    data = digest_benchmark(layout, cache)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1))
    print("\n".join(digest_markdown(data)), flush=True)
    return 0
