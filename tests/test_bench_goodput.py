"""The goodput sweep's judgements on small inputs written as the bench writes
them: the SLO knob, each level's KV evidence (each check with its negative
control), the report's answers (a P/D level whose evidence failed is not a
result), the plan sized by the stack, bad input as one line. No speed."""

from __future__ import annotations

import argparse
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import evidence, goodput, preflight, rate_sweep, report, settings, slo
from bench.vllm_bench import Plan, bench_serve_args

REGIONS = [f"layer{i}" for i in range(3)]


# --- the SLO --------------------------------------------------------------------------
def test_slo_parses_the_knob_and_reads_each_targets_defaults() -> None:
    assert slo.parse("ttft=2000,tpot=50") == slo.Slo(2000, 50)
    assert slo.parse("tpot:40ms, ttft:900") == slo.Slo(900, 40)
    assert slo.parse("ttft=2000,tpot=50").goodput_args() == ["ttft:2000", "tpot:50"]
    cpu, gpu = slo.default("cpu"), slo.default("gpu")
    assert cpu.ttft_ms > gpu.ttft_ms and cpu.tpot_ms > gpu.tpot_ms
    assert slo.chosen("", "gpu") == (gpu, "configs/targets/gpu.yaml (bench.slo)")
    for bad in ("ttft=2000", "ttft=x,tpot=1", "e2e=5,ttft=1,tpot=1", "ttft=0,tpot=1"):
        with pytest.raises(slo.SloError, match="BENCH_SLO"):
            slo.parse(bad)


def test_good_share_counts_failed_requests_as_missed() -> None:
    result = {"request_goodput": 0.5, "duration": 10.0, "completed": 6, "failed": 4}
    assert slo.good_requests(result) == 5
    assert slo.good_share(result) == 0.5
    with pytest.raises(slo.SloError):
        slo.good_requests({"duration": 1.0})


# --- the evidence ---------------------------------------------------------------------
def found(lens: list[int], **change: Any) -> dict[str, Any]:
    """A level's evidence as bench.evidence.capture writes it, all well."""
    data = {
        "plugin": True, "external_kv_transfer": float(sum(lens)),
        "local_compute": 0.0, "checksum_on": True,
        "checksum_matched": {r: float(len(lens)) for r in REGIONS},
        "checksum_mismatched": 0.0, "failed_recvs": 0.0, "failed_transfers": 0.0,
        "retried_transfers": 0.0, "transfers": float(len(lens)),
        "transfer_seconds": 0.01 * len(lens),
    }  # fmt: skip
    return data | change


def test_evidence_verifies_every_request() -> None:
    verdict = evidence.judge(found([128, 130]), [128, 130])
    assert verdict.status == evidence.VERIFIED, verdict.detail
    assert "258 tokens loaded" in verdict.detail and "all 3 regions" in verdict.detail
    off = found([128], checksum_on=False, checksum_matched={})
    assert evidence.judge(off, [128]).status == evidence.VERIFIED


@pytest.mark.parametrize(
    ("change", "why"),
    [
        # Decode recomputed the prompts: fast, and no KV crossed.
        ({"external_kv_transfer": 0.0, "local_compute": 258.0}, "loaded 0 prompt"),
        ({"external_kv_transfer": 130.0}, "loaded 130"),
        ({"local_compute": 2.0}, "computed 2"),
        ({"checksum_mismatched": 1.0}, "checksums differed"),
        ({"checksum_matched": {"layer0": 2.0, "layer1": 2.0, "layer2": 1.0}}, "layer2"),
        ({"checksum_matched": {}}, "no region verified"),
        ({"failed_recvs": 1.0}, "failed recvs"),
        ({"failed_transfers": 1.0}, "failed transfers"),
    ],
)
def test_evidence_negative_controls(change: dict[str, Any], why: str) -> None:
    verdict = evidence.judge(found([128, 130], **change), [128, 130])
    assert verdict.failed and why in verdict.detail, verdict


def test_evidence_without_the_plugin_is_not_measurable() -> None:
    for data in (None, found([128], plugin=False)):
        verdict = evidence.judge(data, [128])
        assert verdict.status == evidence.UNMEASURABLE and not verdict.failed


# --- the report -----------------------------------------------------------------------
def write_level(where: Path, target: str, rate: float | None, share: float,
                lens: list[int], ev: dict[str, Any] | None = None) -> None:  # fmt: skip
    name = (
        f"{target}-{rate_sweep.PROBE if rate is None else rate_sweep.rate_name(rate)}"
    )
    n, duration = len(lens), 10.0
    result = {
        "completed": n, "failed": 0, "duration": duration,
        "request_goodput": share * n / duration, "request_throughput": n / duration,
        "output_throughput": 16 * n / duration, "mean_ttft_ms": 500.0,
        "mean_tpot_ms": 100.0, "mean_e2el_ms": 2000.0, "input_lens": lens,
        "errors": [""] * n,
        **{f"p{q}_{k}_ms": 100.0 * q / 50 for k in goodput.LATENCIES
           for q in goodput.PCTS},
    }  # fmt: skip
    (where / f"{name}.json").write_text(json.dumps(result))
    (where / f"{name}.status.json").write_text(json.dumps({"status": "ok"}))
    if target == "pd":
        data = found(lens) if ev is None else ev
        (where / f"{name}.evidence.json").write_text(json.dumps(data))


def goodput_run(tmp_path: Path, tampered: float | None = None) -> Path:
    """A sweep at 0.25, 0.5, 1 req/s: P/D holds the first two, colocated the
    first; ``tampered``: that P/D rate's evidence shows decode recomputing."""
    where = tmp_path / goodput.DIR
    where.mkdir(parents=True)
    plan = {"ttft_ms": 3000, "tpot_ms": 400, "input_len": 128, "output_len": 16,
            "num_prompts": 4, "slo_from": "t", "colocated_is": "prefill"}  # fmt: skip
    (where / "plan.json").write_text(json.dumps(plan))
    rates = [0.25, 0.5, 1.0]
    (where / "rates.json").write_text(json.dumps(rates))
    lens = [128] * 4
    for target in rate_sweep.TARGETS:
        write_level(where, target, None, 1.0, [128])
    for rate, pd_share, colo_share in zip(rates, (1.0, 1.0, 0.5), (1.0, 0.5, 0.0),
                                          strict=True):  # fmt: skip
        recomputed = found(lens, external_kv_transfer=0.0, local_compute=512.0)
        write_level(where, "pd", rate, pd_share, lens,
                    recomputed if rate == tampered else None)  # fmt: skip
        write_level(where, "colocated", rate, colo_share, lens)
    return tmp_path


def test_report_opens_with_the_answers(tmp_path: Path) -> None:
    summary = report.build(goodput_run(tmp_path))
    text = (tmp_path / "report.md").read_text()
    first = text.split("## Answers", 1)[1].split("## Targets", 1)[0]
    assert "P/D sustains 0.5 req/s within the SLO" in first
    assert "against 0.25 req/s colocated (ratio 2.00x" in first
    assert "highest rate tried" not in first
    write_level(tmp_path / goodput.DIR, "colocated", 0.5, 1.0, [128] * 4)
    colocated_on_top = report.build(tmp_path)["answers"][0]
    assert "(ratio 1.00x" in colocated_on_top
    # The stack's lines, then the goodput table, all before the targets.
    assert text.index("## Goodput against") < text.index("## Targets")
    assert "KV transfer is 2.0% of P/D's TTFT at 128 tokens" in first
    assert "Every request's KV crossed and was verified (13 requests" in first
    assert summary["goodput"]["sustained_req_per_s"] == {"pd": 0.5, "colocated": 0.25}
    assert summary["answers"] == summary["goodput"]["answers"]
    assert (tmp_path / goodput.DIR / goodput.PLOT).stat().st_size > 0


def test_a_level_whose_evidence_failed_is_not_a_result(tmp_path: Path) -> None:
    """Negative control: P/D's 0.5 req/s met the SLO, but decode recomputed."""
    summary = report.build(goodput_run(tmp_path, tampered=0.5))
    text = (tmp_path / "report.md").read_text()
    assert summary["goodput"]["sustained_req_per_s"]["pd"] == 0.25
    assert "KV evidence FAILED in 1 of 4 P/D levels (0.5 req/s: decode loaded 0" in text
    assert "**failed**: decode loaded 0" in text


def test_a_target_holding_the_highest_rate_is_said_to_go_higher(
    tmp_path: Path,
) -> None:
    run = goodput_run(tmp_path)
    write_level(run / goodput.DIR, "pd", 1.0, 1.0, [128] * 4)
    (answer, *_) = report.build(run)["answers"]
    assert "P/D sustains 1 req/s" in answer
    assert "P/D held the highest rate tried, so the limit lies higher" in answer
    for rate in (0.5, 1.0):  # held at every rate, the one missed before too
        write_level(run / goodput.DIR, "colocated", rate, 1.0, [128] * 4)
    (answer, *_) = report.build(run)["answers"]
    assert "P/D and colocated held the highest rate tried" in answer


def test_a_sweep_stopped_by_an_unreachable_slo_answers_nothing(tmp_path: Path) -> None:
    run = goodput_run(tmp_path)
    (run / goodput.DIR / "error.txt").write_text("bench: SLO ... raise BENCH_SLO\n")
    summary = report.build(run)
    assert summary["answers"] == ["No answer: bench: SLO ... raise BENCH_SLO"]


# --- the plan and bad input -----------------------------------------------------------
def test_rates_start_at_one_at_a_time_and_double() -> None:
    assert rate_sweep.rates(2000.0, 3) == [0.5, 1.0, 2.0]


def test_goodput_levels_pass_rate_slo_and_remote_code_to_vllm_bench_serve(
    tmp_path: Path,
) -> None:
    plan = rate_sweep.RatePlan(
        model="m", tokenizer="/tok", input_len=128, output_len=16, num_prompts=8,
        ttft_ms=2000, tpot_ms=50, urls={"pd": "http://r", "colocated": "http://p"},
        prefill_urls=["http://p"], decode_urls=["http://d"], steps=3,
        level_timeout_s=60, budget_s=100, out=str(tmp_path), trust_remote_code=True,
    )  # fmt: skip
    level = plan.level("pd", "r0.5", 0.5, 8, 1, 60)
    args = bench_serve_args(plan.bench_plan(), level)
    assert args[args.index("--request-rate") + 1] == "0.5"
    assert args[args.index("--goodput") + 1 : args.index("--goodput") + 3] == [
        "ttft:2000", "tpot:50"]  # fmt: skip
    assert "--trust-remote-code" in args
    assert "--trust-remote-code" not in bench_serve_args(
        Plan("m", "/t", 1, 1, ()), level
    )
    pytest.importorskip("vllm")
    from bench.vllm_bench import _parser

    parsed = _parser().parse_args(args)
    assert parsed.goodput == ["ttft:2000", "tpot:50"] and parsed.request_rate == 0.5
    assert parsed.trust_remote_code and parsed.metric_percentiles == "50,90,99"


def parse(env: dict[str, str]) -> settings.Settings:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, env)
    return settings.from_args(parser.parse_args([]))


def test_the_colocated_reference_defaults_to_prefill() -> None:
    urls = {f"BENCH_{n}_URL": f"http://{n.lower()}" for n in ("ROUTER", "PREFILL",
                                                              "DECODE")}  # fmt: skip
    chosen = parse(urls)
    assert chosen.urls is not None and chosen.urls.colocated == "http://prefill"
    assert chosen.colocated_is_prefill
    given = parse(urls | {"BENCH_COLOCATED_URL": "http://colo"})
    assert given.urls is not None and given.urls.colocated == "http://colo"
    assert not given.colocated_is_prefill
    with pytest.raises(settings.SettingsError, match="BENCH_DECODE_URL"):
        parse({"BENCH_ROUTER_URL": "http://r", "BENCH_PREFILL_URL": "http://p"})


def test_bad_input_is_one_line_naming_the_fix() -> None:
    info = preflight.StackInfo("m", 1024, None)
    preflight.check_lengths(info, 1000, 24)
    with pytest.raises(preflight.BenchInputError, match="BENCH_GOODPUT_INPUT_LEN"):
        preflight.check_lengths(info, 1000, 25)
    with pytest.raises(preflight.BenchInputError, match="BENCH_ROUTER_URL") as err:
        preflight.inspect(
            {"router": "http://127.0.0.1:9", "prefill": "x", "decode": "y"}
        )
    assert "\n" not in str(err.value)


@pytest.fixture
def keyed_server() -> Iterator[str]:
    """An HTTP server that, like compose's router front, refuses /v1 without
    the key ``k``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.headers.get("Authorization") == "Bearer k"
            body = json.dumps({"data": [{"id": "m", "max_model_len": 64}]})
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(body.encode() if ok else b"unauthorized")

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_refused_key_names_the_knob(keyed_server: str) -> None:
    urls = {name: keyed_server for name in ("router", "prefill", "decode")}
    from pdstack import client

    try:
        for key in (None, "wrong"):
            client.use_api_key(key)
            with pytest.raises(
                preflight.BenchInputError, match=r"401.*BENCH_API_KEY_FILE"
            ):
                preflight.inspect(urls)
        client.use_api_key("k")  # the right key: the stack read (no /metrics here)
        assert preflight.inspect(urls) == preflight.StackInfo("m", 64, None)
    finally:
        client.use_api_key(None)
