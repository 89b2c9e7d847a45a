"""Fault suite, a server dies: decode, then prefill, killed with requests in
flight (SIGKILL, as a crash or the OOM killer does) and restarted on the same
ports, as compose's `restart:` or Kubernetes would. Last in the suite: it
restarts the fault stack's servers.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from unittest import mock

import faults_helpers as fh
from conftest import decode_fault_file
from pd_mooncake.faults import CORRUPT_CHECKED_KV
from pdstack import metrics as m
from pdstack import twin, wait
from pdstack.client import greedy

pytest_plugins = ["faults_stack"]


def _first_success(
    stack: fh.FaultStack, body: dict[str, Any], deadline_s: float
) -> tuple[fh.Outcome, float, list[int | None]]:
    """The same request again and again until a 200 or the deadline."""
    seen: list[int | None] = []

    def attempt() -> fh.Outcome:
        got = fh.post(stack.router, body, timeout=stack.bounds["request"])
        seen.append(got.status)
        return got

    took, got = wait.poll_last(
        attempt, lambda o: o.status == 200, deadline_s, "a 200", interval_s=1
    )
    return got, took, seen


def _restart(stack: fh.FaultStack, role: str) -> tuple[float, dict[str, int]]:
    """Start ``role`` again (as compose's `restart:` or Kubernetes would)."""
    with mock.patch.dict(os.environ, stack.env):
        took = twin.start_role(
            role, fh.RUN_DIR, env=stack.role_env[role], progress=fh.progress
        )
        return took, twin.running(fh.RUN_DIR)


def _kill_in_flight(
    stack: fh.FaultStack,
    bodies: list,
    role: str,
    busy: Callable[[m.Snapshot], bool],
    what: str,
    late: Sequence[dict[str, Any]] = (),
) -> tuple[list[tuple[fh.Outcome, float]], float, m.Snapshot]:
    """Send ``bodies`` through the router, SIGKILL ``role`` once ``busy`` (at
    most 120 s), then send ``late``: each result (outcome, time it ended), the
    time of the kill and prefill's counters from before the requests (what
    both cases measure prefill against; ``busy`` is given them)."""
    before = m.scrape(stack.prefill)

    def one(body: dict[str, Any]) -> tuple[fh.Outcome, float]:
        return fh.post(stack.router, body, timeout=300), time.monotonic()

    with ThreadPoolExecutor(max_workers=len(bodies) + len(late)) as pool:
        futures = [pool.submit(one, body) for body in bodies]
        wait.poll(lambda: busy(before), bool, 120, what, interval_s=0.2)
        twin.kill(role, fh.RUN_DIR, progress=fh.progress)
        killed_at = time.monotonic()
        futures += [pool.submit(one, body) for body in late]
        return [f.result() for f in futures], killed_at, before


def test_negative_control_wrong_answers_are_caught(faults: fh.FaultStack) -> None:
    """The comparison the kill cases make of every 200 with the reference
    catches a wrong answer: with decode's KV corrupted after its checksum
    (a late write's effect: the bytes checked, then others in the blocks),
    every answer is a 200 and every one is named."""
    fault_file = decode_fault_file(faults)
    bodies = [greedy(faults.prompt(30 + 11 * i, salt=4050 + i), 8) for i in range(3)]
    # On a stack that is not exact the band is calibrated now, while KV is right.
    fh.judging_band(faults)
    fault_file.write_text(CORRUPT_CHECKED_KV)
    try:
        outcomes = [fh.post(faults.router, body) for body in bodies]
    finally:
        fault_file.unlink(missing_ok=True)
    wrong = fh.answered_wrong(faults, list(zip(bodies, outcomes, strict=True)))
    print(f"with {CORRUPT_CHECKED_KV}: {[o.status for o in outcomes]}; {wrong}")
    assert [o.status for o in outcomes] == [200] * 3
    assert len(wrong) == 3, wrong
    fh.serves_exactly(faults, salt=4060)


def test_decode_killed_with_requests_in_flight(faults: fh.FaultStack) -> None:
    fh.require_owned(faults, "kills and restarts decode")
    pids = twin.running(fh.RUN_DIR)
    bodies = [greedy(faults.prompt(30 + 7 * i, salt=4000 + i), 300) for i in range(8)]
    late = [greedy(faults.prompt(45 + 5 * i, salt=4100 + i), 8) for i in range(4)]
    # The late ones before the router notices: the prefill leg runs, the
    # decode leg cannot.
    results, killed_at, before = _kill_in_flight(
        faults,
        bodies,
        "decode",
        lambda _: fh.state(faults, ("decode",))["decode_requests"] >= 4,
        "4 requests on decode",
        late,
    )
    held = m.scrape(faults.prefill).total(m.KV_USAGE)
    terminal = max(end - killed_at for _, end in results)
    outcomes = [o for o, _ in results]
    statuses = [o.status for o in outcomes]
    # Decode comes back (a supervisor's restart) while prefill's abort timeout
    # runs down; prefill and router stay the same processes.
    with ThreadPoolExecutor(max_workers=1) as supervisor:
        restart = supervisor.submit(_restart, faults, "decode")
        # Decode may be dead: prefill's part of idle only.
        freed_in, found = fh.wait_idle(
            faults, fh.abort_timeout(faults) + faults.bounds["idle"], ("prefill",)
        )
        restart_s, after = restart.result()
    expired = (m.scrape(faults.prefill) - before).total(m.EXPIRED)
    print(
        f"decode killed: statuses {statuses}, last terminal answer "
        f"{terminal:.1f}s after the kill; prefill usage {held:.4f} then idle "
        f"after {freed_in:.1f}s more ({expired:.0f} expired sends)"
    )
    assert all(s is not None for s in statuses), "a client got no HTTP answer"
    # Every one is an error: 8 whose decode died under them, 4 that no decode
    # could serve (the README's "12 errors"); none a success, none a 4xx.
    assert [s for s in statuses if s < 500] == [], statuses
    assert len(statuses) == 12
    assert terminal < faults.bounds["error_after_kill"]
    # The case did strand blocks on prefill (prefill legs whose decode leg
    # failed), and prefill freed them: by its abort timeout.
    assert held > faults.idle["prefill_kv_usage"] and expired >= 1
    assert found == {}, f"prefill kept blocks: {found}"
    body = greedy(faults.prompt(33, salt=4200), 8)
    (expected,) = fh.references(faults, [body])
    got, recovered_s, seen = _first_success(faults, body, faults.bounds["recovery"])
    wrong = fh.answered_wrong(faults, list(zip(bodies + late, outcomes, strict=True)))
    _, found_after = fh.wait_idle(faults, faults.bounds["idle"])
    fh.record(
        "decode killed with 8 in flight (+4 while dead)",
        len(results),
        sum(s is None or s < 500 for s in statuses) + len(wrong),
        terminal,
        found or found_after,
        f"decode restarted in {restart_s:.0f}s; first success {recovered_s:.1f}s "
        f"after, statuses on the way {seen}",
    )
    others = ("prefill", "router")
    assert {k: after[k] for k in others} == {k: pids[k] for k in others}
    assert expected.met_by(got), expected.fault(got)
    assert wrong == [], wrong
    assert found_after == {}


def test_prefill_killed_with_requests_in_flight(faults: fh.FaultStack) -> None:
    fh.require_owned(faults, "kills and restarts prefill")
    pids = twin.running(fh.RUN_DIR)
    ids_before = fh.engine_ids(faults.bootstrap)
    # Long prompts: prefill is busy for seconds, some transfers are under way.
    bodies = [greedy(faults.prompt(600 + 40 * i, salt=4300 + i), 16) for i in range(12)]
    results, killed_at, _ = _kill_in_flight(
        faults,
        bodies,
        "prefill",
        lambda started: fh.prefill_at_work(faults.prefill, started),
        "prefill at work on the prompts",
    )
    dead_body = greedy(faults.prompt(20, salt=4399), 4)
    while_dead = fh.post(faults.router, dead_body)
    outcomes = [o for o, _ in results] + [while_dead]
    statuses = [o.status for o, _ in results]
    after_kill = sorted(round(end - killed_at, 1) for _, end in results)
    # Decode must not keep waiting for KV from the dead prefill.
    d_waited, d_found = fh.wait_idle(
        faults, faults.bounds["error_after_kill"], ("decode",)
    )
    assert d_found == {}, f"decode not idle {d_waited:.0f}s after the kill: {d_found}"
    print(
        f"prefill killed: statuses {statuses}, terminal answers {after_kill}s "
        f"after the kill; while dead HTTP {while_dead.status} in "
        f"{while_dead.seconds:.2f}s; decode idle after {d_waited:.1f}s"
    )
    assert all(s is not None for s in statuses), "a client got no HTTP answer"
    assert max(after_kill) < faults.bounds["error_after_kill"]
    assert while_dead.status is not None and while_dead.status >= 500
    assert while_dead.seconds < 10
    restart_s, after = _restart(faults, "prefill")
    ids_after = fh.engine_ids(faults.bootstrap)
    body = greedy(faults.prompt(33, salt=4400), 8)
    (expected,) = fh.references(faults, [body])
    before = fh.counters(faults)
    got, recovered_s, seen = _first_success(faults, body, faults.bounds["recovery"])
    d, p = fh.transferred(faults, before, len(body["prompt"]))
    # Requests answered around the kill: each exactly the reference's.
    wrong = fh.answered_wrong(
        faults, list(zip([*bodies, dead_body], outcomes, strict=True))
    )
    _, found = fh.wait_idle(faults, faults.bounds["idle"])
    fh.record(
        "prefill killed with 12 in flight (+1 while dead)",
        len(results) + 1,
        sum(s is None for s in statuses) + len(wrong),
        max(max(after_kill), while_dead.seconds),
        found,
        f"prefill restarted in {restart_s:.0f}s, engine ids {ids_before} -> "
        f"{ids_after}; first success {recovered_s:.1f}s after, statuses on the "
        f"way {seen}; transfers {p.total(m.TRANSFERS):.0f}, decode loaded "
        f"{d.total(m.EXTERNAL_HITS):.0f} tokens",
    )
    assert ids_after == ids_before, "the restarted prefill has a new engine id"
    others = ("decode", "router")
    assert {k: after[k] for k in others} == {k: pids[k] for k in others}
    assert expected.met_by(got), expected.fault(got)
    # A real transfer, not decode recomputing the prompt.
    assert p.total(m.TRANSFERS) >= 1
    assert d.total(m.EXTERNAL_HITS) == len(body["prompt"])
    assert wrong == [], wrong
    assert found == {}


def test_prefill_frozen_with_requests_waiting(faults: fh.FaultStack) -> None:
    """A hung prefill: its whole process group stopped (SIGSTOP, what `docker
    pause` does to a container). Its kernel still completes TCP handshakes, so
    nothing refuses; every request sent before or during the freeze must still
    get a terminal answer within bounds.terminal of being sent."""
    fh.require_owned(faults, "freezes prefill")
    pids = twin.running(fh.RUN_DIR)
    group = twin.processes(fh.RUN_DIR).records()["prefill"].pgid
    bodies = [greedy(faults.prompt(40 + 9 * i, salt=4500 + i), 16) for i in range(3)]
    timeout = faults.bounds["terminal"] + 60
    with ThreadPoolExecutor(max_workers=8) as pool:
        sent = [pool.submit(fh.post, faults.router, b, timeout=timeout) for b in bodies]
        os.killpg(group, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            for offset, salt in ((2, 4510), (20, 4520)):
                time.sleep(max(0.0, frozen_at + offset - time.monotonic()))
                bodies.append(greedy(faults.prompt(25, salt=salt), 8))
                sent.append(
                    pool.submit(fh.post, faults.router, bodies[-1], timeout=timeout)
                )
            outcomes = [future.result() for future in sent]
        finally:
            os.killpg(group, signal.SIGCONT)
    frozen_s = time.monotonic() - frozen_at
    statuses = [o.status for o in outcomes]
    slowest = max(o.seconds for o in outcomes)
    body = greedy(faults.prompt(33, salt=4600), 8)
    (expected,) = fh.references(faults, [body])
    got, recovered_s, seen = _first_success(faults, body, faults.bounds["recovery"])
    wrong = fh.answered_wrong(faults, list(zip(bodies, outcomes, strict=True)))
    _, found = fh.wait_idle(faults, fh.abort_timeout(faults) + faults.bounds["idle"])
    fh.record(
        f"prefill frozen (SIGSTOP) {frozen_s:.0f}s, 3 in flight (+2)",
        len(outcomes),
        sum(
            o.status is None or o.seconds >= faults.bounds["terminal"] for o in outcomes
        )
        + len(wrong),
        slowest,
        found,
        f"statuses {statuses}; serving exactly {recovered_s:.1f}s after SIGCONT "
        f"(on the way {seen})",
    )
    assert all(s is not None for s in statuses), "a client got no HTTP answer"
    assert slowest < faults.bounds["terminal"], [o.seconds for o in outcomes]
    assert twin.running(fh.RUN_DIR) == pids, "a server was restarted"
    assert expected.met_by(got), expected.fault(got)
    assert wrong == [], wrong
    assert found == {}, f"not back to idle: {found}"
