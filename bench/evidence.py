"""Evidence that a P/D level's KV crossed, read as the e2e suite reads it
(e2e/test_transfer_evidence.py, e2e/test_negative_controls.py): decode's
prompt tokens by source and checksum verdicts, prefill's failed and retried
transfers, as deltas of pdstack.metrics scrapes around the level, summed
over every decode and prefill behind the router (bench.topology).

A level whose evidence fails is reported as failed, not as a fast result
(a decode that recomputes the prompt is fast and proves nothing). A stack
without the plugin's metrics has evidence "not measurable"; the rest runs.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdstack import kv_layout
from pdstack import metrics as m

VERIFIED, FAILED, UNMEASURABLE = "verified", "failed", "not measurable"


def capture(
    decodes: Mapping[str, tuple[m.Snapshot, m.Snapshot]],
    prefills: Mapping[str, m.Snapshot],
) -> dict[str, Any]:
    """A level's evidence as JSON, summed over every server behind the
    router (the router spreads a level's requests over them): ``decodes``
    maps each decode's URL to (its delta over the level, its last scrape:
    which regions exist, whether the checksum is on, whether the plugin is
    loaded at all), ``prefills`` each prefill's URL to its delta."""
    decode = functools.reduce(operator.add, (d for d, _ in decodes.values()))
    prefill = functools.reduce(operator.add, prefills.values())
    afters = [after for _, after in decodes.values()]
    sources = decode.by_label(m.PROMPT_TOKENS_BY_SOURCE, "source")
    regions = sorted(
        {r for a in afters for r in a.by_label(m.CHECKSUM_MATCH, "region")}
        | {r for a in afters for r in a.by_label(m.CHECKSUM_MISMATCH, "region")}
    )
    matched = decode.by_label(m.CHECKSUM_MATCH, "region")
    return {
        # Every decode must run the plugin for the sum to be evidence.
        "plugin": all(
            any(name == m.KV_CACHE_INFO for name, _ in a.samples) for a in afters
        ),
        "external_kv_transfer": sources.get("external_kv_transfer", 0.0),
        "local_compute": sources.get("local_compute", 0.0),
        # On in any decode: then every request must be verified, wherever
        # it landed (a decode with it off leaves its requests unverified).
        "checksum_on": any(a.total(m.CHECKSUM_ENABLED) == 1 for a in afters),
        "checksum_matched": {r: matched.get(r, 0.0) for r in regions},
        "checksum_mismatched": decode.total(m.CHECKSUM_MISMATCH),
        "failed_recvs": decode.total(m.FAILED_RECVS),
        "failed_transfers": prefill.total(m.FAILED_TRANSFERS),
        "retried_transfers": prefill.total(m.RETRIED_TRANSFERS),
        # The transfer's cost, for the share of TTFT (not evidence).
        "transfers": prefill.total(m.TRANSFERS),
        "transfer_seconds": prefill.total(m.TRANSFER_SECONDS),
        # Where the requests landed: prompt tokens loaded per decode and
        # transfers per prefill (which servers took part).
        "per_decode": {
            url: d.by_label(m.PROMPT_TOKENS_BY_SOURCE, "source").get(
                "external_kv_transfer", 0.0
            )
            for url, (d, _) in decodes.items()
        },
        "per_prefill": {url: d.total(m.TRANSFERS) for url, d in prefills.items()},
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
        f"prefill, 0 computed{_spread(evidence)}; {checked}{retried}",
    )


def _spread(evidence: Mapping[str, Any]) -> str:
    """Where several decodes or prefills served the level: each one's share
    (tokens loaded per decode, transfers per prefill)."""
    decodes = evidence.get("per_decode") or {}
    prefills = evidence.get("per_prefill") or {}
    if len(decodes) < 2 and len(prefills) < 2:
        return ""
    loaded = " + ".join(f"{v:.0f}" for v in decodes.values())
    sent = " + ".join(f"{v:.0f}" for v in prefills.values())
    return (
        f" (tokens loaded per decode: {loaded} over {len(decodes)} decodes; "
        f"transfers per prefill: {sent} over {len(prefills)} prefills)"
    )
