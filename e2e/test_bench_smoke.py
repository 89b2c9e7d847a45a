"""`make bench`'s sweep plumbing, for real, on the suite's stack.

A tiny workload (two 128-token prompts, 8 output tokens) through vLLM's own
`vllm bench serve` code (bench.vllm_bench, in its own process as `make bench`
runs it) against the router and against the colocated reference, the
prefill's transfer counters read around the P/D level, and the report built
from what it wrote. No speed is asserted: only that the bench measured what
happened (every request completed and counted, the bytes equal to the
model's KV layout). Then the KV path's sweep for one state (bench.kv_path:
a warm-up, one fresh request, a small burst, one fragmented request) on the
same stack, read back and rendered. Then the goodput sweep (bench.rate_sweep,
tiny) whose every P/D level's KV evidence must verify, and its negative
control: "P/D" requests sent to decode directly (decode recomputes) must fail
the evidence and count for nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import Stack, require_full_install

# Both cases run `vllm bench serve`; bench's modules need more than the client
# venv has (aiohttp, numpy), so the skip comes before they are imported.
require_full_install("the bench smoke test (`vllm bench serve`)")

from bench import goodput, kv_path, kv_transfer, rate_sweep, report, settings  # noqa: E402
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


def goodput_sweep(stack: Stack, out: Path, pd_url: str) -> dict[str, Any]:
    """bench.rate_sweep in its own process on the suite's stack, tiny: the
    probes, one rate of two requests per target, then the report built.
    ``pd_url``: where the "P/D" requests go (the router, or a wrong place)."""
    where = out / goodput.DIR
    where.mkdir(parents=True)
    plan = rate_sweep.RatePlan(
        model="pd-model", tokenizer=tokenizer_of(PROFILE), input_len=INPUT_LEN,
        output_len=4, num_prompts=PROMPTS, ttft_ms=600_000, tpot_ms=60_000,
        urls={"pd": pd_url, "colocated": stack.reference},
        prefill_urls=[stack.prefill], decode_urls=[stack.decode], steps=1,
        level_timeout_s=DEADLINE_S / 4, budget_s=DEADLINE_S, out=str(where),
        slo_from="the smoke test", colocated_is="prefill itself",
    )  # fmt: skip
    rate_sweep.write_plan(plan, where / "plan.json")
    env = {**os.environ, "PYTHONPATH": str(settings.ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.rate_sweep", str(where / "plan.json")],
        cwd=settings.ROOT, env=env, timeout=DEADLINE_S, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return report.build(out)["goodput"]


def test_goodput_sweep_verifies_every_p_d_level(stack: Stack, tmp_path: Path) -> None:
    """Every P/D level's requests: decode loaded their prompts from prefill,
    computed none, every region's checksum matched (where it is on)."""
    swept = goodput_sweep(stack, tmp_path, stack.router)
    pd = [lv for lv in swept["levels"] if lv["target"] == "pd"]
    assert len(pd) == 2, swept["levels"]  # the probe and one rate
    for level in pd:
        assert level["status"] == "ok" and level["evidence"]["status"] == "verified", (
            level
        )
    assert "KV crossed and was verified" in swept["answers"][2]
    assert (tmp_path / goodput.DIR / goodput.PLOT).exists()
    # The suite's twin: one prefill, one decode, and the report says so.
    assert swept["pd_ratio"] == "1P:1D", swept["pd_ratio"]
    assert swept["answers"][0].startswith("P/D 1P:1D sustains"), swept["answers"]
    assert "P/D 1P:1D and colocated" in (tmp_path / "report.md").read_text()


def test_goodput_sweep_fails_a_decode_that_recomputes(
    stack: Stack, tmp_path: Path
) -> None:
    """Negative control: the "P/D" requests sent to decode directly (no
    transfer parameters: decode computes every prompt itself, fast and
    proving nothing). Every such level's evidence must fail, and none count
    as sustained."""
    swept = goodput_sweep(stack, tmp_path, stack.decode)
    pd = [lv for lv in swept["levels"] if lv["target"] == "pd"]
    assert pd and all(lv["evidence"]["status"] == "failed" for lv in pd), pd
    assert all("decode loaded 0 prompt tokens" in lv["evidence"]["detail"] for lv in pd)
    assert swept["sustained_req_per_s"]["pd"] is None
    assert "KV evidence FAILED" in swept["answers"][2]
