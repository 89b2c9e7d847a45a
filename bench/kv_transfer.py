"""The KV transfer cost of a P/D level, from the plugin's metrics on prefill;
docs/bench.md ("KV transfer per request") says what is reported and why (one
transfer may carry several requests' KV, so a request waits for a whole one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench import kv_phases, topology
from pdstack import config, kv_layout, tiny_model
from pdstack import metrics as m

COUNTERS = {
    "transfers": m.TRANSFERS,
    "bytes": m.BYTES,
    "seconds": m.TRANSFER_SECONDS,
    "descriptors": m.DESCRIPTORS,
    "failed_transfers": m.FAILED_TRANSFERS,
    "retried_transfers": m.RETRIED_TRANSFERS,
    "failed_recvs": m.FAILED_RECVS,
    "expired": m.EXPIRED,
    "prompt_tokens": "vllm:prompt_tokens_total",
}


def served_layout(prefill_url: str, profile: str) -> dict[str, Any] | None:
    """The measured stack's KV layout, as JSON for the report: its block size
    and KV type from prefill's /metrics, the shapes from the tiny pair's
    configs (without generating it). None for a profile whose model configs
    are not on this host."""
    if config.profile(profile).get("generate") != "tiny":
        return None
    snapshot = m.scrape(prefill_url)
    layout = kv_layout.served(
        snapshot.labels_of(m.CACHE_CONFIG_INFO),
        snapshot.labels_of(m.KV_CACHE_INFO),
        *tiny_model.layout_configs(),
    )
    return asdict(layout)


def layout_from_json(data: Mapping[str, Any] | None) -> kv_layout.KVLayout | None:
    if not data:
        return None
    regions = tuple(kv_layout.Region(**r) for r in data["regions"])
    return kv_layout.KVLayout(int(data["block_size"]), regions, str(data["kv_dtype"]))


def scrape(url: str) -> m.Snapshot:
    """``url``: one prefill, or several behind one router, comma-separated
    (their counters summed: a level's requests spread over them)."""
    return m.scrape_sum(topology.split(url))


def delta_json(delta: m.Snapshot) -> dict[str, float]:
    """The counters, and the staged sends' prefill phases (bench.kv_phases)."""
    counters = {key: delta.total(name) for key, name in COUNTERS.items()}
    return counters | kv_phases.totals(delta, kv_phases.PREFILL)


def settle_delta(
    url: str, before: m.Snapshot, completed: int, deadline_s: float
) -> dict[str, float]:
    """Prefill's counters over a request once they stop moving (bounded):
    requests may share transfers, so the number to wait for is not known.
    Nothing to wait for when no request completed."""
    if completed == 0:
        return delta_json(scrape(url) - before)

    def ended(v: dict[str, float]) -> float:
        return v["transfers"] + v["failed_transfers"]

    return m.settle_counts(topology.split(url), before, delta_json, ended, deadline_s)


@dataclass(frozen=True)
class LayoutCheck:
    ok: bool
    expected_bytes: int
    detail: str


def check_layout(
    input_lens: Sequence[int],
    counters: Mapping[str, float],
    layout: kv_layout.KVLayout | None,
) -> LayoutCheck | None:
    """Bytes moved against whole blocks of every request's prompt (a mismatch
    names its likely cause); None where the layout is not known (served_layout)."""
    if layout is None:
        return None
    expected = sum(
        layout.transfer_bytes(kv_layout.tokens_loaded(n)) for n in input_lens
    )
    measured = int(counters.get("bytes", 0))
    transfers = int(counters.get("transfers", 0))
    per_block = layout.bytes_per_block()
    problems = []
    # Several requests may share a transfer; none may need two.
    if not 1 <= transfers <= len(input_lens):
        problems.append(f"{transfers} transfers for {len(input_lens)} requests")
    prompt_tokens = int(counters.get("prompt_tokens", -1))
    if prompt_tokens >= 0 and prompt_tokens != sum(input_lens):
        problems.append(
            f"prefill counted {prompt_tokens} prompt tokens, requests report "
            f"{sum(input_lens)}"
        )
    if measured != expected:
        problems.append(
            f"{measured} bytes moved, layout predicts {expected} "
            f"({(measured - expected) / per_block:+.2f} blocks of {per_block} B)"
        )
    failed, recvs = (counters.get(k, 0) for k in ("failed_transfers", "failed_recvs"))
    if failed or recvs:
        problems.append(f"{failed:.0f} failed transfers, {recvs:.0f} failed receives")
    detail = "; ".join(problems) or (
        f"{len(input_lens)} requests in {transfers} transfers, {measured} bytes "
        f"= whole {layout.block_size}-token blocks x {per_block} B"
    )
    return LayoutCheck(not problems, expected, detail)


@dataclass(frozen=True)
class TransferCost:
    requests: int
    transfers: int
    bytes_per_request: float
    # What a request waits for its KV: the mean duration of a transfer.
    seconds_per_transfer: float
    share_of_ttft: float | None
    mb_per_s: float
    descriptors_per_transfer: float


def cost(
    counters: Mapping[str, float], requests: int, mean_ttft_ms: float | None
) -> TransferCost | None:
    transfers = int(counters.get("transfers", 0))
    if transfers <= 0 or requests <= 0:
        return None
    total_s = counters.get("seconds", 0.0)
    seconds = total_s / transfers
    return TransferCost(
        requests=requests,
        transfers=transfers,
        bytes_per_request=counters.get("bytes", 0.0) / requests,
        seconds_per_transfer=seconds,
        share_of_ttft=(seconds * 1e3 / mean_ttft_ms) if mean_ttft_ms else None,
        mb_per_s=counters.get("bytes", 0.0) / total_s / 1e6 if total_s else 0.0,
        descriptors_per_transfer=counters.get("descriptors", 0.0) / transfers,
    )


def from_result(result: Mapping[str, Any]) -> list[int]:
    """Per-request prompt lengths of a saved ``vllm bench serve --save-detailed``
    result (server-reported where the stream carried usage), successes only."""
    lens = result.get("input_lens") or []
    errors = result.get("errors") or [""] * len(lens)
    return [int(n) for n, err in zip(lens, errors, strict=False) if not err]
