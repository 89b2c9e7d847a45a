"""The twin's process handling: stops exactly what it started, waits with deadlines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pdstack import supervisor, twin, wait

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
# A leader that forks a child, as vLLM's API server forks its engine core.
FORK = f"import subprocess, time; subprocess.Popen({SLEEPER!r}); time.sleep(600)"
FORKING = [sys.executable, "-c", FORK]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group(pgid: int) -> list[int]:
    return [int(p) for p in os.popen(f"pgrep -g {pgid}").read().split()]


def until_forked(pgid: int) -> list[int]:
    return wait.poll(lambda: group(pgid), lambda g: len(g) == 2, 10, "the fork")


def test_down_stops_the_recorded_processes_and_their_children(tmp_path: Path) -> None:
    procs = twin.processes(tmp_path, progress=lambda _: None)
    prefill = procs.launch("prefill", FORKING, {})
    procs.launch("decode", SLEEPER, {})
    bystander = subprocess.Popen(SLEEPER)
    members = until_forked(prefill.pid)
    try:
        twin.down(tmp_path, progress=lambda _: None)
        assert twin.running(tmp_path) == {}
        assert not any(alive(pid) for pid in members)
        assert alive(bystander.pid), "down() must not touch processes it did not start"
    finally:
        bystander.kill()
        bystander.wait()


def test_down_stops_the_orphans_of_a_leader_killed_alone(tmp_path: Path) -> None:
    """As the OOM killer does to decode's API server: its engine core and
    workers live on as orphans of init; `down` must still stop them, and say so."""
    said: list[str] = []
    leader = twin.processes(tmp_path, said.append).launch("decode", FORKING, {})
    (orphan,) = set(until_forked(leader.pid)) - {leader.pid}
    leader.send_signal(signal.SIGKILL)
    leader.wait()
    assert alive(orphan) and twin.running(tmp_path) == {}
    twin.down(tmp_path, progress=said.append)
    assert not alive(orphan)
    assert group(leader.pid) == []
    assert any(f"is gone but left {sys.executable}" in line for line in said), said
    assert any(f"(pid {orphan})" in line for line in said), said


def test_a_reused_pid_is_not_ours(tmp_path: Path) -> None:
    proc = subprocess.Popen(SLEEPER, start_new_session=True)
    try:
        entry = {"pid": proc.pid, "create_time": 1.0, "pgid": proc.pid}
        (tmp_path / "processes.json").write_text(json.dumps({"prefill": entry}))
        assert twin.running(tmp_path) == {}
        # Nor is its process group: the number names a group started later.
        (record,) = twin.processes(tmp_path).records().values()
        assert record.members() == []
        twin.down(tmp_path, progress=lambda _: None)
        assert alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_a_group_whose_number_was_reused_is_not_ours() -> None:
    proc = subprocess.Popen(FORKING, start_new_session=True)
    try:
        until_forked(proc.pid)
        # Recorded later than this group began: another group had the number.
        later = supervisor.Record(proc.pid, time.time() + 60, proc.pid)
        assert later.leader() is None and later.members() == []
        supervisor.stop({"decode": later}, progress=lambda _: None)
        assert len(group(proc.pid)) == 2
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_wait_fails_fast_with_the_log_tail_when_the_process_dies(
    tmp_path: Path,
) -> None:
    log = tmp_path / "prefill.log"
    boom = [sys.executable, "-c", "print('boom: no model'); raise SystemExit(3)"]
    proc = twin.processes(tmp_path, progress=lambda _: None).launch("prefill", boom, {})
    start = time.monotonic()
    with pytest.raises(wait.WaitError, match=r"(?s)exited with code 3.*boom: no model"):
        wait.until_healthy("prefill", "http://127.0.0.1:9", 60, proc, log)
    assert time.monotonic() - start < 10


def test_wait_has_a_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(wait.WaitError, match="not healthy"):
        wait.until_healthy("x", "http://127.0.0.1:9", 1.5, interval_s=0.2)
    assert time.monotonic() - start < 5


def test_a_log_tail_leaves_out_health_and_metrics_polls(tmp_path: Path) -> None:
    """A failing fault case once showed 30 lines of health checks and none of
    the server's errors."""
    log = tmp_path / "decode.log"
    log.write_text(
        "ERROR pulling kv_caches failed: Timeout waiting for P side ready.\n"
        + 'INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK\n' * 50
        + 'INFO:     127.0.0.1:1 - "GET /metrics HTTP/1.1" 200 OK\n' * 50
        + 'INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 500\n'
    )
    assert wait.tail(log, 2).splitlines() == [
        "ERROR pulling kv_caches failed: Timeout waiting for P side ready.",
        'INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 500',
    ]
    assert wait.tail(tmp_path / "missing.log") == "(no log)"


def test_poll_returns_the_first_value_done_and_reports_the_last_on_timeout() -> None:
    values = iter(range(100))
    assert wait.poll(lambda: next(values), lambda v: v >= 3, 5.0, "three") == 3
    with pytest.raises(wait.WaitError, match=r"waiting for never.*last seen: 'x'"):
        wait.poll(lambda: "x", lambda v: False, 0.3, "never", interval_s=0.05)


@pytest.mark.skipif(
    os.environ.get("PD_TWIN_KILL_TEST") != "1",
    reason="starts the CPU twin (minutes on 2 cores): set PD_TWIN_KILL_TEST=1",
)
def test_down_stops_the_engine_core_of_a_decode_killed_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured before the supervisor: decode's API server alone SIGKILLed (a
    crash, the OOM killer), its VLLM::EngineCore and VLLM::Worker lived on as
    orphans of init holding 2.2 GiB, and `make down-cpu` said nothing."""
    # Its own consecutive free ports (another twin may run here); the side
    # channel, the one after the bootstrap port, last.
    while True:
        base = supervisor.free_port()
        ports = range(base, base + 6)
        if base + 6 < 65536 and not any(map(supervisor.port_in_use, ports)):
            break
    names = ("ROUTER_PORT", "PREFILL_PORT", "DECODE_PORT", "ROUTER_METRICS_PORT")
    for name, port in zip((*names, "BOOTSTRAP_PORT"), ports, strict=False):
        monkeypatch.setenv(name, str(port))
    said: list[str] = []
    twin.up(run_dir=tmp_path, progress=said.append)
    try:
        decode = twin.processes(tmp_path).records()["decode"]
        orphans = [p for p in decode.members() if p.pid != decode.pid]
        titles = [supervisor.describe(p) for p in orphans]
        assert any("VLLM::EngineCore" in t for t in titles), titles
        os.kill(decode.pid, signal.SIGKILL)  # the API server only
        psutil.wait_procs([psutil.Process(decode.pid)], timeout=30)
        assert "decode" not in twin.running(tmp_path)
        assert all(p.is_running() for p in orphans), titles
    finally:
        twin.down(tmp_path, progress=said.append)
    assert decode.members() == [] and group(decode.pgid) == []
    assert not any(alive(p.pid) for p in orphans)
    (report,) = [line for line in said if "is gone but left" in line]
    assert report.startswith(f"decode (pid {decode.pid}) is gone"), report
    assert all(title in report for title in titles), (report, titles)
