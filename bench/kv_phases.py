"""The phases of a staged KV send (pd_mooncake.staging), per request, from
both servers' ``pdstack.metrics.STAGING_SECONDS`` (label ``phase``): gather
and write on prefill (inside its transfer seconds), scatter on decode (after
them, inside TTFT); a direct send has none. docs/bench.md ("The KV path") says
what each is, where a request's are kept, and how the report shows them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdstack import metrics as m

PREFILL = ("gather", "write")
DECODE = ("scatter",)
PHASES = PREFILL + DECODE
# Decode's evidence that a request's KV is in: prompt tokens it loaded from
# prefill, or a failed receive.
LOADED = "decode_loaded_tokens"
FAILED = "decode_failed_recvs"


def key(phase: str) -> str:
    """A phase's key in a request's ``.kv.json``."""
    return f"{phase}_seconds"


def totals(delta: m.Snapshot, phases: Sequence[str]) -> dict[str, float]:
    """Seconds per phase in a delta of two scrapes (0 for a phase not there)."""
    by_phase = delta.by_label(m.STAGING_SECONDS, "phase")
    return {key(p): by_phase.get(p, 0.0) for p in phases}


def decode_json(delta: m.Snapshot) -> dict[str, float]:
    return totals(delta, DECODE) | {
        LOADED: delta.total(m.EXTERNAL_HITS),
        FAILED: delta.total(m.FAILED_RECVS),
    }


def settle_decode(
    url: str, before: m.Snapshot, completed: int, deadline_s: float
) -> dict[str, float]:
    """Decode's phase seconds over a request, settled like prefill's
    counters (kv_transfer.settle_delta): the KV in (tokens loaded or a failed
    receive) and the counters still."""
    if completed == 0:
        return decode_json(m.scrape(url) - before)
    return m.settle_counts(
        url, before, decode_json, lambda v: v[LOADED] + v[FAILED], deadline_s
    )


def staged(counters: Mapping[str, float]) -> bool | None:
    """Whether a request was sent staged: any phase took time; None when its
    counters have no phases (a run from before they were recorded)."""
    if not any(key(p) in counters for p in PHASES):
        return None
    return any(counters.get(key(p), 0.0) > 0 for p in PHASES)
