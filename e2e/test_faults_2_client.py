"""Fault suite, clients: one that leaves halfway (during the stream, during
the prefill leg) and one without the router's API key.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests

import faults_helpers as fh
from pdstack import client, twin, wait
from pdstack import metrics as m
from pdstack.client import greedy
from pdstack.supervisor import Processes

pytest_plugins = ["faults_stack"]


def test_client_disconnects_in_the_middle_of_a_stream(faults: fh.FaultStack) -> None:
    max_tokens = 1000
    stream = greedy(faults.prompt(40, salt=3000), max_tokens, stream=True)
    before = fh.counters(faults)
    start = time.monotonic()
    url = f"{faults.router}/v1/completions"
    # Three SSE events read, then the connection closed.
    with requests.post(
        url, json=stream, headers=client.headers(), stream=True, timeout=120.0
    ) as answer:
        status = answer.status_code
        read = 0
        for line in answer.iter_lines():
            read += line.startswith(b"data:")
            if read >= 3:
                break
    left_at = time.monotonic()
    secs = left_at - start
    waited, found = fh.wait_idle(faults, faults.bounds["idle"])
    generated = (m.scrape(faults.decode) - before["decode"]).total(fh.GENERATED)
    fh.record(
        "client leaves a stream after 3 chunks", 1, int(status != 200), secs, found
    )
    print(
        f"stream: HTTP {status}, {read} chunks, left after {secs:.2f}s; decode "
        f"idle {waited:.1f}s later, generated {generated:.0f}/{max_tokens} tokens"
    )
    assert (status, read) == (200, 3)
    # Decode stopped: it did not generate the whole answer for nobody.
    assert generated < max_tokens / 2
    assert found == {}, f"{found} {time.monotonic() - left_at:.0f}s after leaving"
    fh.serves_exactly(faults, salt=3001)


def _answered(snapshot: m.Snapshot) -> float:
    """Completions a server has answered (its HTTP middleware's count)."""
    return snapshot.total("http_requests_total", handler="/v1/completions")


# Counted when a server's scheduler takes a request: its prompt's tokens.
CONNECTOR_QUERIES = "vllm:external_prefix_cache_queries_total"


def test_client_leaves_before_the_first_token(faults: fh.FaultStack) -> None:
    """Gone during the prefill leg: nothing may wait for a transfer.

    The client sends a prompt prefill needs seconds for (3000 tokens: about
    4 s on the twin's one thread) and closes its connection 1 s later. Read
    right before the close: prefill has not answered the request and decode
    has seen nothing (so the client left before the first token). Afterwards
    prefill's scheduler has queried the connector for exactly this prompt's
    tokens: the request reached the prefill leg (prefill aborts it when the
    router hangs up, so its prompt-token counter does not count it). A client
    that left before the router sent anything would leave prefill's counters
    still, and the case fails instead of passing on a scenario it did not
    exercise.
    """
    prompt = faults.prompt(3000, salt=3010)
    body = json.dumps(greedy(prompt, 200)).encode()
    host, port = faults.router.removeprefix("http://").rsplit(":", 1)
    before = fh.counters(faults)
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
            b"Content-Type: application/json\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in client.headers().items()).encode()
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        time.sleep(1.0)
        d_left = m.scrape(faults.decode) - before["decode"]
        p_left = m.scrape(faults.prefill) - before["prefill"]
    left_after = time.monotonic() - start
    waited, found = fh.wait_idle(faults, faults.bounds["idle"] + 30)
    d = m.scrape(faults.decode) - before["decode"]
    p = m.settle(
        faults.prefill,
        before["prefill"],
        lambda p: p.total(CONNECTOR_QUERIES) >= len(prompt),
    )
    problems = {
        "prefill had answered when the client left": _answered(p_left),
        "decode had the request when the client left": _answered(d_left)
        + d_left.total(CONNECTOR_QUERIES)
        + d_left.total(fh.GENERATED),
        "prefill never had the request (the client left too early)": (
            p.total(CONNECTOR_QUERIES) != len(prompt)
        ),
        "decode generated the whole answer for nobody": d.total(fh.GENERATED) >= 200,
        "not back to idle": bool(found),
    }
    problems = {k: v for k, v in problems.items() if v}
    fh.record(
        "client leaves during the prefill leg",
        1,
        int(bool(problems)),
        time.monotonic() - start,
        found,
        f"left during prefill after {left_after:.2f}s: prefill's scheduler had "
        f"{p.total(CONNECTOR_QUERIES):.0f}/{len(prompt)} prompt tokens, idle after "
        f"{waited:.1f}s; decode saw {d.total(fh.PROMPT_TOKENS):.0f} prompt tokens, "
        f"generated {d.total(fh.GENERATED):.0f}",
    )
    assert problems == {}, found
    fh.serves_exactly(faults, salt=3011)


@contextlib.contextmanager
def route(
    stack: fh.FaultStack, key_file: Path, name: str, *args: str
) -> Iterator[tuple[Processes, str, str]]:
    """``pdstack.route`` in front of ``stack``'s prefill and decode with the
    key in ``key_file``, on the fault stack's router ports moved (faults.yaml's
    api_key_router_offsets), log ``RUN_DIR/<name>.log``, stopped with its
    whole process group at the end. Its own state file: the fault stack's is
    the twin's. Yields its processes, its URL and vllm-router's behind it."""
    offsets = fh.settings()["api_key_router_offsets"]
    router_port = int(stack.env["ROUTER_PORT"])
    metrics_port = int(stack.env["ROUTER_METRICS_PORT"])
    env = {
        **stack.env,
        "PREFILL_URL": stack.prefill,
        "DECODE_URL": stack.decode,
        "ROUTER_HOST": twin.HOST,
        "ROUTER_PORT": str(router_port + offsets["ROUTER_PORT"]),
        "ROUTER_INTERNAL_PORT": str(router_port + offsets["ROUTER_INTERNAL_PORT"]),
        "ROUTER_METRICS_PORT": str(metrics_port + offsets["ROUTER_METRICS_PORT"]),
        "ROUTER_API_KEY_FILE": str(key_file),
    }
    procs = Processes(fh.RUN_DIR, f"{name}.json", fh.progress)
    argv = [sys.executable, "-m", "pdstack.route", *args]
    # pdstack from this checkout, wherever pytest was started.
    path = os.pathsep.join(filter(None, (str(twin.ROOT), os.environ.get("PYTHONPATH"))))
    procs.launch(name, argv, {**env, "PYTHONPATH": path})
    url, inner = (
        f"http://{twin.HOST}:{env[f'ROUTER_{p}PORT']}" for p in ("", "INTERNAL_")
    )
    try:
        yield procs, url, inner
    finally:
        procs.stop()


def test_router_with_an_api_key_refuses_requests_without_it(
    faults: fh.FaultStack, tmp_path: Path
) -> None:
    fh.require_owned(faults, "starts a router of its own next to prefill and decode")
    key = "pd-" + os.urandom(12).hex()
    key_file = tmp_path / "api_key"
    key_file.write_text(key + "\n")
    body = greedy(faults.prompt(24, salt=3500), 6)
    (expected,) = fh.references(faults, [body])
    name = "router-api-key"
    with route(faults, key_file, name) as (procs, url, inner):
        log, proc = procs.log(name), procs.popen[name]
        wait.until_healthy("api-key router", url, 60, proc, log, fh.progress)
        wait.until_healthy("vllm-router behind it", inner, 60, None, log, fh.progress)
        outcomes = {
            "no key": fh.post(url, body, timeout=60),
            "wrong key": fh.post(url, body, headers={"Authorization": "Bearer no"}),
            "key": fh.post(url, body, headers={"Authorization": f"Bearer {key}"}),
        }
        health = requests.get(f"{url}/health", timeout=10).status_code
        cmdlines = [" ".join(p.cmdline()) for p in procs.records()[name].members()]
    statuses = {kind: o.status for kind, o in outcomes.items()}
    fh.record(
        "API key: none / wrong / right",
        3,
        int(statuses != {"no key": 401, "wrong key": 401, "key": 200}),
        max(o.seconds for o in outcomes.values()),
        0,
        f"api key: {statuses}, /health {health}, {len(cmdlines)} processes",
    )
    assert statuses == {"no key": 401, "wrong key": 401, "key": 200}
    assert expected.met_by(outcomes["key"]), expected.fault(outcomes["key"])
    assert health == 200
    assert all(key not in line for line in cmdlines), "key on a command line"
    assert key not in log.read_text(errors="replace"), "key in the router's log"


def test_negative_control_vllm_router_alone_serves_without_the_key(
    faults: fh.FaultStack, tmp_path: Path
) -> None:
    """vllm-router 0.1.17 with --api-key (pdstack.route's backend: the key
    handed over in-process) serves a client that has no key: the reason for
    pdstack.route's proxy."""
    fh.require_owned(faults, "starts a router of its own next to prefill and decode")
    key_file = tmp_path / "api_key"
    key_file.write_text("pd-" + os.urandom(12).hex())
    body = greedy(faults.prompt(12, salt=3510), 2)
    (expected,) = fh.references(faults, [body])
    name = "router-backend-only"
    with route(faults, key_file, name, "--backend") as (procs, _, inner):
        proc, log = procs.popen[name], procs.log(name)
        wait.until_healthy("vllm-router --api-key", inner, 60, proc, log, fh.progress)
        before = fh.counters(faults)
        got = fh.post(inner, body, timeout=60)
        d, p = fh.transferred(faults, before, len(body["prompt"]))
    print(
        f"vllm-router alone, no key presented: HTTP {got.status}, tokens "
        f"{got.token_ids} (reference {expected.tokens}); prefill transfers "
        f"{p.total(m.TRANSFERS):.0f}, decode loaded "
        f"{d.total(m.EXTERNAL_HITS):.0f}/{len(body['prompt'])} prompt tokens"
    )
    # Served in full through P/D to a client that presented no key: the
    # reference's tokens, the prompt's KV moved from prefill to decode.
    assert expected.met_by(got), expected.fault(got)
    assert p.total(m.TRANSFERS) >= 1
    assert d.total(m.EXTERNAL_HITS) == len(body["prompt"])
