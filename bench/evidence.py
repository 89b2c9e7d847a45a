"""Evidence that a P/D level's KV crossed, read as the e2e suite reads it
(e2e/test_transfer_evidence.py, e2e/test_negative_controls.py): decode's
prompt tokens by source and checksum verdicts, prefill's failed and retried
transfers, as deltas of pdstack.metrics scrapes around the level.

A level whose evidence fails is reported as failed, not as a fast result
(a decode that recomputes the prompt is fast and proves nothing). A stack
without the plugin's metrics has evidence "not measurable"; the rest runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdstack import kv_layout
from pdstack import metrics as m

VERIFIED, FAILED, UNMEASURABLE = "verified", "failed", "not measurable"


def capture(
    decode: m.Snapshot, prefill: m.Snapshot, after: m.Snapshot
) -> dict[str, Any]:
    """A level's evidence as JSON: ``decode`` and ``prefill`` are deltas over
    the level, ``after`` decode's last scrape (which regions exist, whether
    the checksum is on, whether the plugin is loaded at all)."""
    sources = decode.by_label(m.PROMPT_TOKENS_BY_SOURCE, "source")
    regions = sorted(
        set(after.by_label(m.CHECKSUM_MATCH, "region"))
        | set(after.by_label(m.CHECKSUM_MISMATCH, "region"))
    )
    matched = decode.by_label(m.CHECKSUM_MATCH, "region")
    return {
        "plugin": any(name == m.KV_CACHE_INFO for name, _ in after.samples),
        "external_kv_transfer": sources.get("external_kv_transfer", 0.0),
        "local_compute": sources.get("local_compute", 0.0),
        "checksum_on": after.total(m.CHECKSUM_ENABLED) == 1,
        "checksum_matched": {r: matched.get(r, 0.0) for r in regions},
        "checksum_mismatched": decode.total(m.CHECKSUM_MISMATCH),
        "failed_recvs": decode.total(m.FAILED_RECVS),
        "failed_transfers": prefill.total(m.FAILED_TRANSFERS),
        "retried_transfers": prefill.total(m.RETRIED_TRANSFERS),
        # The transfer's cost, for the share of TTFT (not evidence).
        "transfers": prefill.total(m.TRANSFERS),
        "transfer_seconds": prefill.total(m.TRANSFER_SECONDS),
    }


@dataclass(frozen=True)
class Verdict:
    status: str  # VERIFIED, FAILED or UNMEASURABLE
    detail: str

    @property
    def failed(self) -> bool:
        return self.status == FAILED


def judge(evidence: Mapping[str, Any] | None, input_lens: Sequence[int]) -> Verdict:
    """Every completed request's prompt loaded from prefill (none computed on
    decode), every region verified once per request, nothing failed."""
    if not evidence or not evidence.get("plugin"):
        why = (evidence or {}).get(
            "error"
        ) or "the plugin's metrics are absent on decode"
        return Verdict(UNMEASURABLE, why)
    requests, tokens = len(input_lens), sum(map(kv_layout.tokens_loaded, input_lens))
    local = sum(input_lens) - tokens
    problems = []
    if (got := evidence["external_kv_transfer"]) != tokens:
        problems.append(
            f"decode loaded {got:.0f} prompt tokens from prefill, "
            f"the {requests} requests sent {tokens}"
        )
    if (got := evidence["local_compute"]) != local:
        problems.append(
            f"decode computed {got:.0f} prompt tokens itself ({local} expected)"
        )
    if evidence["checksum_mismatched"]:
        problems.append(
            f"{evidence['checksum_mismatched']:.0f} region checksums differed"
        )
    matched = evidence["checksum_matched"]
    if evidence["checksum_on"]:
        if short := {r: n for r, n in matched.items() if n != requests}:
            problems.append(
                f"checksum verified {short} (expected {requests} per region)"
            )
        if not matched:
            problems.append("checksum on but no region verified")
    for key in ("failed_recvs", "failed_transfers"):
        if evidence[key]:
            problems.append(f"{evidence[key]:.0f} {key.replace('_', ' ')}")
    if problems:
        return Verdict(FAILED, "; ".join(problems))
    checked = (
        f"checksum matched in all {len(matched)} regions"
        if evidence["checksum_on"]
        else "checksum off on this stack"
    )
    retried = f", {evidence['retried_transfers']:.0f} sends retried" * bool(
        evidence["retried_transfers"]
    )
    return Verdict(
        VERIFIED,
        f"{requests} requests, {tokens} tokens loaded from "
        f"prefill, 0 computed; {checked}{retried}",
    )
