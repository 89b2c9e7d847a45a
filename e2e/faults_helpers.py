"""What the fault suite's modules (e2e/test_faults_*.py) share: its settings
(configs/faults.yaml), timed requests, the leak check and the results table.
The stack itself is faults_stack's fixture.

"Idle" is what every fault case must come back to: on prefill and decode no
request running or waiting and ``vllm:kv_cache_usage_perc`` at its value
before the case; on decode ``vllm:num_requests_kv_fetch_by_stage`` (all
stages) at 0. A block kept for a transfer that never comes shows as usage
above idle on prefill; a request stuck waiting for KV as a fetch stage above
0 on decode.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
import yaml

from conftest import E2E_RUN_DIR, TRACE, Stack, tagged
from pdstack import client, config, hosts, oracle, wait
from pdstack import metrics as m
from pdstack.client import greedy

FAULTS_CONFIG = config.CONFIGS / "faults.yaml"
RUN_DIR = E2E_RUN_DIR.parent / "faults"
progress = tagged("faults twin")
KV_FETCH = "vllm:num_requests_kv_fetch_by_stage"
WAITING = "vllm:num_requests_waiting"
GENERATED = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
# One row per case, in the order the cases ran: the table printed (and
# written to RUN_DIR/results.json) when the fault stack goes down.
RESULTS: list[dict[str, Any]] = []


def settings() -> dict[str, Any]:
    data = yaml.safe_load(FAULTS_CONFIG.read_text())
    assert isinstance(data, dict), f"{FAULTS_CONFIG}: not a mapping"
    return data


def stack_settings(cfg: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """configs/faults.yaml's bounds, and its environment per role and
    vllm-router flags as the launchers take them (twin.up, hosts.HostsTwin)."""
    role_env = {
        role: {k: str(v) for k, v in values.items()}
        for role, values in cfg["env"].items()
    }
    router_extra = config.render(cfg["router"], {})
    bounds = {k: float(v) for k, v in cfg["bounds"].items()}
    return bounds, {"role_env": role_env, "router_extra": router_extra}


@dataclass
class FaultStack(Stack):
    """A stack the fault suite may break: its ports' environment and bounds."""

    env: dict[str, str] = field(default_factory=dict)
    bootstrap: str = ""
    bounds: dict[str, float] = field(default_factory=dict)
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)
    idle: dict[str, float] = field(default_factory=dict)


def record(
    case: str, sent: int, failed: int, terminal_s: float, leaked: Any, detail: str = ""
) -> None:
    """One row of the table: requests sent, unexpected outcomes, slowest
    terminal answer, what was not back to idle; printed with ``detail``, what
    the case saw."""
    RESULTS.append(
        {
            "case": case,
            "sent": sent,
            "failed": failed,
            "terminal_s": round(terminal_s, 2),
            "leaks": leaked or 0,
        }
    )
    print(
        f"[faults] {case}: sent {sent}, unexpected {failed}, "
        f"slowest terminal answer {terminal_s:.2f}s, leaks {leaked or 0}"
    )
    if detail:
        print(detail)


def table() -> list[str]:
    """The cases' rows as a Markdown table (none if no case ran)."""
    if not RESULTS:
        return []
    lines = ["| case | sent | unexpected | slowest terminal (s) | leaks |"]
    lines.append("| --- | --- | --- | --- | --- |")
    return lines + [
        f"| {r['case']} | {r['sent']} | {r['failed']} | {r['terminal_s']} | "
        f"{r['leaks']} |"
        for r in RESULTS
    ]


def print_table() -> None:
    """Saved as RUN_DIR/results.json; conftest shows the table at the end."""
    if RESULTS:
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        (RUN_DIR / "results.json").write_text(json.dumps(RESULTS, indent=1))


@dataclass(frozen=True)
class Outcome:
    """A request's terminal answer (status None: no HTTP answer at all)."""

    status: int | None
    body: str
    seconds: float

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def token_ids(self) -> list[int] | None:
        try:
            return self.json()["choices"][0]["token_ids"]
        except (ValueError, KeyError, IndexError, TypeError):
            return None


def post(
    url: str,
    body: Mapping[str, Any] | str,
    *,
    timeout: float = 120.0,
    headers: Mapping[str, str] | None = None,
) -> Outcome:
    # A str body is sent as given, declared JSON (the router must parse it).
    sent = {"data": body} if isinstance(body, str) else {"json": body}
    start = time.monotonic()
    try:
        answer = requests.post(
            url + "/v1/completions",
            headers={
                "Content-Type": "application/json",
                **client.headers(),
                **(headers or {}),
            },
            timeout=timeout,
            **sent,
        )
    except requests.RequestException as exc:
        return Outcome(None, repr(exc), time.monotonic() - start)
    return Outcome(answer.status_code, answer.text, time.monotonic() - start)


def require_owned(stack: FaultStack, why: str) -> None:
    if not stack.owned:
        pytest.skip(f"{why}: needs a stack this suite started (the CPU twin)")


def post_all(
    url: str, bodies: list[dict[str, Any]], timeout: float, workers: int = 0
) -> list[Outcome]:
    """``bodies`` posted at once (``workers`` at a time if given), in order."""
    with ThreadPoolExecutor(max_workers=workers or len(bodies)) as pool:
        return list(pool.map(lambda b: post(url, b, timeout=timeout), bodies))


@dataclass(frozen=True)
class Expected:
    """A request's reference answer (prefill served it whole) and what an
    answer to it must be on this stack: its tokens where the stack is exact;
    elsewhere (bfloat16, a GPU's batch-variant kernels) the same tokens, or
    another one where the reference's own choice was a near-tie within the
    stack's calibrated band (pdstack.oracle.judge_tokens): a make e2e run on
    the bfloat16 twin had 5 of the 64 load answers leave the reference at a
    near-tie, each one healthy."""

    steps: tuple[oracle.Step, ...]
    band: oracle.Band

    @property
    def tokens(self) -> list[int]:
        return [s.token for s in self.steps]

    def fault(self, got: Outcome) -> str | None:
        """None where ``got`` is this answer; otherwise what it is."""
        if got.status != 200 or got.token_ids is None:
            return f"HTTP {got.status}: {got.body[:300]}"
        verdict = oracle.judge_tokens(self.steps, got.token_ids, self.band)
        if verdict.ok:
            return None
        return f"{got.token_ids} (reference {self.tokens}): {verdict.describe()}"

    def met_by(self, got: Outcome) -> bool:
        return self.fault(got) is None


def judging_band(stack: Stack) -> oracle.Band:
    """Exact tokens on an exact stack (no calibration needed); otherwise the
    band the oracle calibrates on the stack."""
    return oracle.Band(0.0, exact=True) if stack.epsilon == 0 else stack.band


def wrong_answers(outcomes: list[Outcome], expected: Sequence[Expected]) -> list[int]:
    """Which answers came back (200) other than the reference's."""
    return [
        i
        for i, (o, e) in enumerate(zip(outcomes, expected, strict=True))
        if o.status == 200 and not e.met_by(o)
    ]


def answered_wrong(
    stack: Stack, sent: Sequence[tuple[dict[str, Any], Outcome]]
) -> list[str]:
    """Every request of ``sent`` that was answered (200) during a fault,
    against its reference, asked once the stack serves again: a 200 is only
    a success if it is the reference's answer (a late write or KV from the
    wrong request answers 200 too). What differed, one line each."""
    answered = [(body, o) for body, o in sent if o.status == 200]
    if not answered:
        return []
    expected = references(stack, [body for body, _ in answered])
    return [
        f"prompt of {len(body['prompt'])} tokens: {e.fault(o)}"
        for (body, o), e in zip(answered, expected, strict=True)
        if not e.met_by(o)
    ]


def references(stack: Stack, bodies: list[dict[str, Any]]) -> list[Expected]:
    """Colocated answers (prefill served whole), a few at a time, with their
    candidates' log-probabilities."""
    answers = post_all(
        stack.reference, [{**b, **TRACE} for b in bodies], timeout=300, workers=8
    )
    bad = [a for a in answers if a.status != 200 or a.token_ids is None]
    assert not bad, f"reference failed: {bad[0]}"
    band = judging_band(stack)
    return [
        Expected(
            tuple(oracle.steps(a.token_ids or [], _top_logprobs(a))),
            band,
        )
        for a in answers
    ]


def _top_logprobs(answer: Outcome) -> list[dict[str, float]]:
    """Per generated token its candidates; a stop token the answer leaves
    out of its tokens may still have an entry after them."""
    tokens = answer.token_ids or []
    top = (answer.json()["choices"][0].get("logprobs") or {}).get("top_logprobs")
    return (top or [])[: len(tokens)]


def serves_exactly(stack: FaultStack, salt: int) -> None:
    """The stack still answers through the router with the reference's answer."""
    body = greedy(stack.prompt(33, salt=salt), 8)
    (expected,) = references(stack, [body])
    got = post(stack.router, body, timeout=stack.bounds["request"])
    assert expected.met_by(got), expected.fault(got)


# vLLM's own VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT: what a stack that does not
# set it uses.
DEFAULT_ABORT_TIMEOUT_S = 480.0


def abort_timeout(stack: FaultStack | hosts.HostsTwin) -> float:
    """Prefill's abort timeout: how long it holds KV for a decode that never
    pulls (vLLM's default where the stack's settings are not known here)."""
    prefill = stack.role_env.get("prefill", {})
    return float(
        prefill.get("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", DEFAULT_ABORT_TIMEOUT_S)
    )


def server_state(url: str, role: str, label: str) -> dict[str, float]:
    """One server's quantities that must return to idle, keyed ``label_...``."""
    snapshot = m.scrape(url)
    now = {
        f"{label}_kv_usage": snapshot.total(m.KV_USAGE),
        f"{label}_requests": snapshot.total(m.RUNNING) + snapshot.total(WAITING),
    }
    if role == "decode":
        now[f"{label}_kv_fetch"] = snapshot.total(KV_FETCH)
        # No fault here corrupts KV: a checksum mismatch under load, a kill
        # or a restart would be a false positive (or a real late write); it
        # counts as a leak (0 where the check is off).
        now[f"{label}_kv_checksum_mismatch"] = snapshot.total(m.CHECKSUM_MISMATCH)
    return now


def state(stack: Stack, roles: tuple[str, ...] = config.ROLES) -> dict[str, float]:
    """What must return to idle after every case (of ``roles``: a dead
    server has no /metrics)."""
    now: dict[str, float] = {}
    for role in roles:
        now |= server_state(getattr(stack, role), role, role)
    return now


# Counters, not gauges: what a stack given by URLs has counted before the
# fault cases (the negative controls' mismatches) is their baseline.
COUNTERS = ("kv_checksum_mismatch",)
BASELINED = ("kv_usage", *COUNTERS)


def idle_state(stack: Stack) -> dict[str, float]:
    """The reference idle state: captured on a quiet stack; requests and
    fetches in flight must be 0."""
    now = state(stack)
    busy = {k: v for k, v in now.items() if not k.endswith(BASELINED) and v}
    assert not busy, f"stack not quiet before the fault cases: {busy}"
    return now


def leaks(now: Mapping[str, float], idle: Mapping[str, float]) -> dict[str, float]:
    """Every quantity that is not back to its idle value; a counter only if it
    rose (a restarted server counts from 0 again)."""
    return {
        k: v
        for k, v in now.items()
        if (v > idle.get(k, 0.0) if k.endswith(COUNTERS) else abs(v - idle.get(k, 0.0)))
        > 1e-9
    }


def wait_idle(
    stack: FaultStack, deadline_s: float, roles: tuple[str, ...] = config.ROLES
) -> tuple[float, dict[str, float]]:
    """Poll until nothing of ``roles`` leaks or the deadline; returns
    (seconds, leaks)."""
    return wait.poll_last(
        lambda: leaks(state(stack, roles), stack.idle),
        lambda found: not found,
        deadline_s,
        f"{' and '.join(roles)} idle",
        interval_s=0.5,
    )


def counters(stack: Stack) -> dict[str, m.Snapshot]:
    return {"prefill": m.scrape(stack.prefill), "decode": m.scrape(stack.decode)}


def transferred(
    stack: Stack,
    before: Mapping[str, m.Snapshot],
    tokens: int,
    loaded: str = m.EXTERNAL_HITS,
    sent: tuple[str, float] = (m.TRANSFERS, 1),
) -> tuple[m.Snapshot, m.Snapshot]:
    """(decode, prefill) deltas since ``before`` once decode's ``loaded``
    counts ``tokens`` (by default: loaded from prefill) and prefill's counter
    reaches ``sent`` (a transfer). Prefill counts its send after decode has
    the KV: settle both."""
    d = m.settle(stack.decode, before["decode"], lambda d: d.total(loaded) >= tokens)
    p = m.settle(
        stack.prefill, before["prefill"], lambda p: p.total(sent[0]) >= sent[1]
    )
    return d, p


def engine_ids(bootstrap_url: str) -> list[str]:
    """The engine ids prefill's Mooncake bootstrap server hands out."""
    answer = requests.get(f"{bootstrap_url}/query", timeout=5)
    answer.raise_for_status()
    return sorted(entry["engine_id"] for entry in answer.json().values())


def prefill_at_work(url: str, before: m.Snapshot) -> bool:
    """Prefill holds requests, or has already computed prompts since ``before``.

    The running/waiting gauges move only at step boundaries: with a step
    budget of 8192 tokens the twin prefills most of the 12 prompts in one
    step, and a poll can miss the gauges entirely (seen in CI). The prompt
    token counter cannot be missed; the requests are still in flight then
    (transfers, decode).
    """
    snapshot = m.scrape(url)
    busy = snapshot.total(m.RUNNING) + snapshot.total(WAITING)
    return busy >= 1 or (snapshot - before).total(PROMPT_TOKENS) > 0
