"""The twin's process handling: stops exactly what it started, waits with deadlines."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdstack import twin, wait

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def alive(pid: int) -> bool:
    return twin._start_time(pid) is not None


def test_down_stops_the_recorded_processes_and_their_children(tmp_path: Path) -> None:
    # A leader that forks a child, as vLLM's API server forks its engine core.
    forking = [
        sys.executable,
        "-c",
        f"import subprocess, sys, time; subprocess.Popen({SLEEPER!r}); time.sleep(600)",
    ]
    procs = {
        "prefill": twin.launch("prefill", forking, {}, tmp_path),
        "decode": twin.launch("decode", SLEEPER, {}, tmp_path),
    }
    twin._record(tmp_path, procs)
    bystander = subprocess.Popen(SLEEPER)
    time.sleep(1.0)
    group = [
        int(p) for p in os.popen(f"pgrep -g {procs['prefill'].pid}").read().split()
    ]
    assert len(group) == 2, group
    try:
        twin.down(tmp_path, progress=lambda _: None)
        assert twin.running(tmp_path) == {}
        assert not any(alive(pid) for pid in group)
        assert alive(bystander.pid), "down() must not touch processes it did not start"
    finally:
        bystander.kill()
        bystander.wait()


def test_a_reused_pid_is_not_ours(tmp_path: Path) -> None:
    proc = subprocess.Popen(SLEEPER)
    try:
        state = tmp_path / "processes.json"
        state.write_text(f'{{"prefill": {{"pid": {proc.pid}, "start": "1"}}}}')
        assert twin.running(tmp_path) == {}
    finally:
        proc.kill()
        proc.wait()


def test_wait_fails_fast_with_the_log_tail_when_the_process_dies(
    tmp_path: Path,
) -> None:
    log = tmp_path / "prefill.log"
    proc = twin.launch(
        "prefill",
        [sys.executable, "-c", "print('boom: no model'); raise SystemExit(3)"],
        {},
        tmp_path,
    )
    start = time.monotonic()
    with pytest.raises(
        wait.WaitError, match=r"exited with code 3(.|\n)*boom: no model"
    ):
        wait.until_healthy("prefill", "http://127.0.0.1:9", 60, proc, log)
    assert time.monotonic() - start < 10


def test_wait_has_a_deadline(tmp_path: Path) -> None:
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
    from pdstack import wait

    values = iter(range(100))
    assert wait.poll(lambda: next(values), lambda v: v >= 3, 5.0, "three") == 3
    with pytest.raises(wait.WaitError, match=r"waiting for never.*last seen: 'x'"):
        wait.poll(lambda: "x", lambda v: False, 0.3, "never", interval_s=0.05)
