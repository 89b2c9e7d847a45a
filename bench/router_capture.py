"""The P/D protocol vllm-router speaks, read off the wire rather than assumed
(what vllm-router 0.1.17 was seen to send: docs/bench.md, "Router overhead").

``capture`` points a second router, started with the stack's own flags, at
recording proxies (bench.http_tap) in front of prefill, decode and the
Mooncake bootstrap server. ``build_legs`` builds the same legs for the direct
client (bench.router_overhead), and ``differences`` checks either pair against
the protocol, so a router that changes it fails the bench rather than skewing
it. ``stub_taps`` are backends that answer at once, for the router alone.
"""

from __future__ import annotations

import contextlib
import copy
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests

from bench import http_tap
from pdstack import supervisor, wait
from pdstack.supervisor import HOST, Progress, free_port

REQUEST_TIMEOUT_S = 120.0
# A router whose port was taken between picking and binding is started
# again on new ports, this many times in all; what its log then says, lower
# case (vllm-router: "Address already in use", the front: "address already
# in use").
ROUTER_ATTEMPTS = 3
PORT_TAKEN = "address already in use"
PROMPT = (
    "Prefill and decode run on different servers. The prefill computes the KV "
    "cache of this prompt and Mooncake moves it to the decode server, which "
    "generates the answer one token at a time while the router stays out of "
    "the way of both of them. "
)
# Fields of the router's prefill leg that the direct client must also set.
PREFILL_OVERRIDES = {"max_tokens": 1, "min_tokens": 1, "stream": False}
DECODE_PARAMS = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "transfer_id": str,
    "remote_bootstrap_addr": str,
    "remote_engine_id": str,
}
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "transfer_id": str,
}
# The taps router_behind puts the router behind, in its order.
TAPS = ("prefill", "decode", "bootstrap")


class ProtocolError(RuntimeError):
    pass


def bootstrap_url(prefill_url: str, bootstrap_port: int) -> str:
    return f"http://{urlsplit(prefill_url).hostname or HOST}:{bootstrap_port}"


def engine_id(bootstrap: str) -> str:
    """The prefill engine's id from its Mooncake bootstrap server (DP rank 0)."""
    answer = requests.get(f"{bootstrap}/query", timeout=10).json()
    try:
        return str(answer["0"]["engine_id"])
    except (KeyError, TypeError) as exc:
        raise ProtocolError(
            f"{bootstrap}/query: no engine of rank 0 in {answer}"
        ) from exc


def build_legs(
    body: Mapping[str, Any], engine: str, bootstrap: str, transfer_id: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prefill and decode request bodies the router would send for
    ``body``: each leg's kv_transfer_params as the protocol (PREFILL_PARAMS,
    DECODE_PARAMS) has them, its strings filled in."""
    strings = {
        "transfer_id": transfer_id or f"xfer-{uuid.uuid4()}",
        "remote_bootstrap_addr": bootstrap,
        "remote_engine_id": engine,
    }

    def leg(params: Mapping[str, Any], **more: Any) -> dict[str, Any]:
        kv = {k: strings[k] if want is str else want for k, want in params.items()}
        return {**copy.deepcopy(dict(body)), **more, "kv_transfer_params": kv}

    return leg(PREFILL_PARAMS, **PREFILL_OVERRIDES), leg(DECODE_PARAMS)


def _check_params(
    leg: str, body: Mapping[str, Any], expected: Mapping[str, Any], problems: list[str]
) -> None:
    """The leg's kv_transfer_params against ``expected`` (``str``: any string)."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict):
        problems.append(f"{leg}: kv_transfer_params is {params!r}")
        return
    if set(params) != set(expected):
        problems.append(
            f"{leg}: kv_transfer_params keys {sorted(params)} != {sorted(expected)}"
        )
    for key, want in expected.items():
        got = params.get(key)
        if want is str:
            if not isinstance(got, str) or not got:
                problems.append(f"{leg}: {key} is {got!r}")
        elif got != want:
            problems.append(f"{leg}: {key} is {got!r}, expected {want!r}")


def differences(
    prefill_leg: Mapping[str, Any], decode_leg: Mapping[str, Any]
) -> list[str]:
    """How a (prefill, decode) pair departs from the protocol documented above.

    Applied to the legs the tapped router sent (is the router still doing
    this?) and to the direct client's (do we do the same?)."""
    problems: list[str] = []
    for key, want in PREFILL_OVERRIDES.items():
        if (got := prefill_leg.get(key)) != want:
            problems.append(f"prefill: {key} is {got!r}, expected {want!r}")
    _check_params("prefill", prefill_leg, PREFILL_PARAMS, problems)
    _check_params("decode", decode_leg, DECODE_PARAMS, problems)
    p_params = prefill_leg.get("kv_transfer_params") or {}
    d_params = decode_leg.get("kv_transfer_params") or {}
    if isinstance(p_params, dict) and isinstance(d_params, dict):
        if p_params.get("transfer_id") != d_params.get("transfer_id"):
            problems.append("the two legs carry different transfer_ids")
        addr = str(d_params.get("remote_bootstrap_addr", ""))
        if not addr.startswith("http://") or urlsplit(addr).port is None:
            problems.append(
                f"decode: remote_bootstrap_addr {addr!r} is not http://host:port"
            )
    for key in ("prompt", "model"):
        if prefill_leg.get(key) != decode_leg.get(key):
            problems.append(f"the legs' {key} differ")
    return problems


@dataclass
class Capture:
    """What the tapped router sent for one request, and when."""

    prefill_leg: dict[str, Any]
    decode_leg: dict[str, Any]
    prefill_response_kv_params: Any
    bootstrap_queries: int
    # Per request: client end-to-end minus the two legs as the taps saw them.
    router_own_ms: list[float] = field(default_factory=list)
    legs_in_order: bool = True
    failed_requests: list[str] = field(default_factory=list)


@contextlib.contextmanager
def router_behind(
    taps: list[http_tap.Tap], run_dir: Path, name: str, progress: Progress
) -> Iterator[tuple[str, http_tap.TapServer]]:
    """The real vllm-router with the stack's flags, its backends the taps
    (prefill, decode, bootstrap), its log ``run_dir/<name>.log``; yields its
    URL and the taps' server."""
    router = supervisor.Processes(run_dir, f"{name}.json", progress)
    with http_tap.TapServer(taps) as server:
        try:
            url = _start_router(router, name, taps)
            yield url, server
        finally:
            router.stop()


def _start_router(
    router: supervisor.Processes, name: str, taps: list[http_tap.Tap]
) -> str:
    """Launch the router on free ports until one binds (ROUTER_ATTEMPTS): a
    port free when picked can be taken before the router or its front binds
    it, e.g. as the local end of an outgoing connection. Returns its URL."""
    attempt = 1
    while True:
        urls = supervisor.Urls(
            router=f"http://{HOST}:{free_port()}",
            prefill=taps[0].url,
            decode=taps[1].url,
            bootstrap_port=taps[2].port,
        )
        argv = supervisor.router_command(
            urls, metrics_port=free_port(), internal_port=free_port()
        )
        router.launch(name, argv, {}, urls.router, again=attempt > 1)
        try:
            router.wait_healthy(name, 60)
            return urls.router
        except wait.WaitError as exc:
            router.stop([name])
            if PORT_TAKEN not in str(exc).lower() or attempt == ROUTER_ATTEMPTS:
                raise
        attempt += 1


def capture(
    prefill_url: str,
    decode_url: str,
    bootstrap_port: int,
    run_dir: Path,
    model: str,
    requests_n: int = 10,
    progress: Progress = print,
) -> Capture:
    """Start a router behind taps, send ``requests_n`` requests, return its legs."""
    bootstrap = bootstrap_url(prefill_url, bootstrap_port)
    upstreams = (prefill_url, decode_url, bootstrap)
    taps = [
        http_tap.Tap(n, free_port(), u) for n, u in zip(TAPS, upstreams, strict=True)
    ]
    pairs: list[tuple[http_tap.Exchange, http_tap.Exchange]] = []
    own_ms: list[float] = []
    failures: list[str] = []
    tapped = router_behind(taps, run_dir, "router-tapped", progress)
    with tapped as (router_url, server):
        session = requests.Session()
        # A request may fail on a busy host (a KV transfer timing out):
        # it is counted, and the capture goes on up to twice as many tries.
        for i in range(2 * requests_n):
            if len(pairs) == requests_n:
                break
            body = {"model": model, "prompt": f"{i} {PROMPT}", "max_tokens": 4,
                    "temperature": 0.0}  # fmt: skip
            mark = len(server.exchanges("/v1/completions"))
            start = time.monotonic()
            answer = session.post(
                f"{router_url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S
            )
            took = time.monotonic() - start
            legs = server.exchanges("/v1/completions")[mark:]
            if (seen := [e.tap for e in legs]) != ["prefill", "decode"]:
                raise ProtocolError(f"expected prefill then decode legs, saw {seen}")
            if answer.status_code != 200:
                failures.append(f"HTTP {answer.status_code}: {answer.text[:200]}")
                continue
            pairs.append((legs[0], legs[1]))
            # The first request also waits for the bootstrap query.
            if i > 0:
                own_ms.append((took - sum(e.finished - e.started for e in legs)) * 1e3)
        if not pairs:
            raise ProtocolError(
                f"no request through the tapped router succeeded: {failures}"
            )
        queries = len(server.exchanges("/query"))
    prefill_leg, decode_leg = pairs[0]
    response = prefill_leg.response if isinstance(prefill_leg.response, dict) else {}
    return Capture(
        prefill_leg=prefill_leg.request,
        decode_leg=decode_leg.request,
        prefill_response_kv_params=response.get("kv_transfer_params", "missing"),
        bootstrap_queries=queries,
        router_own_ms=own_ms,
        legs_in_order=all(d.started >= p.finished for p, d in pairs),
        failed_requests=failures,
    )


def stub_vllm(model: str) -> http_tap.Responder:
    """A backend that answers like a vLLM server at once: the legs cost nothing,
    so what remains of a router request's latency is the router."""
    choice = {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length",
              "stop_reason": None}  # fmt: skip
    usage = {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}

    def respond(method: str, path: str, body: Any) -> http_tap.Reply:
        if method == "POST" and path == "/v1/completions":
            head = {"id": "cmpl-stub", "object": "text_completion", "created": 0,
                    "model": model, "choices": [choice]}  # fmt: skip
            if isinstance(body, dict) and body.get("stream"):
                return 200, [head, {**head, "choices": [], "usage": usage}, "[DONE]"]
            return 200, {**head, "usage": usage, "kv_transfer_params": None}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": model, "object": "model"}]}
        if path in ("/health", "/metrics"):
            return 200, ""
        return 404, {"error": f"stub: no {method} {path}"}

    return respond


def stub_bootstrap(method: str, path: str, body: Any) -> http_tap.Reply:
    if path == "/query":
        workers = {"0": {"0": "tcp://127.0.0.1:1"}}
        return 200, {"0": {"engine_id": "stub-engine", "worker_addr": workers}}
    return 404, {"error": f"stub: no {method} {path}"}


def stub_taps(model: str) -> list[http_tap.Tap]:
    """Stub prefill, decode and bootstrap server, in the order router_behind takes."""
    stubs = (stub_vllm(model), stub_vllm(model), stub_bootstrap)
    return [http_tap.Tap(name, free_port(), None, respond=stub)
            for name, stub in zip(TAPS, stubs, strict=True)]  # fmt: skip
