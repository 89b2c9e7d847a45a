"""`make bench`'s sweep plumbing, for real, on the suite's stack.

A tiny workload (two 128-token prompts, 8 output tokens) through vLLM's own
`vllm bench serve` code (bench.vllm_bench, in its own process as `make bench`
runs it) against the router and against the colocated reference, the
prefill's transfer counters read around the P/D level, and the report built
from what it wrote. No speed is asserted: only that the bench measured what
happened (every request completed and counted, the bytes equal to the
model's KV layout). Then the KV path's sweep for one state (bench.kv_path:
a warm-up, one fresh request, a small burst, one fragmented request) on the
same stack, read back and rendered.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Stack, require_full_install

# Both cases run `vllm bench serve`; bench's modules need more than the client
# venv has (aiohttp, numpy), so the skip comes before they are imported.
require_full_install("the bench smoke test (`vllm bench serve`)")

from bench import kv_path, kv_transfer, report, settings  # noqa: E402
from bench.run import tokenizer_of  # noqa: E402
from bench.vllm_bench import Level, Plan  # noqa: E402

PROMPTS = 2
INPUT_LEN = 128
DEADLINE_S = 300.0
PROFILE = os.environ.get("PD_PROFILE", "tiny")


def write_layout(stack: Stack, out: Path) -> None:
    """What bench.run writes before a sweep: the stack's own layout, the profile."""
    layout = kv_transfer.served_layout(stack.prefill, PROFILE)
    if layout is None:
        pytest.skip(f"no model configs of profile {PROFILE!r} on this host")
    (out / "kv_layout.json").write_text(json.dumps(layout))
    (out / "meta.json").write_text(json.dumps({"profile": PROFILE}))


def run_sweep(plan: Plan, out: Path) -> None:
    """bench.vllm_bench in its own process, as `make bench` runs it."""
    plan_file = out / "plan.json"
    plan_file.write_text(json.dumps(plan.to_json()))
    env = {**os.environ, "PYTHONPATH": str(settings.ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.vllm_bench", str(plan_file)],
        cwd=settings.ROOT, env=env, timeout=DEADLINE_S, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_bench_sweep_measures_the_stack(stack: Stack, tmp_path: Path) -> None:
    write_layout(stack, tmp_path)
    raw = tmp_path / "raw"
    raw.mkdir()
    levels = tuple(
        Level(
            target=target,
            base_url=url,
            input_len=INPUT_LEN,
            concurrency=1,
            num_prompts=PROMPTS,
            seed=0,
            result_file=str(raw / f"{target}-in{INPUT_LEN}-c1.json"),
            prefill_url=stack.prefill if target == "pd" else None,
            kv_file=str(raw / f"pd-in{INPUT_LEN}-c1.kv.json")
            if target == "pd"
            else None,
        )
        for target, url in (("pd", stack.router), ("colocated", stack.reference))
    )
    plan = Plan("pd-model", tokenizer_of(PROFILE), 8, DEADLINE_S / 2, levels)
    run_sweep(plan, tmp_path)
    for level in levels:
        result = json.loads(Path(level.result_file).read_text())
        assert result["completed"] == PROMPTS, (level.target, result.get("errors"))
    summary = report.build(tmp_path)
    (level,) = summary["levels"]
    assert level["kv"]["requests"] == PROMPTS
    assert 1 <= level["kv"]["transfers"] <= PROMPTS
    assert summary["layout_checks_ok"] is True
    assert (tmp_path / "report.md").read_text().count("OK: ") == 1


def test_kv_path_sweep_measures_each_request(stack: Stack, tmp_path: Path) -> None:
    """One state's KV path sweep, tiny, on the suite's stack as it runs (the
    bench restarts its own; this one is shared): every request's transfer
    counted, its bytes equal to the layout, the burst completed."""
    write_layout(stack, tmp_path)
    parser = argparse.ArgumentParser()
    settings.add_arguments(
        parser, {"BENCH_INPUT_LENS": str(INPUT_LEN), "BENCH_KV_PATH_REQUESTS": "1"}
    )
    chosen = settings.from_args(parser.parse_args([]))
    burst = kv_path.Burst(prompts=4, concurrency=2, input_len=INPUT_LEN,
                          output_len=8, timeout_s=DEADLINE_S / 4)  # fmt: skip
    where = kv_path.state_dir(tmp_path, "staged")
    plan = kv_path.plan(chosen, stack.router, stack.prefill, where,
                        tokenizer_of(PROFILE), burst)  # fmt: skip
    run_sweep(plan, tmp_path)
    result = kv_path.read(tmp_path)
    assert result is not None
    for name in kv_path.PASSES:
        cell = result.cell("staged", name, INPUT_LEN)
        assert cell is not None and len(cell.requests) == 1, name
        (request,) = cell.requests
        assert request.counters["transfers"] == 1 and request.counters["descriptors"]
        assert request.transfer_ms() and request.ttft_ms > 0
    assert result.bursts["staged"]["completed"] == burst.prompts
    report.build(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert f"## {kv_path.TITLE}" in text
    assert "bytes per request: all 2 equal the layout's whole blocks" in text
