"""The KV transfer path's cost in counts that do not depend on the cores being
quiet (docs/bench.md, "Transfer cost"): Mooncake descriptors per request
against prompt length, and CPU-seconds of the transfer threads per GiB moved
against Mooncake's engine alone moving the same bytes.

Per state (STATES: staged as configured, direct for comparison, and staged
with the KV checksum off, its digests apart), on a stack just (re)started
(fresh block lists): one request at each length of a ladder from 128 tokens
to max-model-len, then a burst of mixed requests that
shuffles both servers' free block lists, then the ladder again (fragmented).
Each request is sent as the router sends it, in two legs (bench.router_capture:
prefill computes, then decode pulls the KV): the CPU time both servers'
transfer threads spent (``/proc/<pid>/task/*/stat``) is read around the
decode leg only, which holds the transfer but not prefill's forward pass
(tens of seconds at max-model-len on the twin, during which the threads'
idle burn would swamp the transfer's); prefill's counter deltas
(bench.kv_transfer) around it too.

Which threads: Mooncake's (C++, asio) and the connector's (Python pools and
event loops) have no names of their own: read from /proc, each carries its
process's name (``python`` in a loopback engine, ``VLLM::Worker`` in vLLM's
worker; seen 2026-12-02), while the other libraries in the worker name
theirs (``ZMQbg/IO/0``, ``gloo_tcp_loop``, ``pt_gloo_runloop``). So the
transfer threads are, in the process that maps Mooncake's engine (vLLM's
worker), the threads bearing the process's name but the main one, which
runs the forward pass. Their CPU over a request also holds what they burn
idle; that idle rate is measured before each pass and subtracted (both
figures are kept, and every thread name's CPU beside them).

The engine alone runs right after each pass, the stack up and idle
(Reference: the machine as the pass found it). It is called as upstream
calls it, ``batch_transfer_sync_write``, which spins on the batch's status
in the calling thread until it is done (stall_guard's docstring): about
half its CPU on the twin (0.66 of 1.26-1.38 CPU-s/GiB at 152 MiB,
2026-12-03). The plugin's sends do not spin (stall_guard), so the
comparison is also made against the engine's own threads, the caller's
wait left out (``engine_threads``): the stricter one.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from bench import kv_checksum, kv_path, kv_transfer, router_capture
from bench.levels import GIB, fmt, read_json, table
from pd_mooncake import staging
from pdstack import client
from pdstack import metrics as m
from pdstack.supervisor import Urls

FILE = "transfer_cost.json"
# The engine alone's processes' output (Mooncake's log lines).
ENGINE_LOG = "transfer_cost_engine.log"
OUTPUT_TOKENS = 2
# Token ids of the prompts: inside every tiny model's vocabulary (1024), past
# the special tokens.
TOKEN_IDS = (10, 1000)
IDLE_S = 5.0
SETTLE_S = 60.0
REQUEST_TIMEOUT_S = 600.0
# Targets (issue 26): descriptors at most ceil(bytes / 1 MiB) + one per
# region; CPU per GiB at most this times the engine alone's.
CPU_RATIO_TARGET = 1.5
# Step 9's states: kv_path's, then staged with the KV checksum off. The
# checksum (on in configs/vllm) is a feature of its own, not the transfer
# path's: its digests (one per side) are shown apart, the judged figure is
# the stack as configured. Last, so the first two keep their seeds.
UNCHECKED = "staged, no checksum"
STATES = (*kv_path.STATES, UNCHECKED)
STATE_ENV: dict[str, dict[str, str]] = {
    **kv_path.STATE_ENV,
    UNCHECKED: {kv_checksum.ENV: "0"},
}
# The engine alone: each size written at least 3 times and this many bytes
# in all (CPU time is counted in 10 ms ticks: about 3 at 1 GiB/CPU-s per
# 32 MiB).
ENGINE_BYTES = 512 << 20
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- CPU time of threads, from /proc ------------------------------------------------
def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each live thread of ``pid``: (its name, CPU seconds user + system)."""
    out = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return {}
    for task in tasks:
        try:
            text = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        name = text[text.index("(") + 1 : text.rindex(")")]
        # Fields after the name, from field 3 (state): utime is 14, stime 15.
        rest = text[text.rindex(")") + 2 :].split()
        out[int(task.name)] = (name, (int(rest[11]) + int(rest[12])) / CLK_TCK)
    return out


def is_transfer_thread(pid: int, tid: int, name: str, process_name: str) -> bool:
    """Unnamed (bearing the process's name), and not the main thread."""
    return tid != pid and name == process_name


def by_name(
    before: Mapping[int, tuple[str, float]], after: Mapping[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds per thread name between two thread_cpu readings (a thread
    new since ``before`` from zero; one that ended is lost)."""
    out: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        out[name] = out.get(name, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    return out


def transfer_seconds(
    pid: int,
    before: Mapping[int, tuple[str, float]],
    after: Mapping[int, tuple[str, float]],
) -> float:
    """CPU seconds the transfer threads of ``pid`` spent between two
    thread_cpu readings (a thread new since ``before`` from zero)."""
    process_name = after.get(pid, before.get(pid, ("", 0.0)))[0]
    return sum(
        cpu - before.get(tid, (name, 0.0))[1]
        for tid, (name, cpu) in after.items()
        if is_transfer_thread(pid, tid, name, process_name)
    )


def engine_process(root: int) -> int | None:
    """The process of ``root``'s tree that maps Mooncake's engine and has the
    most threads (vLLM's worker; the API server may import the plugin too)."""
    try:
        tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return None
    found = []
    for proc in tree:
        try:
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            if "mooncake" in maps and "engine" in maps:
                found.append((proc.num_threads(), proc.pid))
        except (OSError, psutil.Error):
            continue
    return max(found)[1] if found else None


class Meter:
    """Transfer-thread CPU of a set of processes between two readings."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)

    def read(self) -> dict[str, dict[int, tuple[str, float]]]:
        return {role: thread_cpu(pid) for role, pid in self.pids.items()}

    def seconds(
        self, before: Mapping[str, Any], after: Mapping[str, Any]
    ) -> dict[str, float]:
        return {
            role: transfer_seconds(pid, before[role], after[role])
            for role, pid in self.pids.items()
        }

    def names(
        self, before: Mapping[str, Any], after: Mapping[str, Any]
    ) -> dict[str, dict[str, float]]:
        """Per role, CPU seconds per thread name (the main thread apart)."""
        out = {}
        for role, pid in self.pids.items():
            main = {t: v for t, v in after[role].items() if t == pid}
            rest = {t: v for t, v in after[role].items() if t != pid}
            named = by_name(before[role], rest)
            named["(main thread)"] = sum(by_name(before[role], main).values())
            out[role] = named
        return out

    def idle_rate(self, seconds: float = IDLE_S) -> dict[str, float]:
        """CPU seconds per second the transfer threads burn with nothing sent."""
        before = self.read()
        time.sleep(seconds)
        used = self.seconds(before, self.read())
        return {role: s / seconds for role, s in used.items()}


# -- the requests ---------------------------------------------------------------------
def ladder(max_model_len: int, quick: bool) -> list[int]:
    """Prompt lengths from 128 tokens up, x2 (x8 quick), ending at the
    longest prompt the stack takes with OUTPUT_TOKENS to generate."""
    top = max_model_len - OUTPUT_TOKENS
    lengths, n = [], 128
    while n < top:
        lengths.append(n)
        n *= 8 if quick else 2
    return [*lengths, top]


def prompt(length: int, seed: int) -> list[int]:
    """Random token ids: distinct seeds share no cached prefix block."""
    rng = random.Random(seed)
    return [rng.randrange(*TOKEN_IDS) for _ in range(length)]


@dataclass(frozen=True)
class Sample:
    """One request alone: what prefill's counters and /proc saw."""

    state: str
    name: str  # fresh or fragmented
    input_len: int
    counters: dict[str, float]
    cpu_s: dict[str, float]  # role -> transfer threads' CPU seconds
    idle_s: dict[str, float]  # role -> the idle rate times the request's time
    wall_s: float  # the decode leg's
    # role -> thread name -> CPU seconds, every thread (what was left out).
    threads: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def nbytes(self) -> float:
        return self.counters.get("bytes", 0.0)

    @property
    def descriptors(self) -> float:
        return self.counters.get("descriptors", 0.0)

    @property
    def staged(self) -> bool:
        return self.counters.get("gather_seconds", 0.0) > 0

    def net_cpu_s(self) -> float:
        """Both servers' transfer-thread CPU, their idle share taken out."""
        return sum(self.cpu_s.values()) - sum(self.idle_s.values())


def _post(url: str, body: Mapping[str, Any]) -> None:
    answer = requests.post(
        f"{url}/v1/completions",
        json=body,
        headers=client.headers(),
        timeout=REQUEST_TIMEOUT_S,
    )
    if answer.status_code != 200:
        raise client.CompletionError(f"{url}: HTTP {answer.status_code}: {answer.text}")


def one_request(
    urls: Urls, engine: str, meter: Meter, idle: Mapping[str, float],
    length: int, seed: int, state: str, name: str,
) -> Sample:  # fmt: skip
    bootstrap = router_capture.bootstrap_url(urls.prefill, urls.bootstrap_port)
    body = client.greedy(prompt(length, seed), OUTPUT_TOKENS)
    prefill_leg, decode_leg = router_capture.build_legs(body, engine, bootstrap)
    _post(urls.prefill, prefill_leg)
    before, cpu_before = kv_transfer.scrape(urls.prefill), meter.read()
    start = time.monotonic()
    _post(urls.decode, decode_leg)  # decode pulls the KV before answering
    wall = time.monotonic() - start
    cpu_after = meter.read()
    counters = kv_transfer.settle_delta(urls.prefill, before, 1, SETTLE_S)
    return Sample(state, name, length, counters, meter.seconds(cpu_before, cpu_after),
                  {role: rate * wall for role, rate in idle.items()}, wall,
                  meter.names(cpu_before, cpu_after))  # fmt: skip


def burst(router: str, seed: int, quick: bool, max_len: int) -> int:
    """Mixed prompt and output lengths, several at a time, finishing out of
    order: both servers' free block lists end up shuffled. Returns how many
    answered."""
    rng = random.Random(seed)
    count, width = (8, 4) if quick else (16, 8)
    jobs = [
        (prompt(rng.randrange(64, min(2048, max_len)), seed + i), rng.randrange(4, 48))
        for i in range(count)
    ]

    def send(job: tuple[list[int], int]) -> bool:
        try:
            client.complete(router, job[0], job[1], REQUEST_TIMEOUT_S)
        except (client.CompletionError, OSError):
            return False
        return True

    with ThreadPoolExecutor(width) as pool:
        return sum(pool.map(send, jobs))


def measure_state(
    state: str, urls: Urls, meter: Meter, lengths: Sequence[int],
    quick: bool, seed: int, progress: Callable[[str], None],
    after_pass: Callable[[str, list[Sample]], None] = lambda name, got: None,
) -> tuple[list[Sample], dict[str, Any]]:  # fmt: skip
    """One state on a stack just started: warm-up, fresh ladder, burst,
    fragmented ladder; ``after_pass`` is called with each pass's samples."""
    router = urls.router
    engine = router_capture.engine_id(
        router_capture.bootstrap_url(urls.prefill, urls.bootstrap_port)
    )
    # The warm-up opens Mooncake's connections (not counted).
    client.complete(router, prompt(128, seed - 1), OUTPUT_TOKENS, REQUEST_TIMEOUT_S)
    # Whether the KV checksum's digests are in the CPU figures.
    checksum = m.scrape(urls.prefill).total(m.CHECKSUM_ENABLED)
    samples, info = [], {"kv_checksum": bool(checksum)}
    for index, name in enumerate(kv_path.PASSES):
        if name == "fragmented":
            answered = burst(router, seed + 500, quick, lengths[-1])
            info["burst_answered"] = answered
            progress(f"  transfer cost '{state}': burst, {answered} answered")
        idle = meter.idle_rate()
        info[f"idle_rate_{name}"] = idle
        got = []
        for i, n in enumerate(lengths):
            sample = one_request(urls, engine, meter, idle, n,
                                 seed + 100 * index + i, state, name)  # fmt: skip
            got.append(sample)
            progress(
                f"  transfer cost '{state}' {name} {n} tokens: "
                f"{sample.descriptors:.0f} descriptors, {sample.nbytes / 2**20:.1f} "
                f"MiB, transfer threads {sample.net_cpu_s() * 1e3:.0f} ms CPU net"
            )
        samples += got
        after_pass(name, got)
    return samples, info


# -- the engine alone ------------------------------------------------------------
def engine_cpu(
    sizes: Iterable[int], least: int = ENGINE_BYTES, log: Path | None = None
) -> tuple[dict[int, float], dict[int, float]]:
    """Per size, CPU seconds per byte that two loopback engines spend
    writing it in CHUNK_BYTES descriptors, as the staged path submits a
    record: every thread of both processes, and every thread but the
    sender's main one (the caller, spinning in batch_transfer_sync_write
    until the write is done). Both processes are spawned: neither is this
    one; their output (Mooncake's log) goes to ``log`` if given."""
    from bench.loopback import Endpoint, Peer

    sizes = sorted(set(sizes))
    top = max(sizes)
    out, threads = {}, {}
    with (
        Peer(Endpoint, top, log=log) as receiver,
        Peer(Endpoint, top, log=log) as sender,
    ):
        session, dst_base = receiver.call("address")
        _, src_base = sender.call("address")
        pids = {"sender": sender.proc.pid, "receiver": receiver.proc.pid}
        whole = {role: pid for role, pid in pids.items()}

        def read() -> dict[str, dict[int, tuple[str, float]]]:
            return {role: thread_cpu(pid) for role, pid in whole.items()}

        # Untimed, the largest once: the buffers' pages are touched (a first
        # write's page faults are the allocator's, not the engine's).
        if sender.call("write", session, *staging.chunks(src_base, dst_base, top)):
            raise RuntimeError("engine alone: the warm-up write failed")
        for size in sizes:
            repeats = max(3, -(-least // size))
            src, dst, lens = staging.chunks(src_base, dst_base, size)
            before = read()
            for _ in range(repeats):
                if sender.call("write", session, src, dst, lens) != 0:
                    raise RuntimeError(f"engine alone: a {size}-byte write failed")
            after = read()
            used = {
                (role, tid): cpu - before[role].get(tid, ("", 0.0))[1]
                for role in whole
                for tid, (_, cpu) in after[role].items()
            }
            # Peer calls the write on the spawned process's main thread.
            caller = used.get(("sender", pids["sender"]), 0.0)
            out[size] = sum(used.values()) / (size * repeats)
            threads[size] = (sum(used.values()) - caller) / (size * repeats)
    return out, threads


# -- the run's JSON, the figures ----------------------------------------------------
@dataclass(frozen=True)
class Reference:
    """The engine alone (engine_cpu) at one pass's sizes, measured right
    after that pass with the stack up and idle, so that its requests are
    judged against the machine as they found it: in one make bench the
    first state's requests took 2-3x longer than an hour before while the
    engine alone, measured eight minutes later, had not moved (runs
    20261203-080639 and -081836, docs/evidence.md)."""

    state: str
    name: str
    per_byte: dict[int, float]
    threads_per_byte: dict[int, float]


@dataclass
class Result:
    samples: list[Sample]
    regions: int | None
    # The engine alone once for every pass: runs before each pass had its own
    # reference (before run 20261203-112435), and the tests' fixed figures.
    engine_cpu_per_byte: dict[int, float]
    info: dict[str, Any] = field(default_factory=dict)
    # The engine's own threads: engine_cpu_per_byte less its caller's spin.
    engine_threads_per_byte: dict[int, float] = field(default_factory=dict)
    references: list[Reference] = field(default_factory=list)

    def reference(self, sample: Sample) -> tuple[dict[int, float], dict[int, float]]:
        """The engine alone a sample is judged against: its pass's, else the
        run's (every thread, its own threads)."""
        for r in self.references:
            if (r.state, r.name) == (sample.state, sample.name):
                return r.per_byte, r.threads_per_byte
        return self.engine_cpu_per_byte, self.engine_threads_per_byte

    def bound(self, nbytes: float) -> int | None:
        """The most descriptors a request of ``nbytes`` may take."""
        if self.regions is None:
            return None
        return math.ceil(nbytes / staging.CHUNK_BYTES) + self.regions

    def over_bound(self, state: str = "staged") -> list[Sample]:
        return [
            s
            for s in self.samples
            if s.state == state
            and (b := self.bound(s.nbytes)) is not None
            and s.descriptors > b
        ]

    def engine_seconds(self, sample: Sample, threads: bool = False) -> float | None:
        """The engine alone's CPU seconds for the sample's bytes (its nearest
        size): every thread, or (``threads``) its own threads, the caller
        left out."""
        per_byte = self.reference(sample)[1 if threads else 0]
        nbytes = sample.nbytes
        if not per_byte or nbytes <= 0:
            return None
        size = min(per_byte, key=lambda s: abs(math.log(s / nbytes)))
        return per_byte[size] * nbytes

    def cpu_per_gib(self, state: str, name: str | None = None) -> dict[str, Any]:
        """Over a state's requests (one pass, or all): transfer threads' CPU
        per GiB moved (raw and net of idle) and the engine alone's for the
        same bytes."""
        chosen = [
            s
            for s in self.samples
            if s.state == state and name in (None, s.name) and s.nbytes > 0
        ]
        gib = sum(s.nbytes for s in chosen) / GIB
        if not chosen or not gib:
            return {}
        net = sum(s.net_cpu_s() for s in chosen) / gib

        def alone(threads: bool) -> float | None:
            engine = [self.engine_seconds(s, threads) for s in chosen]
            return sum(engine) / gib if None not in engine else None  # type: ignore[arg-type]

        whole, own = alone(False), alone(True)
        return {
            "requests": len(chosen), "gib": gib,
            "raw": sum(sum(s.cpu_s.values()) for s in chosen) / gib, "net": net,
            "engine_alone": whole, "ratio": net / whole if whole else None,
            "engine_threads": own, "ratio_threads": net / own if own else None,
        }  # fmt: skip


def to_json(result: Result) -> dict[str, Any]:
    return {
        "samples": [asdict(s) for s in result.samples],
        "regions": result.regions,
        "engine_cpu_per_byte": _by_size(result.engine_cpu_per_byte),
        "engine_threads_per_byte": _by_size(result.engine_threads_per_byte),
        "info": result.info,
        "references": [
            {"state": r.state, "pass": r.name, "per_byte": _by_size(r.per_byte),
             "threads_per_byte": _by_size(r.threads_per_byte)}
            for r in result.references
        ],
    }  # fmt: skip


def _by_size(per_byte: Mapping[int, float]) -> dict[str, float]:
    """JSON's keys are strings; _sizes reads them back."""
    return {str(k): v for k, v in per_byte.items()}


def _sizes(data: Mapping[str, Any] | None) -> dict[int, float]:
    return {int(k): float(v) for k, v in (data or {}).items()}


def read(run_dir: Path) -> Result | None:
    data = read_json(run_dir / FILE)
    if not data:
        return None
    return Result(
        [Sample(**s) for s in data["samples"]],
        data.get("regions"),
        _sizes(data.get("engine_cpu_per_byte")),
        data.get("info") or {},
        _sizes(data.get("engine_threads_per_byte")),
        [
            Reference(r["state"], r["pass"], _sizes(r["per_byte"]),
                      _sizes(r["threads_per_byte"]))
            for r in data.get("references") or []
        ],
    )  # fmt: skip


TITLE = "Transfer cost: descriptors and CPU per GiB (not 2-core figures)"
HEAD = ("state", "pass", "prompt", "bytes", "descriptors", "bound", "within",
        "prefill CPU ms", "decode CPU ms", "CPU-s / GiB net",
        "engine alone")  # fmt: skip


def markdown(result: Result) -> list[str]:
    def cells(s: Sample) -> list[str]:
        bound = result.bound(s.nbytes)
        gib = s.nbytes / GIB
        alone = result.engine_seconds(s)
        return [
            s.state, s.name, str(s.input_len), f"{s.nbytes / 2**20:.1f} MiB",
            fmt(s.descriptors, 0), "n/a" if bound is None else str(bound),
            "n/a" if bound is None else ("yes" if s.descriptors <= bound else "NO"),
            fmt(s.cpu_s.get("prefill", 0.0) * 1e3, 0),
            fmt(s.cpu_s.get("decode", 0.0) * 1e3, 0),
            fmt(s.net_cpu_s() / gib if gib else None, 2),
            fmt(alone / gib if alone is not None and gib else None, 2),
        ]  # fmt: skip

    out = [
        "One request at a time per prompt length, on a stack just started "
        "(fresh) and after a burst of mixed requests (fragmented). Bound: "
        f"ceil(bytes / {staging.CHUNK_BYTES >> 20} MiB) + one per KV region "
        f"({result.regions} regions). CPU: the transfer threads of both "
        "servers' worker processes (the unnamed threads but the main one), "
        "from /proc/<pid>/task/*/stat, over the decode leg (decode's pull), "
        "their idle rate before the pass taken out (net); engine alone: two "
        "loopback engines, right after each pass (the stack up, idle), writing "
        "its requests' bytes in 1 MiB descriptors, every thread of both processes "
        "(the caller spins in batch_transfer_sync_write), and its own threads "
        "(the caller left out; the plugin's sends do not spin). "
        "Descriptor counts do not depend on how busy the cores are; "
        "CPU-seconds far less than wall clock (10 ms ticks; cache "
        "contention), unlike the 2-core wall-clock shares elsewhere in "
        "this report.",
        "",
        *table(HEAD, map(cells, result.samples)),
        "",
    ]
    for state in STATES:
        for name in (*kv_path.PASSES, None):
            if figures := result.cpu_per_gib(state, name):
                out.append(
                    f"- {state}, {name or 'all requests'}: {figures['requests']} "
                    f"requests, {figures['gib']:.2f} GiB, transfer threads "
                    f"{figures['net']:.2f} CPU-s/GiB net ({figures['raw']:.2f} raw), "
                    f"engine alone {fmt(figures['engine_alone'], 2)}, ratio "
                    f"{fmt(figures['ratio'], 2)}; its own threads "
                    f"{fmt(figures['engine_threads'], 2)}, ratio "
                    f"{fmt(figures['ratio_threads'], 2)}"
                )
    for state, data in result.info.items():
        if isinstance(data, dict) and "kv_checksum" in data:
            on = "on (its digests count)" if data["kv_checksum"] else "off"
            out.append(f"- {state}: KV checksum {on}")
    staged = [s for s in result.samples if s.state == "staged"]
    if unstaged := [s for s in staged if not s.staged]:
        out.append(f"- {len(unstaged)} request(s) of the 'staged' state went direct")
    return out


def write(run_dir: Path, result: Result) -> None:
    (run_dir / FILE).write_text(json.dumps(to_json(result), indent=1))


def summary(result: Result | None) -> dict[str, Any] | None:
    if result is None:
        return None
    return {
        "regions": result.regions,
        "requests": [
            {"state": s.state, "pass": s.name, "input_len": s.input_len,
             "bytes": s.nbytes, "descriptors": s.descriptors,
             "bound": result.bound(s.nbytes), "staged": s.staged,
             "cpu_s": s.cpu_s, "net_cpu_s": s.net_cpu_s()}
            for s in result.samples
        ],
        "cpu_per_gib": {
            state: {name or "all": result.cpu_per_gib(state, name)
                    for name in (*kv_path.PASSES, None)}
            for state in STATES
        },
    }  # fmt: skip
