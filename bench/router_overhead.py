"""What vllm-router adds: its latency against the same two legs sent directly.

First the protocol is read off the wire rather than assumed: a second router,
started with the stack's own flags, is pointed at recording proxies
(bench.http_tap) in front of prefill, decode and the Mooncake bootstrap
server. vllm-router 0.1.17 with ``--kv-connector mooncake`` was seen to:

1. ``GET /query`` on the prefill's bootstrap server, keep the ``engine_id``
   of data-parallel rank 0 (refreshed in the background);
2. POST the request to prefill with ``max_tokens: 1``, ``min_tokens: 1``,
   ``stream: false`` and ``kv_transfer_params: {do_remote_decode: true,
   do_remote_prefill: false, transfer_id: "xfer-<uuid>"}``; prefill answers
   with ``kv_transfer_params: null`` (Mooncake pushes, nothing to hand over);
3. then POST the original request to decode with ``kv_transfer_params:
   {do_remote_decode: false, do_remote_prefill: true, transfer_id: <same>,
   remote_bootstrap_addr: "http://<prefill host>:<bootstrap port>",
   remote_engine_id: <engine_id>}``.

The direct client below builds the legs the same way, and ``differences``
compares them with what the tapped router sent, so a router that changes its
protocol fails the bench rather than skewing it. Then router and direct
requests alternate on the same prompts; overhead = percentile of router
end-to-end latency minus the same percentile of the two direct legs.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import requests

from bench import http_tap
from bench.stack import HOST, free_port
from pdstack import config, wait

REQUEST_TIMEOUT_S = 120.0
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
Progress = Callable[[str], None]


class ProtocolError(RuntimeError):
    pass


def bootstrap_url(prefill_url: str, bootstrap_port: int) -> str:
    host = urlsplit(prefill_url).hostname or HOST
    return f"http://{host}:{bootstrap_port}"


def engine_id(bootstrap: str, session: requests.Session | None = None) -> str:
    """The prefill engine's id from its Mooncake bootstrap server (DP rank 0)."""
    getter = session or requests
    answer = getter.get(f"{bootstrap}/query", timeout=10).json()
    try:
        return str(answer["0"]["engine_id"])
    except (KeyError, TypeError) as exc:
        raise ProtocolError(
            f"{bootstrap}/query: no engine of rank 0 in {answer}"
        ) from exc


def build_legs(
    body: Mapping[str, Any], engine: str, bootstrap: str, transfer_id: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prefill and decode request bodies the router would send for ``body``."""
    transfer_id = transfer_id or f"xfer-{uuid.uuid4()}"
    prefill = {
        **copy.deepcopy(dict(body)),
        **PREFILL_OVERRIDES,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
        },
    }
    decode = {
        **copy.deepcopy(dict(body)),
        "kv_transfer_params": {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_bootstrap_addr": bootstrap,
            "remote_engine_id": engine,
        },
    }
    return prefill, decode


def _check_params(
    leg: str, params: Any, expected: Mapping[str, Any], problems: list[str]
) -> None:
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
        if prefill_leg.get(key) != want:
            problems.append(
                f"prefill: {key} is {prefill_leg.get(key)!r}, expected {want!r}"
            )
    _check_params(
        "prefill", prefill_leg.get("kv_transfer_params"), PREFILL_PARAMS, problems
    )
    _check_params(
        "decode", decode_leg.get("kv_transfer_params"), DECODE_PARAMS, problems
    )
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
    taps: list[http_tap.Tap], log: Path, label: str, progress: Progress
) -> Iterator[tuple[str, http_tap.TapServer]]:
    """The real vllm-router with the stack's flags, its backends the taps
    (prefill, decode, bootstrap); yields its URL and the taps' server."""
    router_port = free_port()
    router_url = f"http://{HOST}:{router_port}"
    argv = [
        str(Path(sys.executable).parent / "vllm-router"),
        *config.router_args(
            taps[0].url, taps[2].port, taps[1].url, HOST, router_port, free_port()
        ),
    ]
    with http_tap.TapServer(taps) as server, log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            wait.until_healthy(label, router_url, 60, proc, log, progress)
            yield router_url, server
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


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
    taps = [
        http_tap.Tap("prefill", free_port(), prefill_url),
        http_tap.Tap("decode", free_port(), decode_url),
        http_tap.Tap(
            "bootstrap", free_port(), bootstrap_url(prefill_url, bootstrap_port)
        ),
    ]
    pairs: list[tuple[http_tap.Exchange, http_tap.Exchange]] = []
    own_ms: list[float] = []
    failures: list[str] = []
    log = run_dir / "router-tapped.log"
    with router_behind(taps, log, "tapped router", progress) as (router_url, server):
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
            seen = [e.tap for e in legs]
            if seen != ["prefill", "decode"]:
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


@dataclass
class Overhead:
    router_ms: list[float] = field(default_factory=list)
    direct_ms: list[float] = field(default_factory=list)
    prefill_leg_ms: list[float] = field(default_factory=list)
    decode_leg_ms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def percentile(self, values: Sequence[float], p: float) -> float:
        return float(np.percentile(values, p)) if values else float("nan")

    def overhead_ms(self, p: float) -> float:
        return self.percentile(self.router_ms, p) - self.percentile(self.direct_ms, p)

    def paired_ms(self, p: float) -> float:
        """Percentile of per-pair differences (same prompt, back to back)."""
        diffs = [r - d for r, d in zip(self.router_ms, self.direct_ms, strict=False)]
        return self.percentile(diffs, p)


class Connection:
    """A kept-alive HTTP/1.1 connection with the least client-side cost
    (http.client, bodies serialized before the clock starts): the client's own
    time is in both paths, once more in the direct one (two requests)."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or HOST
        self.port = parts.port or 80
        self.conn = http.client.HTTPConnection(
            self.host, self.port, timeout=REQUEST_TIMEOUT_S
        )

    def post(self, path: str, body: bytes) -> bytes:
        for attempt in (1, 2):
            try:
                self.conn.request(
                    "POST", path, body, {"Content-Type": "application/json"}
                )
                answer = self.conn.getresponse()
                data = answer.read()
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                if attempt == 2:
                    raise
                continue
            if answer.status != 200:
                raise ProtocolError(
                    f"{self.host}:{self.port}{path}: HTTP {answer.status}: "
                    f"{data[:300]!r}"
                )
            return data
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.conn.close()


def measure(
    router_url: str,
    prefill_url: str,
    decode_url: str,
    bootstrap: str,
    model: str,
    pairs: int,
    max_tokens: int = 2,
    warmup: int = 3,
    progress: Progress = print,
) -> Overhead:
    """Alternate router and direct requests on the same prompts."""
    engine = engine_id(bootstrap)
    via_router = Connection(router_url)
    to_prefill, to_decode = Connection(prefill_url), Connection(decode_url)
    path = "/v1/completions"
    result = Overhead()
    last_note = time.monotonic()

    def router_once(routed: bytes) -> float:
        start = time.perf_counter()
        via_router.post(path, routed)
        return (time.perf_counter() - start) * 1e3

    def direct_once(legs: list[bytes]) -> tuple[float, float, float]:
        start = time.perf_counter()
        to_prefill.post(path, legs[0])
        mid = time.perf_counter()
        to_decode.post(path, legs[1])
        end = time.perf_counter()
        return (end - start) * 1e3, (mid - start) * 1e3, (end - mid) * 1e3

    try:
        for i in range(warmup + pairs):
            body = {"model": model, "prompt": f"{i} {PROMPT}",
                    "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True}  # fmt: skip
            routed = json.dumps(body).encode()
            prefill, decode = build_legs(body, engine, bootstrap)
            legs = [json.dumps(prefill).encode(), json.dumps(decode).encode()]
            # Alternate which path goes first, so neither always finds the
            # servers just woken (or just busy).
            try:
                if i % 2:
                    router = router_once(routed)
                    direct = direct_once(legs)
                else:
                    direct = direct_once(legs)
                    router = router_once(routed)
            except ProtocolError as exc:
                # A failed request (e.g. a KV transfer timing out on a busy
                # host) drops its pair; many of them end the measurement.
                result.failures.append(str(exc)[:300])
                if len(result.failures) > max(3, pairs // 5):
                    raise
                continue
            if i >= warmup:
                result.router_ms.append(router)
                result.direct_ms.append(direct[0])
                result.prefill_leg_ms.append(direct[1])
                result.decode_leg_ms.append(direct[2])
            if time.monotonic() - last_note > 15:
                progress(f"  ... {i + 1 - warmup}/{pairs} pairs")
                last_note = time.monotonic()
    finally:
        for conn in (via_router, to_prefill, to_decode):
            conn.close()
    return result


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


def measure_on_stubs(
    model: str, pairs: int, run_dir: Path, progress: Progress = print
) -> Overhead:
    """Router vs direct legs against stub backends (see ``stub_vllm``)."""
    taps = [
        http_tap.Tap("prefill", free_port(), None, respond=stub_vllm(model)),
        http_tap.Tap("decode", free_port(), None, respond=stub_vllm(model)),
        http_tap.Tap("bootstrap", free_port(), None, respond=stub_bootstrap),
    ]
    log = run_dir / "router-stubs.log"
    with router_behind(taps, log, "router on stubs", progress) as (router_url, _):
        return measure(
            router_url, taps[0].url, taps[1].url, taps[2].url, model, pairs,
            warmup=20, progress=progress,
        )  # fmt: skip


def p50_interval(
    overhead: Overhead, resamples: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """95% bootstrap interval of p50(router) - p50(direct)."""
    router = np.asarray(overhead.router_ms)
    direct = np.asarray(overhead.direct_ms)
    if len(router) < 2 or len(direct) < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    diffs = [
        np.median(rng.choice(router, len(router)))
        - np.median(rng.choice(direct, len(direct)))
        for _ in range(resamples)
    ]
    low, high = np.percentile(diffs, [2.5, 97.5])
    return float(low), float(high)


def summary(overhead: Overhead) -> dict[str, Any]:
    data: dict[str, Any] = {
        "pairs": len(overhead.router_ms),
        "failed_pairs": len(overhead.failures),
    }
    for p in (50, 99):
        data[f"p{p}_router_ms"] = overhead.percentile(overhead.router_ms, p)
        data[f"p{p}_direct_ms"] = overhead.percentile(overhead.direct_ms, p)
        data[f"p{p}_overhead_ms"] = overhead.overhead_ms(p)
        data[f"p{p}_paired_overhead_ms"] = overhead.paired_ms(p)
    data["p50_overhead_interval_ms"] = list(p50_interval(overhead))
    return data


def to_json(
    overhead: Overhead, capture_result: Capture | None, stubs: Overhead | None = None
) -> dict[str, Any]:
    data: dict[str, Any] = {"samples": asdict(overhead), **summary(overhead)}
    if stubs is not None:
        data["stubs"] = summary(stubs)
        data["stubs_samples"] = asdict(stubs)
    if capture_result is not None:
        data["capture"] = asdict(capture_result)
        own = capture_result.router_own_ms
        data["p50_router_own_ms"] = float(np.percentile(own, 50)) if own else None
    return data
