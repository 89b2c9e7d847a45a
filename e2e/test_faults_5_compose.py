"""Fault suite, the compose stack broken the way an operator or the host
breaks it: ``docker kill``, a crash, ``docker compose up --force-recreate``,
``docker pause`` and ``docker network disconnect``. Runs only against a
compose stack named by ``--compose`` (``make e2e E2E_COMPOSE_FAULTS=1``;
``make test-compose`` on a CPU host); last in the suite.

Each case: every client request sent before or during the fault gets a
terminal answer (an error is fine) within ``bounds.terminal`` of being sent;
then the stack serves exactly as the reference again, with no server
restarted by hand but the one the case broke; then prefill and decode are
back to idle (prefill's blocks for requests whose decode died are freed by
its abort timeout, read from the stack).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from compose_stack import Compose, docker, pause

import faults_helpers as fh
from pdstack import metrics as m
from pdstack import wait
from pdstack.client import greedy

pytest_plugins = ["faults_stack"]

SERVICES = ("prefill", "decode", "router")
# docker pause: long enough for the router's health checks and decode's
# liveness probe to give up on prefill (seconds).
PAUSE_S = 90
PARTITION_S = 10


@pytest.fixture(scope="module")
def compose(request: pytest.FixtureRequest) -> Compose:
    text = request.config.getoption("compose")
    if not text:
        pytest.skip(
            "needs --compose (make e2e E2E_COMPOSE_FAULTS=1): the compose stack"
        )
    return Compose.parse(text)


@dataclass
class Flight:
    """Requests through the router, each timed from its own send."""

    stack: fh.FaultStack
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(16))
    sent: list[tuple[dict[str, Any], Future]] = field(default_factory=list)

    def send(self, body: dict[str, Any]) -> None:
        # The client's own bound: far above the one asserted, so a request
        # that hangs shows as one (no HTTP answer), not as a stuck test.
        timeout = self.stack.bounds["terminal"] + 60
        future = self.pool.submit(fh.post, self.stack.router, body, timeout=timeout)
        self.sent.append((body, future))

    def results(self) -> list[tuple[dict[str, Any], fh.Outcome]]:
        """(request, its terminal answer) per request sent."""
        done = [(body, future.result()) for body, future in self.sent]
        self.pool.shutdown()
        return done


def bodies(stack: fh.FaultStack, count: int, salt: int, tokens: int) -> list[dict]:
    return [
        greedy(stack.prompt(30 + 9 * i, salt=salt + i), tokens) for i in range(count)
    ]


def recovered(stack: fh.FaultStack, salt: int) -> tuple[float, list[int | None]]:
    """Seconds until a request through the router equals the reference
    again, and the statuses seen on the way."""
    body = greedy(stack.prompt(33, salt=salt), 8)
    (expected,) = fh.references(stack, [body])
    seen: list[int | None] = []

    def attempt() -> bool:
        got = fh.post(stack.router, body, timeout=stack.bounds["request"])
        seen.append(got.status)
        return expected.met_by(got)

    took, _ = wait.poll_last(
        attempt, bool, stack.bounds["restart"], "served exactly again", interval_s=2
    )
    return took, seen


def containers(compose: Compose) -> dict[str, str]:
    return {s: compose.container(s) for s in SERVICES}


def settle(
    stack: fh.FaultStack, compose: Compose, case: str, flight: Flight, salt: int
) -> dict[str, Any]:
    """The checks every case ends with; records the row and returns figures."""
    results = flight.results()
    statuses = [o.status for _, o in results]
    slowest = max(o.seconds for _, o in results)
    back_s, seen = recovered(stack, salt)
    # Requests answered during the fault: each exactly the reference's.
    wrong = fh.answered_wrong(stack, results)
    abort_s = compose.abort_timeout_s() or fh.DEFAULT_ABORT_TIMEOUT_S
    bound = abort_s + stack.bounds["idle"]
    idle_s, found = fh.wait_idle(stack, bound)
    fh.record(
        case,
        len(results),
        sum(
            o.status is None or o.seconds >= stack.bounds["terminal"]
            for _, o in results
        )
        + len(wrong),
        slowest,
        found,
        f"statuses {statuses}; serving exactly again {back_s:.1f}s after the "
        f"heal (on the way {seen}); idle {idle_s:.1f}s after that",
    )
    assert all(s is not None for s in statuses), f"a client got no answer: {statuses}"
    assert slowest < stack.bounds["terminal"], [o.seconds for _, o in results]
    assert wrong == [], wrong
    assert found == {}, f"not back to idle: {found}"
    return {"statuses": statuses, "slowest": slowest, "back_s": back_s}


def in_flight_on(stack: fh.FaultStack, role: str, at_least: int) -> None:
    wait.poll(
        lambda: fh.state(stack, (role,))[f"{role}_requests"],
        lambda n: n >= at_least,
        120,
        f"{at_least} requests on {role}",
        interval_s=0.2,
    )


def test_docker_kill_decode_then_compose_up(
    faults: fh.FaultStack, compose: Compose
) -> None:
    """`docker kill` is an operator's stop: no restart policy brings it back
    (Docker counts it as stopped by hand); `docker compose up -d` does."""
    before = containers(compose)
    flight = Flight(faults)
    for body in bodies(faults, 6, 6000, 200):
        flight.send(body)
    in_flight_on(faults, "decode", 3)
    docker("kill", before["decode"])
    for body in bodies(faults, 2, 6100, 8):
        flight.send(body)
    time.sleep(3)
    assert compose.state("decode")[0] == "exited", "the restart policy restarted it"
    compose.run("up", "-d", "--no-deps", "decode")
    compose.until_healthy("decode", faults.bounds["restart"])
    settle(
        faults, compose, "compose: docker kill decode, 6 in flight (+2)", flight, 6200
    )
    after = containers(compose)
    assert {s: after[s] for s in ("prefill", "router")} == {
        s: before[s] for s in ("prefill", "router")
    }


def test_prefill_crashes_and_the_restart_policy_brings_it_back(
    faults: fh.FaultStack, compose: Compose
) -> None:
    """SIGKILL of the container's init from the host, as the OOM killer
    does: Docker restarts it (restart: unless-stopped)."""
    before = containers(compose)
    restarts = compose.state("prefill")[2]
    flight = Flight(faults)
    before_work = m.scrape(faults.prefill)
    for body in (
        greedy(faults.prompt(600 + 40 * i, salt=6300 + i), 16) for i in range(6)
    ):
        flight.send(body)
    wait.poll(
        lambda: fh.prefill_at_work(faults.prefill, before_work),
        bool,
        120,
        "prefill at work on the prompts",
        interval_s=0.2,
    )
    os.kill(int(compose.inspect("prefill")["State"]["Pid"]), signal.SIGKILL)
    flight.send(greedy(faults.prompt(20, salt=6399), 4))
    compose.until_restarted("prefill", restarts + 1, faults.bounds["restart"])
    compose.until_healthy("prefill", faults.bounds["restart"])
    assert compose.state("prefill")[2] == restarts + 1
    settle(faults, compose, "compose: prefill crashed, 6 in flight (+1)", flight, 6400)
    assert containers(compose) == before, "a container was replaced"


def test_prefill_recreated_at_a_new_address(
    faults: fh.FaultStack, compose: Compose
) -> None:
    """A new prefill container at a new address, as a rescheduled pod gets:
    decode and the router must follow it without a restart of their own.
    Docker's IPAM hands a freed address to the next container, so another
    container takes it first (Engine 20.10 gave the recreated prefill its
    old one)."""
    before = containers(compose)
    network, address, _ = compose.network("prefill")
    image = compose.inspect("prefill")["Config"]["Image"]
    flight = Flight(faults)
    for body in bodies(faults, 4, 6500, 16):
        flight.send(body)
    compose.run("rm", "--stop", "--force", "prefill")
    holder = docker("run", "--detach", "--rm", "--network", network,
                    "--entrypoint", "sleep", image, "600").strip()  # fmt: skip
    try:
        compose.run("up", "-d", "--no-deps", "prefill")
        flight.send(greedy(faults.prompt(20, salt=6599), 4))
        compose.until_healthy("prefill", faults.bounds["restart"])
    finally:
        docker("rm", "--force", holder)
    _, new_address, _ = compose.network("prefill")
    figures = settle(faults, compose, "compose: prefill recreated", flight, 6600)
    after = containers(compose)
    print(f"prefill {address} -> {new_address}; serving again {figures['back_s']:.1f}s")
    assert after["prefill"] != before["prefill"]
    assert new_address != address, "the recreated prefill kept its address"
    assert {s: after[s] for s in ("decode", "router")} == {
        s: before[s] for s in ("decode", "router")
    }


def test_prefill_paused(faults: fh.FaultStack, compose: Compose) -> None:
    """A hung prefill: `docker pause` freezes it, and its kernel still
    completes TCP handshakes."""
    before = containers(compose)
    flight = Flight(faults)
    for body in bodies(faults, 2, 6700, 16):
        flight.send(body)
    tries = pause(before["prefill"])
    paused_at = time.monotonic()
    print(f"prefill paused ({tries} tries)")
    try:
        for offset, salt in ((2, 6710), (30, 6720), (60, 6730)):
            time.sleep(max(0.0, paused_at + offset - time.monotonic()))
            flight.send(greedy(faults.prompt(25, salt=salt), 8))
        time.sleep(max(0.0, paused_at + PAUSE_S - time.monotonic()))
    finally:
        docker("unpause", before["prefill"])
    settle(faults, compose, f"compose: prefill paused {PAUSE_S}s", flight, 6800)
    assert containers(compose) == before


def test_prefill_partitioned(faults: fh.FaultStack, compose: Compose) -> None:
    """`docker network disconnect` of prefill, reconnected after 10 s."""
    before = containers(compose)
    network, address, aliases = compose.network("prefill")
    flight = Flight(faults)
    for body in bodies(faults, 2, 6900, 16):
        flight.send(body)
    docker("network", "disconnect", network, before["prefill"])
    try:
        time.sleep(1)
        flight.send(greedy(faults.prompt(25, salt=6950), 8))
        time.sleep(PARTITION_S - 1)
    finally:
        # Its service name back, and its address where the network lets one
        # be chosen (a configured subnet): a partition changes no address.
        again = [arg for a in aliases for arg in ("--alias", a)]
        if docker(
            "network", "inspect", "--format", "{{json .IPAM.Config}}", network
        ).strip() not in ("", "[]", "null"):
            again += ["--ip", address]
        docker("network", "connect", *again, network, before["prefill"])
    settle(
        faults, compose, f"compose: prefill partitioned {PARTITION_S}s", flight, 7000
    )
    assert containers(compose) == before


@pytest.fixture(autouse=True)
def _nothing_paused(compose: Compose) -> Iterator[None]:
    yield
    for service in SERVICES:
        if compose.state(service)[0] == "paused":
            docker("unpause", compose.container(service))
