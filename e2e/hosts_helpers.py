"""The multi-host twin as the e2e suite drives it (e2e/test_hosts.py)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from conftest import E2E_RUN_DIR, Stack, tagged
from faults_helpers import Outcome, greedy, post, server_state
from faults_helpers import leaks as off_idle
from pdstack import hosts, wait
from pdstack import metrics as m

RUN_DIR = E2E_RUN_DIR.parent / "hosts"
progress = tagged("hosts twin")


@dataclass
class Hosts:
    twin: hosts.HostsTwin
    bounds: dict[str, float]
    idle: dict[str, float]

    @property
    def reference(self) -> Stack:
        """A colocated server: prefill-0 (at its current address) asked
        without transfer parameters."""
        url = self.twin.url("prefill-0")
        return Stack(self.twin.router, url, self.twin.url("decode-0"), url, True)

    @property
    def run_dir(self) -> Path:
        return self.twin.run_dir

    def all_servers(self) -> list[str]:
        return [*self.twin.servers("prefill"), *self.twin.servers("decode")]

    def state(self) -> dict[str, float]:
        """faults_helpers.server_state of every server, keyed by its name."""
        now: dict[str, float] = {}
        for name in self.all_servers():
            now |= server_state(self.twin.url(name), hosts.role_of(name), name)
        return now


def wait_idle(h: Hosts, deadline_s: float | None = None) -> dict[str, float]:
    """Leaks left on any server after ``deadline_s`` (default the idle bound;
    empty: none)."""
    return wait.poll_last(
        lambda: off_idle(h.state(), h.idle),
        lambda found: not found,
        deadline_s or h.bounds["idle"],
        "hosts idle",
        0.5,
    )[1]


def counters(h: Hosts) -> dict[str, m.Snapshot]:
    return {name: m.scrape(h.twin.url(name)) for name in h.all_servers()}


def deltas(h: Hosts, before: dict[str, m.Snapshot]) -> dict[str, m.Snapshot]:
    return {name: m.scrape(h.twin.url(name)) - snap for name, snap in before.items()}


def in_flight_while(
    h: Hosts, bodies: list[dict], fault: Callable[[], object], after_s: float = 0.0
) -> tuple[list[Outcome], float]:
    """``bodies`` sent through the router at once while ``fault`` runs
    beside them (``after_s`` after they left): the outcomes, and the seconds
    from the fault's end until the last terminal answer."""
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        futures = [
            pool.submit(post, h.twin.router, b, timeout=h.bounds["request"])
            for b in bodies
        ]
        time.sleep(after_s)
        fault()
        done_at = time.monotonic()
        got = [f.result() for f in futures]
    return got, time.monotonic() - done_at


def decode_that_pulled_from(h: Hosts, prefill: str, salt: int) -> str:
    """Requests through the router until one is served by ``prefill``; the
    decode that served it (it has the prefill's address cached now). The
    router names both in the completion id."""
    for i in range(8):
        body = greedy(h.reference.prompt(20, salt=salt + i), 2)
        got = post(h.twin.router, body, timeout=h.bounds["request"])
        pair = re.search(r"prefill_addr_([\w-]+):\d+___decode_addr_([\w-]+):", got.body)
        if got.status == 200 and pair and pair.group(1) == prefill:
            return pair.group(2)
    raise AssertionError(f"no request through the router reached {prefill}")


def direct_pull_seconds(
    h: Hosts, decode: str, engine_id: str, bootstrap: str, salt: int
) -> tuple[int | None, float]:
    """A request sent straight to ``decode`` whose KV is to come from
    ``engine_id`` at ``bootstrap`` (under a transfer id no prefill knows):
    (HTTP status, seconds until decode's terminal answer)."""
    body = greedy(h.reference.prompt(24, salt=salt), 4)
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": f"hosts-{salt}",
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": bootstrap,
    }
    got = post(h.twin.url(decode), {**body, "kv_transfer_params": params}, timeout=120)
    return got.status, got.seconds
