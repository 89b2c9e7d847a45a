"""The TP 2 twin's first burst on a cold machine, timed (issue 28).

    PD_TENSOR_PARALLEL_SIZE=2 python scripts/tp2_stall_check.py [--rounds 3]
    ... --env TORCHDYNAMO_DISABLE=0   # control: torch.compile in the servers
    ... --unpin                       # control: both roles on every CPU

Starts the twin (both roles at TP 2 unless PD_TENSOR_PARALLEL_SIZE says
otherwise) with an empty inductor cache, as on a fresh CI machine, and sends
what e2e's oracle calibration sends: 16 prompts of 24 + 17 i tokens to the
colocated reference (prefill) one by one, then the same 16 at once through
the router, 16 tokens each with top-5 log-probabilities. A round that is not
answered within ``--stall-s`` is a stall: decode's /health is timed, the
server processes' threads (CPU ticks, state) and sockets are saved, each
Python process writes its threads' stacks into its role's log (faulthandler,
SIGUSR2), and gdb's native stacks of the engine cores and workers follow.
Per-thread CPU time is sampled every 2 s into ``threads.jsonl`` throughout.
Exit status 1 on a stall. Everything it started is stopped on exit.
Docs: docs/reliability.md, "TP 2 on 2 cores".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from pathlib import Path
from typing import IO, Any

import psutil
import requests

from pdstack import client, twin
from pdstack.compose import ROOT

PROMPTS = 16
TOKENS = 16
TRACE = {"logprobs": 5, "return_tokens_as_token_ids": True}
CORPUS = (
    "The prefill server computes the key and value cache of the prompt and the "
    "decode server receives it over the network, then generates the answer one "
    "token at a time. Operators need proof that the cache really crossed. "
)
# Loaded by every Python process of the twin (PYTHONPATH): stacks on SIGUSR2.
SITECUSTOMIZE = """import faulthandler, signal
faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)
"""


def members(run_dir: Path) -> dict[str, list[psutil.Process]]:
    procs = twin.processes(run_dir, progress=lambda _: None)
    return {
        name: r.members() for name, r in procs.records().items() if name != "router"
    }


def title(proc: psutil.Process) -> str:
    try:
        return (proc.cmdline() or [proc.name()])[0][:48]
    except psutil.Error:
        return "?"


def threads(pid: int) -> list[dict[str, Any]]:
    """Each thread's name, state and CPU ticks (utime + stime) from /proc."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2 :].split()
        out.append(
            {
                "tid": int(task.name),
                "comm": stat[stat.index("(") + 1 : stat.rindex(")")],
                "state": rest[0],
                "ticks": int(rest[11]) + int(rest[12]),
            }
        )
    return out


def snapshot(run_dir: Path) -> list[dict[str, Any]]:
    return [
        {"role": role, "pid": p.pid, "title": title(p), "threads": threads(p.pid)}
        for role, procs in members(run_dir).items()
        for p in procs
    ]


def sample(run_dir: Path, out: IO[str], stop: threading.Event) -> None:
    while not stop.wait(2.0):
        now = time.time()
        for entry in snapshot(run_dir):
            out.write(json.dumps({"t": now, **entry}) + "\n")
        out.flush()


def capture(run_dir: Path, tag: str) -> Path:
    """Threads, sockets and stacks of every server process, now."""
    dest = run_dir / f"capture-{tag}"
    dest.mkdir(exist_ok=True)
    (dest / "threads.json").write_text(json.dumps(snapshot(run_dir), indent=1))
    ps = ["ps", "-eLo", "pid,tid,ppid,ni,psr,stat,time,comm"]
    (dest / "ps.txt").write_text(
        subprocess.run(ps, capture_output=True, text=True).stdout
    )
    ss = subprocess.run(["ss", "-tinp"], capture_output=True, text=True).stdout
    (dest / "ss.txt").write_text(ss)
    found = [p for procs in members(run_dir).values() for p in procs]
    for proc in found:
        try:
            proc.send_signal(signal.SIGUSR2)
        except psutil.Error:
            continue
    for proc in found:
        name = title(proc)
        if not name.startswith("VLLM::"):
            continue
        try:
            gdb = subprocess.run(
                ["gdb", "-p", str(proc.pid), "-batch", "-ex", "thread apply all bt 25"],
                capture_output=True,
                text=True,
                timeout=120,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        path = dest / f"gdb-{proc.pid}-{name.replace(':', '_')}.txt"
        path.write_text(gdb.stdout + gdb.stderr)
    return dest


def unpin(run_dir: Path) -> None:
    """Every thread of both roles back on every CPU (new threads inherit it):
    the twin as it ran before it kept the roles apart (pdstack.twin.role_cpus)."""
    cpus = os.sched_getaffinity(0)
    for procs in members(run_dir).values():
        for proc in procs:
            for task in Path(f"/proc/{proc.pid}/task").glob("*"):
                try:
                    os.sched_setaffinity(int(task.name), cpus)
                except OSError:
                    continue


def health_seconds(url: str) -> float | None:
    """Seconds decode took to answer /health; None: not within 10 s."""
    start = time.monotonic()
    try:
        requests.get(f"{url}/health", timeout=10)
    except requests.RequestException:
        return None
    return time.monotonic() - start


def prompts(base: list[int], round_: int) -> list[list[int]]:
    out = []
    for i in range(PROMPTS):
        length = 24 + 17 * i
        start = (round_ * 131 + i * 7919) % len(base)
        out.append(((base[start:] + base) * (length // len(base) + 2))[:length])
    return out


def run_round(
    u: Any, base: list[int], round_: int, stall_s: float, run_dir: Path
) -> dict[str, Any]:
    batch = prompts(base, round_)
    for prompt in batch:
        client.complete(u.prefill, prompt, TOKENS, **TRACE)
    start = time.monotonic()
    record: dict[str, Any] = {"round": round_, "stalled": False}
    with ThreadPoolExecutor(PROMPTS) as pool:
        futures = [
            pool.submit(client.complete, u.router, p, TOKENS, **TRACE) for p in batch
        ]
        _, pending = wait_all(futures, timeout=stall_s)
        if pending:
            record.update(
                stalled=True,
                pending_at_stall=len(pending),
                decode_health_s=health_seconds(u.decode),
                capture=str(capture(run_dir, f"r{round_}")),
            )
            wait_all(futures)
        record["errors"] = [repr(f.exception())[:300] for f in futures if f.exception()]
    record["seconds"] = round(time.monotonic() - start, 1)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stall-s", type=float, default=40.0)
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="added to both servers' environment, over configs/targets/cpu.yaml's",
    )
    parser.add_argument(
        "--unpin",
        action="store_true",
        help="both roles on every CPU: the control of pdstack.twin.role_cpus",
    )
    parser.add_argument("--warm", action="store_true", help="keep the inductor cache")
    parser.add_argument("--run-dir", type=Path, default=ROOT / "run" / "tp2-stall")
    opts = parser.parse_args(argv)
    run_dir: Path = opts.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PD_TENSOR_PARALLEL_SIZE", "2")
    (run_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, (str(run_dir), os.environ.get("PYTHONPATH")))
    )
    env = dict(item.split("=", 1) for item in opts.env)
    if not opts.warm:
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    # A timeout's SIGTERM stops the twin too (the finally below).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    result: dict[str, Any] = {"env": env, "rounds": []}
    u = twin.up(run_dir=run_dir, role_env={"prefill": env, "decode": env})
    if opts.unpin:
        unpin(run_dir)
    result["cpus"] = {
        role: sorted(os.sched_getaffinity(procs[0].pid))
        for role, procs in members(run_dir).items()
        if procs
    }
    stop = threading.Event()
    with (run_dir / "threads.jsonl").open("w") as out:
        sampler = threading.Thread(target=sample, args=(run_dir, out, stop))
        sampler.start()
        try:
            base = client.tokenize(u.prefill, CORPUS * 40)
            for round_ in range(opts.rounds):
                record = run_round(u, base, round_, opts.stall_s, run_dir)
                result["rounds"].append(record)
                print(f"[tp2-stall] {json.dumps(record)}", flush=True)
        finally:
            stop.set()
            sampler.join()
            twin.down(run_dir)
            if not opts.warm:
                shutil.rmtree(env["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
            (run_dir / "result.json").write_text(json.dumps(result, indent=1))
    stalled = [r for r in result["rounds"] if r["stalled"] or r["errors"]]
    return 1 if stalled else 0


if __name__ == "__main__":
    sys.exit(main())
