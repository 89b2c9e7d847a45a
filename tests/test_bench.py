"""The bench's plumbing: real code on small inputs, each checker with a negative
control. No assertion here is about speed (timing belongs to `make bench`);
what each part runs: docs/bench.md, "The smoke tests"."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests

from bench import (
    http_tap,
    kv_checksum,
    kv_path,
    kv_phases,
    kv_transfer,
    levels,
    loopback,
    router_capture,
    router_overhead,
    run,
    settings,
    stack,
    vllm_bench,
)
from bench import transfer_engine as te
from bench.targets import judge
from bench.vllm_bench import Level, Plan, bench_serve_args
from pdstack import kv_layout, wait
from pdstack import metrics as m
from pdstack.supervisor import free_port
from tests.shared import GQA_DRAFT, MLA_TARGET, SMALL_RUN, bench_settings, built

# The CPU twin's layout (tests/test_kv_layout.py checks it against the models).
TWIN = kv_layout.layout(MLA_TARGET, GQA_DRAFT, "float32", 16)
BLOCK = TWIN.bytes_per_block()
LENS = [128, 130, 4096]


# --- transfer engine ----------------------------------------------------------
def test_transfer_engine_moves_every_size_and_checks_arrival() -> None:
    sizes = [64 << 10, 256 << 10, 1 << 20, 3 << 20]
    samples = te.run(sizes, repeats=2, progress=lambda _: None)
    got = {(s.method, s.size) for s in samples}
    # 1 MiB descriptors (the staged path's) from one of them up.
    assert got == {(m, size) for m in te.METHODS for size in sizes
                   if m != te.CHUNKED_METHOD or size >= te.CHUNK_BYTES}  # fmt: skip
    chunked = [s for s in samples if s.method == te.CHUNKED_METHOD]
    assert [(s.size, s.descriptors) for s in chunked] == [(1 << 20, 1), (3 << 20, 3)]
    assert all(s.verified for s in samples)
    assert all(len(s.throughputs()) == 2 for s in samples)
    kv = [s for s in samples if s.method == "engine_kv_blocks"]
    assert [s.descriptors for s in kv] == [-(-n // te.KV_BLOCK_BYTES) for n in sizes]
    comparisons = te.compare(samples)
    assert [c.size for c in comparisons] == sizes
    assert all(c.vs_socket > 0 and c.vs_memcpy > 0 for c in comparisons)
    with_chunked = [c.chunked_bps is not None for c in comparisons]
    assert with_chunked == [False, False, True, True]
    assert te.from_json(json.loads(json.dumps(te.to_json(samples)))) == samples


@pytest.mark.parametrize(
    ("method", "size"), [("engine", 64 << 10), (te.CHUNKED_METHOD, 2 << 20)]
)
def test_transfer_engine_check_catches_misplaced_bytes(method: str, size: int) -> None:
    """Negative control: a real transfer landing 4 KiB off is reported."""
    with pytest.raises(te.TransferBenchError, match="bytes differ"):
        te.run([size], repeats=1, methods=(method,), misaddress=4096,
               progress=lambda _: None)  # fmt: skip


def test_a_failing_peer_is_reported_not_waited_for() -> None:
    """The two-process harness (also the plugin's transfer tests'): a peer
    that raises says why, one that has exited says so at once."""
    with pytest.raises(loopback.PeerError, match="start: ValueError"):
        loopback.Peer(loopback.Endpoint, -1)
    with loopback.Peer(loopback.Endpoint, 16) as peer:
        assert peer.call("read") == bytes(16)
        with pytest.raises(loopback.PeerError, match="no attribute 'nope'"):
            peer.call("nope")
        with pytest.raises(loopback.PeerError, match="exited"):
            peer.call("read")


def test_a_peers_output_goes_to_its_log(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Mooncake's C++ log lines (written to fd 2, not through Python) land in
    the peer's log, not in the bench's progress output."""
    log = tmp_path / "engine.log"
    with loopback.Peer(loopback.Endpoint, 16, log=log) as peer:
        assert peer.call("read") == bytes(16)
    assert "transfer_engine" in log.read_text()
    assert "transfer_engine" not in "".join(capfd.readouterr())
    with loopback.Peer(loopback.Endpoint, 16) as peer:  # no log: as before
        assert peer.call("read") == bytes(16)
    assert "transfer_engine" in "".join(capfd.readouterr())


def test_a_runs_progress_lines_are_kept_in_its_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """From the line naming the directory to the targets' verdicts, renamed
    with the directory when the run completes."""
    s = bench_settings(["--out", str(tmp_path)])
    progress = run.Clock()
    progress("before the directory")
    out, _ = run._start(s, progress)
    progress("a step")
    done = run._finish(out, progress)
    progress("after the run")
    kept = (done / run.PROGRESS_LOG).read_text().splitlines()
    assert kept[0].endswith(f"results in {out}") and kept[1].endswith("a step")
    assert any("(target " in line for line in kept[2:]), kept
    printed = capsys.readouterr().out
    assert "before the directory" in printed and "after the run" in printed
    assert "before the directory" not in kept[0] and "after the run" not in kept[-1]


def test_kv_descriptors_cover_the_bytes_once() -> None:
    src, dst, lens = te.kv_descriptors(100_000, 1000, 5000, block=36864)
    assert lens == [36864, 36864, 100_000 - 2 * 36864]
    assert src == [1000, 1000 + 36864, 1000 + 2 * 36864]
    assert [d - 5000 for d in dst] == [s - 1000 for s in src]


# --- KV transfer accounting ---------------------------------------------------
def counters(lens: list[int], **changes: float) -> dict[str, float]:
    return {
        "transfers": len(lens),
        "bytes": sum(TWIN.transfer_bytes(n) for n in lens),
        "seconds": 0.02 * len(lens),
        "descriptors": 9 * len(lens),
        **dict.fromkeys(("failed_transfers", "failed_recvs", "expired"), 0),
        "prompt_tokens": sum(lens),
        **changes,
    }


@pytest.mark.parametrize(
    ("change", "ok", "why"),
    [
        ({}, True, "3 requests in 3 transfers"),
        # Prefill batches the requests bound for one decode: bytes still add up.
        ({"transfers": 1}, True, "3 requests in 1 transfers"),
        # Negative controls.
        ({"bytes": counters(LENS)["bytes"] - BLOCK}, False, "layout predicts"),
        ({"bytes": counters(LENS)["bytes"] + BLOCK // 2}, False, "layout predicts"),
        ({"transfers": 4}, False, "4 transfers for 3 requests"),
        ({"transfers": 0}, False, "0 transfers for 3 requests"),
        ({"failed_transfers": 1}, False, "failed transfers"),
        ({"prompt_tokens": 4354 - 1}, False, "prompt tokens"),
    ],
)
def test_layout_check(change: dict[str, float], ok: bool, why: str) -> None:
    check = kv_transfer.check_layout(LENS, counters(LENS, **change), TWIN)
    assert check is not None and check.ok == ok, check
    assert why in check.detail
    # 8 + 9 + 256 blocks of 311296 bytes: per request, never pooled.
    assert check.expected_bytes == (8 + 9 + 256) * BLOCK == (8 + 9 + 256) * 311296


def test_layout_check_is_skipped_without_a_layout_model() -> None:
    assert kv_transfer.check_layout([128], counters([128]), None) is None


def test_layout_check_follows_the_stacks_block_size() -> None:
    """A GPU stack's 64-token bfloat16 blocks: 128 tokens are 2 blocks there."""
    gpu = kv_layout.layout(MLA_TARGET, GQA_DRAFT, "bfloat16", 64)
    values = counters([130], bytes=gpu.transfer_bytes(130))
    check = kv_transfer.check_layout([130], values, gpu)
    assert check is not None and check.ok, check
    assert "64-token blocks" in check.detail
    assert not kv_transfer.check_layout([130], values, TWIN).ok


def test_layout_round_trips_through_the_run_directory() -> None:
    data = json.loads(json.dumps(dataclasses.asdict(TWIN)))
    assert kv_transfer.layout_from_json(data) == TWIN
    assert kv_transfer.layout_from_json(None) is None


@pytest.mark.parametrize(
    ("lens", "transfers", "blocks", "per_transfer", "share"),
    [
        ([4096, 4096], 2, 256, 0.25, 0.05),
        # Four requests in one 0.5 s transfer: each waited 0.5 s, not 0.125 s.
        ([1024] * 4, 1, 64, 0.5, 0.1),
    ],
)
def test_transfer_cost_per_request(
    lens: list[int], transfers: int, blocks: int, per_transfer: float, share: float
) -> None:
    values = counters(lens, transfers=transfers, seconds=0.5)
    cost = kv_transfer.cost(values, requests=len(lens), mean_ttft_ms=5000.0)
    assert cost is not None
    assert cost.bytes_per_request == blocks * BLOCK
    assert cost.seconds_per_transfer == per_transfer
    assert cost.share_of_ttft == pytest.approx(share)
    assert cost.mb_per_s == pytest.approx(len(lens) * blocks * BLOCK / 0.5 / 1e6)
    assert kv_transfer.cost(counters([], transfers=0), 0, 1.0) is None


# --- router protocol -----------------------------------------------------------
def test_direct_legs_follow_the_router_protocol() -> None:
    body = {"model": "pd-model", "prompt": "hello", "max_tokens": 8}
    prefill, decode = router_capture.build_legs(body, "engine-1", "http://h:9998")
    assert router_capture.differences(prefill, decode) == []
    assert body == {"model": "pd-model", "prompt": "hello", "max_tokens": 8}
    assert decode["max_tokens"] == 8 and prefill["max_tokens"] == 1


def test_recorded_router_legs_follow_the_protocol() -> None:
    capture = json.loads((SMALL_RUN / "router_overhead.json").read_text())["capture"]
    assert capture["prefill_response_kv_params"] is None
    legs = capture["prefill_leg"], capture["decode_leg"]
    assert router_capture.differences(*legs) == []


def in_kv(**changes: Any) -> Any:
    return lambda body: body["kv_transfer_params"].update(changes)


@pytest.mark.parametrize(
    ("leg", "edit", "why"),
    [
        ("decode", lambda b: b["kv_transfer_params"].pop("remote_engine_id"), "keys"),
        ("decode", in_kv(transfer_id="x"), "different"),
        ("prefill", lambda b: b.update(max_tokens=4), "max_tokens"),
        ("prefill", lambda b: b.update(kv_transfer_params=None), "is None"),
        ("decode", in_kv(do_remote_prefill=False), "do_remote_prefill"),
        ("decode", in_kv(remote_bootstrap_addr="h:1"), "http://host:port"),
        ("decode", lambda b: b.update(prompt="other"), "prompt"),
    ],
)
def test_protocol_check_negative_controls(leg: str, edit: Any, why: str) -> None:
    prefill, decode = router_capture.build_legs(
        {"model": "m", "prompt": "p", "max_tokens": 4}, "e", "http://h:1"
    )
    edit(prefill if leg == "prefill" else decode)
    problems = router_capture.differences(prefill, decode)
    assert problems and any(why in p for p in problems), problems


def test_tap_records_and_stubs_answer() -> None:
    respond = router_capture.stub_vllm("m")
    stub = http_tap.Tap("stub", free_port(), None, respond=respond)
    tap = http_tap.Tap("tap", free_port(), stub.url)
    completions = f"{tap.url}/v1/completions"
    with http_tap.TapServer([stub, tap]) as server:
        ok = requests.post(completions, json={"prompt": "x"}, timeout=10)
        missing = requests.get(f"{tap.url}/nowhere", timeout=10)
        body = {"prompt": "y", "stream": True}
        stream = requests.post(completions, json=body, timeout=10)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "x"
    assert missing.status_code == 404
    assert stream.text.count("data: ") == 3 and stream.text.endswith("data: [DONE]\n\n")
    seen = [(e.tap, e.method, e.path, e.status) for e in server.exchanges()]
    assert ("tap", "POST", "/v1/completions", 200) in seen
    assert ("tap", "GET", "/nowhere", 404) in seen
    assert tap.exchanges[0].request == {"prompt": "x"}


def pick_first(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """router_capture's free_port hands out ``port`` first, then free ones."""
    picks, real = [port], router_capture.free_port
    monkeypatch.setattr(router_capture, "free_port",
                        lambda: picks.pop() if picks else real())  # fmt: skip


@pytest.mark.parametrize("attempts", [router_capture.ROUTER_ATTEMPTS, 1])
def test_a_router_port_taken_before_it_binds_is_picked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attempts: int
) -> None:
    """The first port picked for the real vllm-router is listened on by
    someone else by the time it binds: it is started again on new ports and
    answers; with one attempt only (the negative control) it fails."""
    stubs = router_capture.stub_taps("pd-model")
    taken = socket.socket()
    taken.bind((router_capture.HOST, 0))
    taken.listen()
    pick_first(monkeypatch, taken.getsockname()[1])
    monkeypatch.setattr(router_capture, "ROUTER_ATTEMPTS", attempts)
    router = router_capture.router_behind(stubs, tmp_path, "router", lambda _: None)
    with taken, contextlib.ExitStack() as stack:
        if attempts == 1:
            with pytest.raises(wait.WaitError, match=router_capture.PORT_TAKEN):
                stack.enter_context(router)
            return
        url, _ = stack.enter_context(router)
        assert url != f"http://{router_capture.HOST}:{taken.getsockname()[1]}"
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
    assert router_capture.PORT_TAKEN in (tmp_path / "router.log").read_text().lower()


def test_the_routers_own_port_behind_the_front_is_picked_free_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm-router listens behind pdstack.route's front on the router's port
    + 1 unless told otherwise: with that one taken, a router on a free port
    still starts first time (CI, 2026-12-03: vllm-router 'Address already
    in use' after it was otherwise ready)."""
    stubs = router_capture.stub_taps("pd-model")
    with socket.socket() as taken:
        taken.bind((router_capture.HOST, 0))
        taken.listen()
        port = taken.getsockname()[1] - 1
        with socket.socket() as probe:  # the port before it is free
            probe.bind((router_capture.HOST, port))
        pick_first(monkeypatch, port)
        with router_capture.router_behind(stubs, tmp_path, "router", print) as (url, _):
            assert url == f"http://{router_capture.HOST}:{port}"
    log = (tmp_path / "router.log").read_text().lower()
    assert router_capture.PORT_TAKEN not in log


def test_real_router_protocol_through_taps(tmp_path: Path) -> None:
    """vllm-router 0.1.17 itself, in front of stub backends: the legs it sends
    are the ones the direct client builds, and the stub timing runs."""
    model = "pd-model"
    stubs = router_capture.stub_taps(model)
    with http_tap.TapServer(stubs):
        capture = router_capture.capture(
            stubs[0].url, stubs[1].url, stubs[2].port, tmp_path, model, requests_n=3,
            progress=lambda _: None,
        )  # fmt: skip
    assert router_capture.differences(capture.prefill_leg, capture.decode_leg) == []
    assert capture.legs_in_order
    assert capture.bootstrap_queries >= 1
    assert capture.decode_leg["kv_transfer_params"]["remote_engine_id"] == "stub-engine"
    overhead = router_overhead.measure_on_stubs(model, 20, tmp_path, lambda _: None)
    assert len(overhead.router_ms) == len(overhead.direct_ms) == 20
    summary = router_overhead.summary(overhead)
    assert summary["pairs"] == 20 and len(summary["p50_overhead_interval_ms"]) == 2


# --- report (run_dir: tests/conftest.py) ---------------------------------------
def test_report_from_a_recorded_run(run_dir: Path) -> None:
    summary, text = built(run_dir)
    raw = {p.stem: json.loads(p.read_text()) for p in run_dir.glob("raw/*-c?.json")}
    assert len(summary["levels"]) == 2
    for level in summary["levels"]:
        pd = raw[f"pd-in{level['input_len']}-c{level['concurrency']}"]
        colo = raw[f"colocated-in{level['input_len']}-c{level['concurrency']}"]
        for key, _ in levels.METRICS:
            want = pd[key] / colo[key]
            assert level["ratio_pd_over_colocated"][key] == pytest.approx(want)
        assert level["kv"]["transfers"] == pd["completed"]
    assert summary["layout_checks_ok"] is True
    assert "| 128 | 1 |" in text and "OK: " in text
    names = [t["name"] for t in summary["targets"]]
    assert len(names) == 12 and any("Router" in n for n in names)
    png = run_dir / "report.png"
    try:
        import matplotlib  # noqa: F401  (requirements/bench.txt)
    except ImportError:
        assert not png.exists() and "report.png" not in text
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "![" in text


def test_report_flags_a_layout_mismatch(run_dir: Path) -> None:
    """Negative control: one block too many in a recorded level is reported."""
    kv_file = next((run_dir / "raw").glob("pd-*.kv.json"))
    data = json.loads(kv_file.read_text())
    kv_file.write_text(json.dumps(data | {"bytes": data["bytes"] + BLOCK}))
    summary, text = built(run_dir)
    assert summary["layout_checks_ok"] is False
    assert "MISMATCH" in text


def test_targets_are_judged_by_their_numbers() -> None:
    level = levels.LevelResult.from_json(level_result(4096, mean_ttft_ms=10_000.0))

    def pair(**changes: float) -> levels.Pair:
        return levels.Pair(4096, 1, level, None, counters([4096], **changes))

    fast = pair(seconds=0.4)
    assert judge([fast], None, [], None)[0].met is True
    assert judge([pair(seconds=0.6)], None, [], None)[0].met is False
    for rss, met in ((7 << 30, False), (5 << 30, True)):
        assert judge([], None, [], {"rss_total": rss, "rss_by_group": {}})[3].met is met
    for engine_bps, met in ((0.7e9, False), (0.9e9, True)):
        engine = [te.Comparison(64 << 20, engine_bps, 1.0e9, 5e9, None)]
        assert judge([], None, engine, None)[2].met is met
    assert all(t.met is None for t in judge([], None, [], None))
    # Stalls: any resent send in the sweep misses, naming its level.
    assert judge([fast], None, [], None)[5].met is True
    verdict = judge([fast, pair(seconds=0.4, retried_transfers=2)], None, [], None)[5]
    assert verdict.met is False and "4096 tokens x 1: 2" in verdict.measured


def router_met(real: list[float], stubs: list[float], stub_p50: float) -> bool | None:
    overhead = {
        "p50_overhead_ms": sum(real) / 2,
        "p50_overhead_interval_ms": real,
        "stubs": {"p50_overhead_ms": stub_p50, "p50_overhead_interval_ms": stubs},
    }
    target = judge([], overhead, [], None)[1]
    assert target.name.startswith("Router overhead")
    return target.met


def test_router_target_is_judged_by_intervals_not_point_figures() -> None:
    noisy = [-2111.0, 1434.0]  # the real stack on the twin (fixture run)
    # The stubs resolve what the real stack's noise cannot.
    assert router_met(noisy, [0.30, 0.45], 0.37) is True
    assert router_met(noisy, [1.10, 1.40], 1.20) is False
    # A stub point figure under the target, its interval across it: unresolved
    # (the lower bound of the real interval is below any target: no help).
    assert router_met(noisy, [0.80, 1.25], 0.95) is None
    # The real stack decides where its interval does, whatever the stubs say.
    assert router_met([1.5, 3.0], [0.30, 0.45], 0.37) is False
    assert router_met([0.2, 0.9], [0.80, 1.25], 0.95) is True
    # Nothing to judge by: unresolved, not met.
    assert router_met([float("nan")] * 2, [float("nan")] * 2, 0.37) is None


def test_level_parser_rejects_what_is_not_a_bench_result() -> None:
    with pytest.raises(levels.ReportError, match="missing"):
        levels.LevelResult.from_json({"completed": 3})
    with pytest.raises(levels.ReportError, match="unknown target"):
        levels.LevelResult.from_json(
            {"target": "x", "input_len": 1, "concurrency": 1, "completed": 1}
        )


# --- settings and the vllm bench command line ---------------------------------------
def test_settings_parsers() -> None:
    assert settings.parse_size("64K") == 65536
    assert settings.parse_sizes("64K,256M") == (65536, 256 << 20)
    assert settings.parse_ints("1,4,16") == (1, 4, 16)
    bad = [(settings.parse_sizes, text) for text in ("12X", "", "-1")]
    for parse, text in bad + [(settings.parse_ints, t) for t in ("1,a", "0", "")]:
        with pytest.raises(settings.SettingsError):
            parse(text)


def test_levels_respect_the_token_budget_cheapest_first() -> None:
    chosen = bench_settings(BENCH_INPUT_LENS="128,4096", BENCH_CONCURRENCY="1,16",
                            BENCH_MAX_BATCH_TOKENS="16384")  # fmt: skip
    assert chosen.levels() == [(128, 1), (128, 16), (4096, 1)]
    assert chosen.skipped_levels() == [(4096, 16)]
    assert chosen.num_prompts(1) == 2 and chosen.num_prompts(16) == 16
    with pytest.raises(settings.SettingsError, match="BENCH_DECODE_URL"):
        bench_settings(BENCH_ROUTER_URL="http://a", BENCH_PREFILL_URL="http://b",
                       BENCH_COLOCATED_URL="http://c")  # fmt: skip


def test_vllm_bench_serve_accepts_the_bench_arguments(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    BenchmarkServingSubcommand.add_cli_args(parser)
    level = Level("pd", "http://127.0.0.1:9", 1024, 4, 4, 7, str(tmp_path / "r.json"))
    plan = Plan("pd-model", "/tok", 64, 60.0, (level,))
    args = parser.parse_args(bench_serve_args(plan, level))
    assert (args.random_input_len, args.random_output_len) == (1024, 64)
    assert (args.max_concurrency, args.num_prompts, args.seed) == (4, 4, 7)
    assert args.percentile_metrics == "ttft,tpot,itl,e2el"
    assert args.save_result and args.save_detailed
    with pytest.raises(SystemExit):  # negative control: the parser is strict
        parser.parse_args([*bench_serve_args(plan, level), "--no-such-flag"])


# --- the KV checksum's cost ---------------------------------------------------------
def level_result(length: int, **ttft_ms: float) -> dict[str, Any]:
    """One request's level as `vllm bench serve` saves it (the keys read)."""
    return {"target": "pd", "input_len": length, "concurrency": 1, "completed": 1,
            "input_lens": [length], "errors": [""], **ttft_ms}  # fmt: skip


def write_request(stem: Path, kv: dict[str, float], length: int, **ttft: float) -> None:
    """A single-request level and its transfer counters, as the bench writes them."""
    stem.with_suffix(".json").write_text(json.dumps(level_result(length, **ttft)))
    stem.with_suffix(".kv.json").write_text(json.dumps(kv))


def write_checksum_pass(
    run_dir: Path, state: str, ttft_ms: dict[int, list[float]], enabled: float
) -> None:
    """One pass as the bench leaves it (per request a level and its counters)."""
    where = kv_checksum.pass_dir(run_dir, state)
    where.mkdir(parents=True)
    for length, values in ttft_ms.items():
        for i, ttft in enumerate(values):
            kv = counters([length], seconds=ttft / 20e3)
            write_request(where / f"pd-in{length}-c1-r{i}", kv, length,
                          p50_ttft_ms=ttft, mean_ttft_ms=ttft)  # fmt: skip
    matched = 9 * sum(map(len, ttft_ms.values())) if enabled else 0
    series = {"enabled": enabled, "matched_regions": matched, "mismatched_regions": 0}
    (where / kv_checksum.STATE_FILE).write_text(json.dumps(series))


DIGEST = {
    "tokens": 4096, "bytes": 79691776, "regions": 9, "cache_blocks": 1724,
    "rounds": 7, "default_threads": 2, "same_digest_on_every_thread_count": True,
    "results": [
        {"threads": t, "method": m, "seconds": 0.04 / t, "GBps": 2.0 * t}
        for t in (1, 2) for m in ("digest", "gather", "read", "copy")
    ],
}  # fmt: skip


def test_report_renders_the_checksum_on_off_table(run_dir: Path) -> None:
    write_checksum_pass(run_dir, "on", {128: [700, 720, 710], 4096: [10100] * 3}, 1)
    write_checksum_pass(run_dir, "off", {128: [690, 700, 705], 4096: [10000] * 3}, 0)
    (run_dir / kv_checksum.DIR / kv_checksum.DIGEST_FILE).write_text(json.dumps(DIGEST))
    summary, text = built(run_dir)
    assert "## KV checksum: on / off" in text
    assert "| 128 | 3 / 3 | 710 / 700 | +10 (1.4%) | 35.5 / 35.0 |" in text
    assert "| 4096 | 3 / 3 | 10,100 / 10,000 | +100 (1.0%) |" in text
    assert "| 1 | 2.00 | 2.00 | 2.00 | 2.00 | 100.0% | 40.0 |" in text
    assert "pass 'off': checksum gauge 0, 0 regions verified" in text
    target = next(t for t in summary["targets"] if "checksum" in t["name"])
    assert target["met"] is True and target["measured"].startswith("1.0% (+100 ms")
    assert "80 ms = 0.8%" in target["note"]  # the digest alone, twice
    levels_4096 = summary["kv_checksum"]["levels"][1]
    assert levels_4096["p50_ttft_on"] == 10100 and levels_4096["p50_ttft_off"] == 10000


def test_checksum_target_is_judged_by_its_number_and_the_passes_state(
    run_dir: Path,
) -> None:
    write_checksum_pass(run_dir, "on", {4096: [10300]}, 1)
    write_checksum_pass(run_dir, "off", {4096: [10000]}, 0)

    def judged() -> Any:
        checks = judge([], None, [], None, kv_checksum.read(run_dir))
        return next(t for t in checks if "checksum" in t.name)

    assert judged().met is False and judged().advice
    # Negative control: an "off" pass whose decode still verified is no baseline.
    state = kv_checksum.pass_dir(run_dir, "off") / kv_checksum.STATE_FILE
    state.write_text(json.dumps({"enabled": 1, "matched_regions": 9}))
    assert judged().met is None and "not judged" in judged().note
    assert judge([], None, [], None)[4].measured == "not measured"


def test_checksum_plan_sends_the_same_distinct_prompts_in_both_states(
    tmp_path: Path,
) -> None:
    chosen = bench_settings(BENCH_CHECKSUM_REQUESTS="3")
    plans = [
        kv_checksum.plan(chosen, "http://r", "http://p", tmp_path / s, "/tok")
        for s in kv_checksum.STATES
    ]
    on, off = ([(lv.input_len, lv.seed) for lv in p.levels] for p in plans)
    assert on == off and len(on) == 1 + 3 * 3
    assert plans[0].levels[0].result_file.endswith("warmup-in128.json")
    assert len({seed for _, seed in on}) == len(on)  # no prompt is another's prefix
    assert all(lv.num_prompts == lv.concurrency == 1 for lv in plans[0].levels)
    assert all(lv.kv_file and lv.prefill_url for lv in plans[0].levels)
    assert {lv.input_len for lv in plans[0].levels} == {128, 1024, 4096}


def test_digest_benchmark_runs_the_plugins_digest_on_every_region() -> None:
    pytest.importorskip("vllm")
    data = kv_checksum.digest_benchmark(TWIN, cache_bytes=32 * BLOCK, tokens=64,
                                        rounds=1)  # fmt: skip
    assert data["regions"] == 9 and data["bytes"] == TWIN.transfer_bytes(64)
    assert data["same_digest_on_every_thread_count"] is True
    methods = {(r["threads"], r["method"]) for r in data["results"]}
    assert {m for _, m in methods} == set(kv_checksum.DIGEST_METHODS)
    assert 1 in {t for t, _ in methods}
    assert "| threads | digest GB/s |" in "\n".join(kv_checksum.digest_markdown(data))


# --- the KV path: staged / direct, fresh / fragmented --------------------------------
# Per state and pass: (descriptors, transfer seconds, TTFT ms) of a 1024- and a
# 4096-token request (64 and 256 blocks: 19.9 and 79.7 MB).
KV_PATHS = {
    ("staged", "fresh"): {1024: (19, 0.025, 2000.0), 4096: (76, 0.1, 10_000.0)},
    ("staged", "fragmented"): {1024: (19, 0.026, 2000.0), 4096: (76, 0.1, 10_000.0)},
    ("direct", "fresh"): {1024: (9, 0.05, 2000.0), 4096: (18, 0.2, 10_000.0)},
    ("direct", "fragmented"): {1024: (576, 0.2, 2200.0), 4096: (2304, 0.8, 11_000.0)},
}
# Staged requests' phases (gather, write, scatter seconds), the same for
# both passes; direct ones record zeros.
STAGED_PHASES = {1024: (0.003, 0.021, 0.004), 4096: (0.012, 0.085, 0.015)}
# transfer_engine.json: the engine alone with one descriptor at 1 GB/s, with
# 1 MiB descriptors through stall_guard twice that, the rest at 4 GB/s.
ENGINE_GBPS = {"engine": 1.0, te.CHUNKED_METHOD: 2.0}
ENGINE_JSON = te.to_json(
    [
        te.Sample(method, size, 1, [size / (ENGINE_GBPS.get(method, 4.0) * 1e9)])
        for size in (16 << 20, 64 << 20)
        for method in te.METHODS
    ]
)


def write_kv_path_run(
    run_dir: Path, cells: dict[tuple[str, str], Any] = KV_PATHS, phases: bool = True
) -> None:
    """A KV path run as the bench leaves it; not ``phases``: a run from before
    the staging phases were recorded."""
    for (state, name), by_len in cells.items():
        where = kv_path.state_dir(run_dir, state)
        (where / name).mkdir(parents=True, exist_ok=True)
        for length, (descriptors, seconds, ttft) in by_len.items():
            for i in range(3):
                kv = counters([length], seconds=seconds, descriptors=descriptors)
                if phases:
                    took = STAGED_PHASES[length] if state == "staged" else (0, 0, 0)
                    kv |= dict(zip(map(kv_phases.key, kv_phases.PHASES), took,
                                   strict=True))  # fmt: skip
                stem = where / name / f"pd-in{length}-c1-r{i}"
                write_request(stem, kv, length, p50_ttft_ms=ttft + i)
        burst = {"target": "pd", "input_len": 1024, "concurrency": 8,
                 "completed": 16, "failed": 0, "input_lens": [103, 1940],
                 "output_lens": [5, 91]}  # fmt: skip
        (where / "burst.json").write_text(json.dumps(burst))
        status = {"status": "ok", "seconds": 41.0}
        (where / "burst.status.json").write_text(json.dumps(status))
        data = kv_path.state_json(kv_path.STATE_ENV[state], 60.0)
        (where / kv_path.STATE_FILE).write_text(json.dumps(data))
    (run_dir / "transfer_engine.json").write_text(json.dumps(ENGINE_JSON))


def test_report_renders_the_kv_path_section(run_dir: Path) -> None:
    write_kv_path_run(run_dir)
    summary, text = built(run_dir)
    for line in (
        "\n\n## KV path: staged / direct sends, fresh / fragmented block lists\n\n",
        # 64 blocks of 311296 B in 25 ms: 797 MB/s, 79.7% of 1 GB/s at 16 MiB, half
        # that of the engine's 1 MiB descriptors (2 GB/s); TTFTs 2000, 2001, 2002 ms.
        "| staged | fresh | 1024 | 3 | 19 | 25.0 | 797 | 2,001 | 1.2% | "
        "79.7% (16 MiB) | 39.8% |",
        "| staged | fragmented | 4096 | 3 | 76 | 100.0 | 797 | 10,001 | 1.0% |",
        "| direct | fragmented | 4096 | 3 | 2,304 | 800.0 | 100 | 11,001 | 7.3% |",
        "- direct: `PD_MOONCAKE_KV_STAGING_MIB=0`, stack (re)started in 60 s",
        "warm-up 16 of 16 requests, prompts 103-1940, outputs 5-91 tokens, ok",
        "bytes per request: all 24 equal the layout's whole blocks",
        # The engine table shows the staged path's submission: 1 and 2 GB/s
        # against the 4 GB/s socket.
        "| engine, 1 MiB descriptors (stall_guard) GB/s |",
        "| 16 MiB | 1.00 | 4.00 | 2.00 | n/a | 4.00 | 4.00 | 25% | 25% | 50% |",
    ):
        assert line in text, line
    assert "not in effect" not in text
    cells = summary["kv_path"]["cells"]
    assert [(c["state"], c["pass"], c["input_len"]) for c in cells[:3]] == [
        ("staged", "fresh", 1024), ("staged", "fresh", 4096),
        ("staged", "fragmented", 1024),
    ]  # fmt: skip
    assert cells[0]["vs_engine_bulk"] == pytest.approx(64 * BLOCK / 0.025 / 1e9)
    assert cells[0]["vs_engine_chunked"] == pytest.approx(64 * BLOCK / 0.025 / 2e9)
    assert sum("KV staging" in t["name"] for t in summary["targets"]) == 3


def test_report_breaks_staged_sends_down_by_phase(run_dir: Path) -> None:
    """Gather, write and scatter p50s beside the transfer and TTFT; direct
    sends have no phases ("-"); a request sent directly in the staged state
    (it did not fit) is left out of the p50s and the staged count."""
    write_kv_path_run(run_dir)
    kv = run_dir / "kv_path" / "staged" / "fresh" / "pd-in4096-c1-r2.kv.json"
    kv.write_text(json.dumps(json.loads(kv.read_text()) | dict.fromkeys(
        map(kv_phases.key, kv_phases.PHASES), 0.0)))  # fmt: skip
    summary, text = built(run_dir)
    assert ("| state | pass | prompt | staged requests | gather p50 ms | "
            "write p50 ms | scatter p50 ms | transfer p50 ms | TTFT p50 ms |"
            ) in text  # fmt: skip
    assert "| staged | fresh | 1024 | 3 | 3.0 | 21.0 | 4.0 | 25.0 | 2,001 |" in text
    assert "| staged | fresh | 4096 | 2 | 12.0 | 85.0 | 15.0 | 100.0 | 10,001 |" in text
    assert "| direct | fragmented | 4096 | 0 | - | - | - | 800.0 | 11,001 |" in text
    cells = {(c["state"], c["pass"], c["input_len"]): c
             for c in summary["kv_path"]["cells"]}  # fmt: skip
    staged = cells[("staged", "fragmented", 4096)]
    assert (staged["staged_requests"], staged["write_ms_p50"]) == (3, 85.0)
    assert staged["gather_ms_p50"] == pytest.approx(12.0)
    assert staged["scatter_ms_p50"] == pytest.approx(15.0)
    direct = cells[("direct", "fresh", 1024)]
    assert direct["staged_requests"] == 0 and direct["scatter_ms_p50"] is None


def test_kv_path_phases_of_a_run_without_them_are_not_made_up(run_dir: Path) -> None:
    """A run from before the phases were recorded: n/a, not "-" or 0."""
    write_kv_path_run(run_dir, phases=False)
    summary, text = built(run_dir)
    assert "| staged | fresh | 1024 | n/a | n/a | n/a | n/a | 25.0 | 2,001 |" in text
    assert all(c["staged_requests"] is None for c in summary["kv_path"]["cells"])


def staging(**phases: float) -> m.Snapshot:
    """Staging seconds by phase, as a server's /metrics gives them."""
    return m.Snapshot(
        {(m.STAGING_SECONDS, frozenset({("phase", p)})): v for p, v in phases.items()}
    )


def test_decode_phases_settle_like_prefills_counters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode's scatter over a request: read once its KV is in (tokens
    loaded) and three scrapes agree; prefill's phases from a delta."""

    def snap(scatter: float, loaded: float) -> m.Snapshot:
        phase = frozenset({("phase", "scatter"), ("engine", "0")})
        return m.Snapshot({(m.STAGING_SECONDS, phase): scatter,
                           (m.EXTERNAL_HITS, frozenset()): loaded})  # fmt: skip

    reads = iter([snap(0, 0), snap(0.01, 1023), snap(0.02, 1023), snap(0.02, 1023),
                  snap(0.02, 1023), snap(0.5, 2000)])  # fmt: skip
    monkeypatch.setattr(m, "scrape", lambda url, timeout=10.0: next(reads))
    got = kv_phases.settle_decode("http://d", snap(0, 0), 1, 20.0)
    assert got == {"scatter_seconds": 0.02, kv_phases.LOADED: 1023,
                   kv_phases.FAILED: 0}  # fmt: skip
    assert kv_phases.totals(staging(gather=0.003, write=0.021), kv_phases.PREFILL) == {
        "gather_seconds": 0.003, "write_seconds": 0.021}  # fmt: skip
    assert kv_phases.staged({"gather_seconds": 0.0, "scatter_seconds": 0.0}) is False
    assert kv_phases.staged({"seconds": 0.1}) is None


def kv_path_targets(run_dir: Path) -> dict[str, Any]:
    """The KV path's three targets, by the words after 'KV staging: '."""
    comparisons = te.compare(te.from_json(ENGINE_JSON))
    checks = judge([], None, comparisons, None, None, (), kv_path.read(run_dir))
    ours = [t for t in checks if t.name.startswith("KV staging: ")]
    return {t.name.split(": ")[1].split(",")[0]: t for t in ours}


def test_kv_path_targets_are_judged_by_their_numbers(tmp_path: Path) -> None:
    write_kv_path_run(tmp_path)
    got = kv_path_targets(tmp_path)
    rate, frag, share = (got[k] for k in ("stack rate vs engine bulk",
                                          "fragmented rate vs fresh",
                                          "transfer share of TTFT"))  # fmt: skip
    # 797 and 766 MB/s against 1 GB/s: 77-80%, over 70%.
    assert rate.met is True and "1024 fragmented: 76.6%" in rate.measured
    assert "4096 fresh 797 vs 1,000 MB/s (64 MiB)" in rate.note
    # 766 / 797 = 96% at 1024; direct's own drop is the note.
    assert frag.met is True and frag.measured == "1024: 96.2%; 4096: 100.0%"
    assert frag.note.startswith("direct: 1024 25.0%, 4096 25.0%")
    # 100 ms of 10,001: 1.0%, on the line.
    assert share.met is True and "fresh 100 of 10,001 ms" in share.note
    # A slower staged 4096 fresh pass misses all three, each with its advice.
    slower = {1024: (19, 0.025, 2000.0), 4096: (76, 0.2, 10_000.0)}
    write_kv_path_run(tmp_path, {("staged", "fresh"): slower})
    missed = kv_path_targets(tmp_path)
    assert [t.met for t in missed.values()] == [False, True, False]
    assert all(t.advice for t in missed.values() if t.met is False)
    # More than 100%: the fragmented pass may be faster, still "the same".
    assert missed["fragmented rate vs fresh"].measured.endswith("4096: 200.0%")


def test_kv_path_targets_without_measurements(tmp_path: Path) -> None:
    """No run: not measured; no engine results: the rate is not judged; a
    length missing from a pass leaves its target unresolved, not met."""
    # The KV path's three and bench.transfer_cost's two, last.
    assert all(t.met is None for t in judge([], None, [], None)[-5:])
    write_kv_path_run(tmp_path)
    checks = judge([], None, [], None, None, (), kv_path.read(tmp_path))
    (rate,) = [t for t in checks if "vs engine bulk" in t.name]
    assert rate.met is None and "no engine results" in rate.measured
    for p in (tmp_path / "kv_path" / "staged" / "fragmented").glob("pd-in4096-*"):
        p.unlink()
    frag = kv_path_targets(tmp_path)["fragmented rate vs fresh"]
    assert frag.met is None and "not measured: 4096" in frag.note


def test_kv_path_says_when_staging_was_not_in_effect(run_dir: Path) -> None:
    """Negative control: a 'staged' state that sent what direct sent (a plugin
    without staging) is named in the section and the targets' notes."""
    same = {(state, name): by for (_, name), by in KV_PATHS.items()
            if _ == "direct" for state in ("staged", "direct")}  # fmt: skip
    write_kv_path_run(run_dir, same)
    _, text = built(run_dir)
    assert "(4096 tokens: fresh 18 vs 18, fragmented 2304 vs 2304): staging was" in text
    assert all("not in effect" in t.note for t in kv_path_targets(run_dir).values())


def test_kv_path_plan_sends_the_same_distinct_prompts_in_both_states(
    tmp_path: Path,
) -> None:
    chosen = bench_settings(BENCH_KV_PATH_REQUESTS="2")
    plans = [
        kv_path.plan(chosen, "http://r", "http://p", kv_path.state_dir(tmp_path, s),
                     "/tok", decode="http://d")
        for s in kv_path.STATES
    ]  # fmt: skip
    staged, direct = ([(lv.input_len, lv.seed) for lv in p.levels] for p in plans)
    assert staged == direct and len(staged) == 1 + 3 * 2 + 1 + 3 * 2
    assert len({seed for _, seed in staged}) == len(staged)
    levels_ = plans[0].levels
    assert levels_[0].result_file.endswith("staged/fresh/warmup-in128.json")
    burst = levels_[7]
    assert burst.result_file.endswith("staged/burst.json")
    assert (burst.concurrency, burst.num_prompts) == (8, 16) and burst.range_ratio
    assert burst.timeout_s and burst.output_len and burst.kv_file
    single = [lv for lv in levels_ if lv is not burst]
    assert all(lv.num_prompts == lv.concurrency == 1 for lv in single)
    assert all(lv.kv_file and lv.prefill_url for lv in levels_)
    assert all(lv.decode_url == "http://d" for lv in levels_)
    assert levels_[8].result_file.endswith("staged/fragmented/pd-in128-c1-r0.json")
    assert (tmp_path / "kv_path" / "direct" / "fragmented").is_dir()
    # The checksum's requests are other prompts.
    checksum = kv_checksum.plan(chosen, "http://r", "http://p", tmp_path, "/tok")
    assert not {lv.seed for lv in checksum.levels} & {seed for _, seed in staged}


def test_kv_path_engine_sizes_are_the_configured_ones_nearest_its_transfers(
    tmp_path: Path,
) -> None:
    write_kv_path_run(tmp_path)
    sizes = settings.parse_sizes(settings.DEFAULT_TRANSFER_SIZES)
    assert kv_path.sizes_for(kv_path.read(tmp_path), sizes) == (16 << 20, 64 << 20)
    assert kv_path.sizes_for(None, sizes) == ()
    # Nothing within a factor of 4: no size is a transfer's own.
    assert kv_path.sizes_for(kv_path.read(tmp_path), (64 << 10,)) == ()


def test_a_stack_restarts_with_its_setting_and_only_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bench.stack.restart_pd, the one way the checksum and KV path steps
    change a setting: the P/D servers' environment, never the bench's own."""
    seen: list[tuple[str, str | None]] = []
    own: Any = SimpleNamespace(stop=lambda n: seen.append(("stop", ",".join(n))))

    def start(own: Any, profile: str) -> tuple[Any, dict[str, float], list[str]]:
        seen.append(("start", os.environ.get("PD_MOONCAKE_KV_STAGING_MIB")))
        return None, {"total": 1.0}, []

    monkeypatch.delenv("PD_MOONCAKE_KV_STAGING_MIB", raising=False)
    monkeypatch.setattr(stack, "_start_pd", start)
    stack.restart_pd(own, "tiny", {"PD_MOONCAKE_KV_STAGING_MIB": "0"})
    stack.restart_pd(own, "tiny", {})
    assert seen == [("stop", "router,decode,prefill"), ("start", "0"),
                    ("stop", "router,decode,prefill"), ("start", None)]  # fmt: skip
    assert "PD_MOONCAKE_KV_STAGING_MIB" not in os.environ


def test_a_levels_kv_file_has_both_servers_phases(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """bench.vllm_bench around a level with a KV file and a decode URL: the
    counters, gather and write settled from prefill, the scatter from decode."""
    after = {
        "http://p": m.Snapshot({**staging(gather=0.003, write=0.021).samples,
                                (m.TRANSFERS, frozenset()): 1.0}),
        "http://d": m.Snapshot({**staging(scatter=0.004).samples,
                                (m.EXTERNAL_HITS, frozenset()): 1023.0}),
    }  # fmt: skip
    scrapes: list[str] = []

    def scrape(url: str, timeout: float = 10.0) -> m.Snapshot:
        scrapes.append(url)
        return m.Snapshot({}) if scrapes.count(url) == 1 else after[url]

    result = tmp_path / "pd-in1024-c1-r0.json"

    def run_level(parser: Any, plan: Any, level: Any, timeout_s: float) -> str:
        result.write_text(json.dumps({"completed": 1}))
        return "ok"

    monkeypatch.setattr(m, "scrape", scrape)
    monkeypatch.setattr(vllm_bench, "_parser", lambda: None)
    monkeypatch.setattr(vllm_bench, "_run_level", run_level)
    kv = tmp_path / "pd-in1024-c1-r0.kv.json"
    level = Level("pd", "http://r", 1024, 1, 1, 0, str(result), "http://p",
                  str(kv), decode_url="http://d")  # fmt: skip
    assert vllm_bench.run(Plan("m", "t", 2, 60.0, (level,))) == 0
    got = json.loads(kv.read_text())
    assert (got["transfers"], got["gather_seconds"], got["write_seconds"]) == (
        1.0, 0.003, 0.021)  # fmt: skip
    assert (got["scatter_seconds"], got["decode_loaded_tokens"]) == (0.004, 1023.0)
