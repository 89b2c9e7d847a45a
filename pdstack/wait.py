"""Waiting with deadlines: every wait in the stack ends, and says why."""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import requests

T = TypeVar("T")


class WaitError(RuntimeError):
    pass


def poll(
    probe: Callable[[], T],
    done: Callable[[T], bool],
    deadline_s: float,
    what: str,
    interval_s: float = 0.25,
    describe: Callable[[T], str] = repr,
    progress: Callable[[str], None] | None = None,
) -> T:
    """The one poll loop: call ``probe`` until ``done(value)``, at most
    ``deadline_s`` seconds; returns the last value.

    On the deadline it raises :class:`WaitError` saying what it waited for
    and the last value seen (``describe``), so a failure carries its numbers.
    ``progress`` gets a line every 15 s on long waits.
    """
    start = time.monotonic()
    last_note = start
    while True:
        value = probe()
        if done(value):
            return value
        now = time.monotonic()
        if now - start >= deadline_s:
            raise WaitError(
                f"gave up after {deadline_s:.1f}s waiting for {what}; "
                f"last seen: {describe(value)}"
            )
        if progress is not None and now - last_note >= 15.0:
            progress(f"  ... waiting for {what} ({now - start:.0f}s)")
            last_note = now
        time.sleep(min(interval_s, max(0.0, start + deadline_s - now)))


# Access-log lines of pollers: they bury a server's last words.
POLLING = re.compile(r'"GET /(health|metrics)[ ?]')


def poll_last(
    probe: Callable[[], T], done: Callable[[T], bool], *args: Any, **options: Any
) -> tuple[float, T]:
    """:func:`poll` (the same arguments) that hands back (seconds, last value)
    at the deadline instead of raising: the caller records or asserts on what
    it saw."""
    start = time.monotonic()
    seen: list[T] = []

    def keep() -> T:
        seen.append(probe())
        return seen[-1]

    with contextlib.suppress(WaitError):
        poll(keep, done, *args, **options)
    return time.monotonic() - start, seen[-1]


def tail(path: Path, lines: int = 40) -> str:
    """The log's last ``lines`` lines, health and metrics polls left out."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    kept = [line for line in text.splitlines() if not POLLING.search(line)]
    return "\n".join(kept[-lines:])


def healthy(url: str, timeout: float = 2.0, path: str = "/health") -> bool:
    try:
        return requests.get(f"{url}{path}", timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


def until_healthy(
    name: str,
    url: str,
    deadline_s: float,
    process: subprocess.Popen | None = None,
    log: Path | None = None,
    progress: Callable[[str], None] = print,
    interval_s: float = 1.0,
) -> float:
    """Poll ``url/health`` until 200, failing early if ``process`` exits;
    returns the seconds it took."""
    start = time.monotonic()

    def last_lines() -> str:
        return f"last lines of {log}:\n{tail(log) if log else ''}"

    def answered() -> bool:
        if healthy(url):
            return True
        if process is not None and process.poll() is not None:
            raise WaitError(
                f"{name} exited with code {process.returncode} before it was "
                f"healthy; {last_lines()}"
            )
        return False

    poll(
        answered,
        bool,
        deadline_s,
        f"{name} at {url}/health",
        interval_s,
        describe=lambda _: f"not healthy; {last_lines()}",
        progress=progress,
    )
    return time.monotonic() - start
