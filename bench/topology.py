"""How many prefills and decodes serve behind the router, and where the bench
reads each one's evidence: the P:D ratio a report is labelled with.

The user gives one URL per server, comma-separated, in BENCH_PREFILL_URL and
BENCH_DECODE_URL (as vllm-router's ``--prefill``/``--decode`` take them): the
addresses the bench reaches them at, which need not be the names the router
holds (``http://prefill-0:8100`` inside a cluster). The router is asked how
many it routes to (vllm-router's ``GET /workers``, each worker with its
``worker_type``); where it says, a count that differs from the URLs given
ends the run before anything is measured: a decode the bench does not read
would serve requests whose KV nobody checks, and the summed evidence would
fail for a reason that is the bench's, not the stack's. A router without
``/workers`` (not vllm-router) leaves the URLs given as the only source,
and the report says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import requests

from bench.preflight import TIMEOUT_S, BenchInputError
from pdstack import client

ROLES = ("prefill", "decode")
FROM_ROUTER = "the router's /workers"
FROM_URLS = "the URLs given (the router does not list its workers)"
FROM_OWN = "the bench's own twin"


def split(urls: str) -> tuple[str, ...]:
    """``http://a:8100, http://b:8100/`` -> both, without blanks or a
    trailing slash."""
    return tuple(u.strip().rstrip("/") for u in urls.split(",") if u.strip())


def label(prefills: int, decodes: int) -> str:
    return f"{prefills}P:{decodes}D"


@dataclass(frozen=True)
class Servers:
    """The servers behind one router, as this host reaches them."""

    prefills: tuple[str, ...]
    decodes: tuple[str, ...]
    source: str = FROM_URLS

    @property
    def label(self) -> str:
        return label(len(self.prefills), len(self.decodes))

    def describe(self) -> str:
        return (
            f"{self.label} ({len(self.prefills)} prefill, {len(self.decodes)} "
            f"decode; from {self.source})"
        )


def behind_router(router_url: str) -> dict[str, list[str]] | None:
    """The router's workers per role, as it names them (vllm-router's
    ``GET /workers``); None where the router does not list them."""
    try:
        response = requests.get(
            f"{router_url}/workers", headers=client.headers(), timeout=TIMEOUT_S
        )
        workers = response.json().get("workers") if response.ok else None
    except (requests.RequestException, ValueError, AttributeError):
        return None
    if not isinstance(workers, list):
        return None
    found: dict[str, list[str]] = {role: [] for role in ROLES}
    for worker in workers:
        if isinstance(worker, dict) and worker.get("worker_type") in found:
            found[worker["worker_type"]].append(str(worker.get("url", "?")))
    return found


def check(router_url: str, prefills: Sequence[str], decodes: Sequence[str]) -> Servers:
    """The servers given, checked against the router's own list where it
    has one (BenchInputError naming the knob when the counts differ)."""
    given = {"prefill": tuple(prefills), "decode": tuple(decodes)}
    routed = behind_router(router_url)
    if routed is None:
        return Servers(given["prefill"], given["decode"], FROM_URLS)
    for role in ROLES:
        if len(routed[role]) != len(given[role]):
            raise BenchInputError(
                f"the router at {router_url} routes to {len(routed[role])} "
                f"{role} server(s) ({', '.join(routed[role]) or 'none'}) but "
                f"BENCH_{role.upper()}_URL names {len(given[role])}: give one "
                f"URL per {role}, comma-separated, so that every one's KV "
                "evidence is read"
            )
    return Servers(given["prefill"], given["decode"], FROM_ROUTER)
