"""Bring a compose stack up, showing what it is doing (``make up``).

    python -m pdstack.compose_wait --deadline 30m -- docker compose -f ...

Runs ``up -d --remove-orphans`` with that compose command. ``docker compose
up --wait`` says nothing for as long as a model downloads and loads (up to
the start period: 30 minutes); this polls ``compose ps`` meanwhile and prints
a line whenever a service's state changes, and every 30 s the services still
starting with the last line of their logs. It ends when ``up`` has and every
service is running and healthy (a one-shot service, having exited 0), and
fails naming the service, with its log's tail, when one exits or turns
unhealthy, or when the deadline passes.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

POLL_S = 3.0
NOTE_EVERY_S = 30.0
LOG_TAIL = 30
UNITS = {"s": 1, "m": 60, "h": 3600}


class StackError(RuntimeError):
    pass


@dataclass(frozen=True)
class Service:
    name: str
    state: str  # created, running, restarting, exited, ...
    health: str  # healthy, unhealthy, starting, or "" (no health check)
    exit_code: int

    @property
    def done(self) -> bool:
        """Up and healthy, or a one-shot that succeeded."""
        if self.state == "running":
            return self.health in ("", "healthy")
        return self.state == "exited" and self.exit_code == 0

    @property
    def failed(self) -> bool:
        return self.health == "unhealthy" or (
            self.state in ("exited", "dead") and self.exit_code != 0
        )

    def describe(self) -> str:
        if self.state == "exited":
            return f"exited {self.exit_code}"
        return self.state + (f" ({self.health})" if self.health else "")


def duration(text: str) -> float:
    """'30m', '90s', '1h', '1h30m' or plain seconds."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+)([smh])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30m, 90s)")
    return float(sum(int(n) * UNITS[u] for n, u in parts))


def parse_ps(output: str) -> list[Service]:
    """``compose ps --format json``: one object per line (compose 2.2x and
    later) or one array (earlier)."""
    text = output.strip()
    if not text:
        return []
    rows = (
        json.loads(text)
        if text.startswith("[")
        else [json.loads(line) for line in text.splitlines() if line.strip()]
    )
    return [
        Service(
            row["Service"],
            row.get("State", ""),
            row.get("Health", ""),
            int(row.get("ExitCode", 0) or 0),
        )
        for row in rows
    ]


def services(compose: Sequence[str]) -> list[Service]:
    result = subprocess.run(
        [*compose, "ps", "--all", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise StackError(f"compose ps failed: {result.stderr.strip()}")
    return parse_ps(result.stdout)


def log_tail(compose: Sequence[str], service: str, lines: int) -> str:
    result = subprocess.run(
        [
            *compose,
            "logs",
            "--no-color",
            "--no-log-prefix",
            "--tail",
            str(lines),
            service,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return (result.stdout + result.stderr).rstrip()


def wait(
    compose: Sequence[str],
    deadline_s: float,
    progress: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    up: subprocess.Popen | None = None,
) -> list[Service]:
    """Poll until ``up`` (compose's own process, if given) has ended and
    every service is done; raise StackError naming the first that failed, or
    those still starting at the deadline."""
    start = clock()
    seen: dict[str, str] = {}
    last_note = start
    while True:
        if up is not None and up.poll() not in (None, 0):
            raise StackError(
                f"`compose up` failed (exit {up.returncode}); above it said why"
            )
        current = services(compose)
        if not current and up is None:
            raise StackError("no containers: did `compose up` run?")
        for svc in current:
            if seen.get(svc.name) != svc.describe():
                seen[svc.name] = svc.describe()
                progress(f"[{clock() - start:5.0f}s] {svc.name}: {svc.describe()}")
        if failed := [s for s in current if s.failed]:
            name = failed[0].name
            tail = log_tail(compose, name, LOG_TAIL)
            raise StackError(f"{name} {failed[0].describe()}; its log ends:\n{tail}")
        pending = [s for s in current if not s.done]
        if not pending and current and (up is None or up.poll() == 0):
            progress(f"[{clock() - start:5.0f}s] all {len(current)} services up")
            return current
        now = clock()
        if now - start > deadline_s:
            names = ", ".join(s.name for s in pending)
            raise StackError(
                f"not up after {deadline_s:.0f} s: {names} (PD_START_PERIOD sets "
                f"the wait); last log lines:\n"
                + "\n".join(
                    f"{s.name}: {log_tail(compose, s.name, 5)}" for s in pending
                )
            )
        if now - last_note >= NOTE_EVERY_S:
            last_note = now
            for svc in pending:
                last = (log_tail(compose, svc.name, 1).splitlines() or [""])[-1]
                line = f"{svc.name} still {svc.describe()}: {last[:160]}"
                progress(f"[{now - start:5.0f}s] {line}")
        sleep(POLL_S)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--deadline", type=duration, default=duration("30m"))
    parser.add_argument("compose", nargs="+", help="the compose command, after --")
    opts = parser.parse_args(argv)
    # compose's own lines (creating, starting) go to this terminal as they come.
    up = subprocess.Popen([*opts.compose, "up", "-d", "--remove-orphans"])
    try:
        wait(opts.compose, opts.deadline, lambda line: print(line, flush=True), up=up)
    except (StackError, subprocess.TimeoutExpired) as exc:
        sys.exit(f"compose_wait: {exc}")
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(timeout=30)


if __name__ == "__main__":
    main()
