"""The KV geometry handshake between real servers (pd_mooncake.geometry).

One prefill of the tiny profile (MLA target, Eagle3 GQA draft, 16-token
blocks, float32 on the CPU), and per case a decode started with one flag
changed: without the draft, with bfloat16 KV, and asked for 32-token blocks
(which the CPU MLA backend overrides: see CASES). Each
request goes as vllm-router sends it (prefill leg with max_tokens 1, then
decode leg with prefill's transfer parameters), straight to the servers.

With the check: decode answers an error within seconds naming the
difference and the flag, prefill logs one refusal line for that decode.
Negative control (the check skipped on prefill through the test fault
``skip_geometry_check``, switched by a file without a restart): the same
request, and what it gives is recorded and asserted to be wrong in the way
each case's ``unchecked`` describes.

Heavy (four vLLM servers one after another, 154 s on a quiet 2-core host):
run by ``make test`` and ``make test-geometry`` (PD_GEOMETRY_SERVERS=1);
the Makefile says why it is worth its time.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from pd_mooncake import faults, geometry
from pdstack import client, config, serve, supervisor

if not os.environ.get("PD_GEOMETRY_SERVERS"):
    pytest.skip(
        "starts real vLLM servers: make test-geometry (PD_GEOMETRY_SERVERS=1)",
        allow_module_level=True,
    )

HOST = supervisor.HOST
PROFILE = "tiny"
ENGINE_ID = "pd-prefill"  # configs/vllm/prefill.yaml
MAX_TOKENS = 8
# A refused pull fails within one answer; a hang would run into upstream's
# VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s.
ANSWER_S = 60.0


def _swap(argv: list[str], flag: str, value: str | None) -> list[str]:
    """``argv`` with ``flag``'s value replaced (None: the flag removed)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == flag:
            if value is not None:
                out += [flag, value]
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


@dataclass(frozen=True)
class Case:
    name: str
    change: Callable[[list[str]], list[str]]
    # What the refusal must name: the difference and the flag.
    names: tuple[str, ...]


CASES = [
    Case(
        "no_draft",
        lambda a: _swap(a, "--speculative-config", None),
        ("draft", geometry.FLAG_DRAFT),
    ),
    Case(
        "kv_dtype_bfloat16",
        lambda a: _swap(a, "--dtype", "bfloat16"),
        ("KV dtype", geometry.FLAG_KV_DTYPE),
    ),
]
# Different block sizes cannot be served on the CPU twin: vLLM's CPU MLA
# backend overrides the flag ("CPU MLA backend requires block_size=16,
# overriding user-specified block_size=32", vllm/platforms/cpu.py), so a
# decode started with --block-size 32 runs 16-token blocks. What the
# handshake must do then is state what runs, not what was asked, and let
# the pull proceed (test_block_size_flag_overridden_states_what_runs). The
# refusal itself: test_geometry.py; what the unchecked difference does
# (upstream converts decode's ids with prefill's block ratio):
# test_transfer.py's test_wrong_block_ratio_is_caught, a real transfer.


@dataclass
class Servers:
    procs: supervisor.Processes
    prefill: str
    decode: str
    bootstrap: str
    fault_file: Path

    def log(self, name: str) -> str:
        return self.procs.log(name).read_text(errors="replace")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    run_dir = tmp_path_factory.mktemp("geometry")
    procs = supervisor.Processes(run_dir, progress=print)
    ports = config.ports()
    fault_file = run_dir / "fault"
    argv, env = serve.command("prefill", PROFILE, "cpu", HOST)
    env = {**env, faults.FAULT_FILE_ENV: str(fault_file)}
    u = supervisor.urls(ports)
    procs.launch("prefill", argv, env, u.prefill)
    try:
        procs.wait_healthy("prefill", supervisor.SERVER_DEADLINE_S)
        yield Servers(
            procs, u.prefill, u.decode, f"http://{HOST}:{ports.bootstrap}", fault_file
        )
    finally:
        procs.stop()


@dataclass
class Outcome:
    status: int
    seconds: float
    body: str
    token_ids: list[int] | None

    @property
    def answered(self) -> bool:
        """A completion with its tokens (not an error, in any form)."""
        return self.status == 200 and self.token_ids is not None


def pd_request(s: Servers, prompt: list[int]) -> Outcome:
    """Prefill leg, then decode leg, as vllm-router sends them."""
    transfer_id = f"geometry-{uuid.uuid4().hex[:12]}"
    first = requests.post(
        f"{s.prefill}/v1/completions",
        json=client.greedy(
            prompt,
            1,
            kv_transfer_params={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": transfer_id,
            },
        ),
        timeout=ANSWER_S,
    )
    assert first.status_code == 200, first.text[:500]
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_engine_id": ENGINE_ID,
        "remote_bootstrap_addr": s.bootstrap,
    }
    start = time.monotonic()
    try:
        got = requests.post(
            f"{s.decode}/v1/completions",
            json=client.greedy(prompt, MAX_TOKENS, kv_transfer_params=params),
            timeout=ANSWER_S,
        )
    except requests.Timeout:
        return Outcome(0, time.monotonic() - start, "no answer (timeout)", None)
    seconds = time.monotonic() - start
    tokens = None
    if got.status_code == 200:
        choice = got.json()["choices"][0]
        if choice.get("finish_reason") in ("length", "stop"):
            tokens = choice.get("token_ids")
    return Outcome(got.status_code, seconds, got.text[:1000], tokens)


def prompt(salt: int) -> list[int]:
    # 45 tokens: three 16-token blocks (two 32-token ones), the last partial.
    # Ids below the tiny vocabulary (a few thousand).
    return [(salt * 7919 + i * 104729) % 1000 + 10 for i in range(45)]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_geometry_refused_and_negative_control(servers: Servers, case: Case) -> None:
    s = servers
    argv, env = serve.command("decode", PROFILE, "cpu", HOST)
    name = f"decode-{case.name}"
    prefill_before = len(s.log("prefill"))
    s.procs.launch(name, case.change(argv), env, s.decode)
    try:
        s.procs.wait_healthy(name, supervisor.SERVER_DEADLINE_S)
        s.fault_file.unlink(missing_ok=True)
        salt = 100 * (CASES.index(case) + 1)
        # Prefill's own answer (the reference configuration, float32: what a
        # correct transfer gives). Not decode's: its prefix cache would then
        # hold the prompt and the pull below would not carry it.
        reference = client.complete(s.prefill, prompt(salt), MAX_TOKENS).token_ids

        refused = pd_request(s, prompt(salt + 1))
        print(f"{case.name}: with the check: {refused}")
        assert not refused.answered, refused
        assert refused.seconds < ANSWER_S
        decode_log = s.log(name)
        reason = [ln for ln in decode_log.splitlines() if "KV geometry differs" in ln]
        assert reason, "decode logged no geometry refusal"
        for word in case.names:
            assert word in reason[0], (word, reason[0])
        # A second refused pull from the same decode: no second line.
        assert not pd_request(s, prompt(salt + 2)).answered
        refusals = [
            ln
            for ln in s.log("prefill")[prefill_before:].splitlines()
            if "refusing pulls from decode" in ln and "KV geometry" in ln
        ]
        assert len(refusals) == 1, refusals
        assert case.names[1] in refusals[0]

        # The negative control: prefill serves the pull unchecked.
        before = len(s.log(name))
        s.fault_file.write_text(faults.SKIP_GEOMETRY_CHECK)
        unchecked = pd_request(s, prompt(salt))
        s.fault_file.unlink()
        after = s.log(name)[before:]
        failures = [ln for ln in after.splitlines() if "failed" in ln.lower()]
        print(f"{case.name}: unchecked: {unchecked}; reference {reference}")
        print(f"{case.name}: decode's failure lines unchecked: {failures[:3]}")
        wrong_tokens = unchecked.answered and unchecked.token_ids != reference
        failed_elsewhere = not unchecked.answered and not any(
            "KV geometry" in ln for ln in failures
        )
        hang = unchecked.status == 0
        # Unchecked, the same pull must go wrong: wrong tokens, a failure
        # that names no flag, or a hang; never a correct answer.
        assert wrong_tokens or failed_elsewhere or hang, unchecked
    finally:
        s.procs.stop([name])


def test_block_size_flag_overridden_states_what_runs(servers: Servers) -> None:
    s = servers
    argv, env = serve.command("decode", PROFILE, "cpu", HOST)
    name = "decode-block_size_32"
    s.procs.launch(name, _swap(argv, "--block-size", "32"), env, s.decode)
    try:
        s.procs.wait_healthy(name, supervisor.SERVER_DEADLINE_S)
        s.fault_file.unlink(missing_ok=True)
        log = s.log(name)
        assert "overriding user-specified block_size=32" in log
        stated = [
            ln for ln in log.splitlines() if "PD Mooncake geometry (decode)" in ln
        ]
        assert stated and "block_size=16 " in stated[0], stated
        reference = client.complete(s.prefill, prompt(900), MAX_TOKENS).token_ids
        got = pd_request(s, prompt(900))
        print(f"block size 32 asked, 16 run: {got}; reference {reference}")
        assert got.answered and got.token_ids == reference, got
    finally:
        s.procs.stop([name])
