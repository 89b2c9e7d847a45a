"""Several prefills and decodes behind one router (bench.topology): the knob
(one URL per server, comma-separated), the count asked of the real
vllm-router (``GET /workers``) and refused where it differs from the URLs
given, the evidence summed over every decode (its negative control: one
decode of two read is a failed level), and the report labelled with the P:D
ratio. No speed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import (
    evidence,
    goodput,
    http_tap,
    preflight,
    report,
    router_capture,
    settings,
    topology,
)
from pdstack import metrics as m
from pdstack import supervisor
from tests.test_bench_goodput import goodput_run

MODEL = "pd-model"
REGIONS = ("layer0", "layer1")


def parse(env: dict[str, str]) -> settings.Settings:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, env)
    return settings.from_args(parser.parse_args([]))


# --- the knob -------------------------------------------------------------------------
def test_one_url_per_server_comma_separated() -> None:
    chosen = parse({
        "BENCH_ROUTER_URL": "http://r", "BENCH_PREFILL_URL": "http://p0/, http://p1",
        "BENCH_DECODE_URL": "http://d0,http://d1,",
    })  # fmt: skip
    assert chosen.prefill_urls == ("http://p0", "http://p1")
    assert chosen.decode_urls == ("http://d0", "http://d1")
    # The steps that talk to one server, and the colocated reference, get
    # the first of each.
    assert chosen.urls is not None
    assert (chosen.urls.prefill, chosen.urls.decode) == ("http://p0", "http://d0")
    assert chosen.urls.colocated == "http://p0"
    with pytest.raises(settings.SettingsError, match="BENCH_ROUTER_URL takes one"):
        parse({"BENCH_ROUTER_URL": "http://r,http://r2", "BENCH_PREFILL_URL": "p",
               "BENCH_DECODE_URL": "d"})  # fmt: skip
    assert topology.label(2, 1) == "2P:1D"


# --- the count, from the real router --------------------------------------------------
@pytest.fixture
def router_2p2d(tmp_path: Path):
    """The real vllm-router (pdstack.route, the stack's flags) in front of
    two stub prefills and two stub decodes."""
    stubs = [router_capture.stub_vllm(MODEL) for _ in range(4)]
    taps = [
        http_tap.Tap(f"s{i}", supervisor.free_port(), None, respond=stub)
        for i, stub in enumerate(stubs)
    ]
    boot = http_tap.Tap(
        "bootstrap", supervisor.free_port(), None, respond=router_capture.stub_bootstrap
    )
    urls = supervisor.Urls(
        router=f"http://127.0.0.1:{supervisor.free_port()}",
        prefill=f"{taps[0].url},{taps[1].url}",
        decode=f"{taps[2].url},{taps[3].url}",
        bootstrap_port=boot.port,
    )
    argv = supervisor.router_command(urls, metrics_port=supervisor.free_port(),
                                     internal_port=supervisor.free_port())  # fmt: skip
    procs = supervisor.Processes(tmp_path, "router.json", lambda _: None)
    with http_tap.TapServer([*taps, boot]):
        procs.launch("router", argv, {}, urls.router)
        try:
            procs.wait_healthy("router", 60)
            yield urls
        finally:
            procs.stop()


def test_the_router_says_how_many_serve_behind_it(
    router_2p2d: supervisor.Urls,
) -> None:
    urls = router_2p2d
    routed = topology.behind_router(urls.router)
    assert routed is not None
    # vllm-router lists its workers in no fixed order.
    assert {role: sorted(u) for role, u in routed.items()} == {
        "prefill": sorted(topology.split(urls.prefill)),
        "decode": sorted(topology.split(urls.decode)),
    }
    prefills, decodes = topology.split(urls.prefill), topology.split(urls.decode)
    servers = topology.check(urls.router, prefills, decodes)
    assert servers.label == "2P:2D" and servers.source == topology.FROM_ROUTER
    # Negative control: one decode given of the router's two. Its requests'
    # KV would go unread; the run ends naming the knob.
    with pytest.raises(preflight.BenchInputError, match="BENCH_DECODE_URL names 1"):
        topology.check(urls.router, prefills, decodes[:1])
    with pytest.raises(preflight.BenchInputError, match="routes to 2 prefill"):
        topology.check(urls.router, prefills[:1], decodes)


def test_a_router_without_a_list_leaves_the_urls_given() -> None:
    servers = topology.check("http://127.0.0.1:9", ("http://p",), ("http://d",))
    assert servers.label == "1P:1D" and servers.source == topology.FROM_URLS


# --- the evidence, summed over every decode -------------------------------------------
def decode_scrape(loaded: float, computed: float, verified: float) -> m.Snapshot:
    """One decode's /metrics as pdstack.metrics parses them: the plugin
    loaded, the checksum on, ``verified`` requests matched per region."""
    samples = {
        (m.KV_CACHE_INFO, frozenset({("kv_dtype", "bfloat16")})): 1.0,
        (m.CHECKSUM_ENABLED, frozenset()): 1.0,
        (m.PROMPT_TOKENS_BY_SOURCE, frozenset({("source", "external_kv_transfer")})):
            loaded,
        (m.PROMPT_TOKENS_BY_SOURCE, frozenset({("source", "local_compute")})): computed,
        **{(m.CHECKSUM_MATCH, frozenset({("region", r)})): verified for r in REGIONS},
    }  # fmt: skip
    return m.Snapshot(samples)


def prefill_scrape(transfers: float) -> m.Snapshot:
    return m.Snapshot({(m.TRANSFERS, frozenset()): transfers})


def test_evidence_is_summed_over_every_decode_and_prefill() -> None:
    """Three 128-token requests: two on decode 0, one on decode 1 (the
    router spreads them). Both decodes read: verified, each one's share said.
    Negative control: decode 0 alone read, the level fails, as the e2e
    suite's checks fail a decode that did not load its prompts."""
    lens = [128, 128, 128]
    zero = decode_scrape(0, 0, 0)
    d0, d1 = decode_scrape(256, 0, 2), decode_scrape(128, 0, 1)
    decodes = {"http://d0": (d0 - zero, d0), "http://d1": (d1 - zero, d1)}
    prefills = {"http://p0": prefill_scrape(2), "http://p1": prefill_scrape(1)}
    both = evidence.capture(decodes, prefills)
    verdict = evidence.judge(both, lens)
    assert verdict.status == evidence.VERIFIED, verdict.detail
    assert "256 + 128 over 2 decodes" in verdict.detail
    assert "2 + 1 over 2 prefills" in verdict.detail
    assert both["transfers"] == 3
    first_only = evidence.capture({"http://d0": decodes["http://d0"]}, prefills)
    failed = evidence.judge(first_only, lens)
    assert failed.failed and "loaded 256 prompt tokens" in failed.detail, failed
    assert "verified" in failed.detail and "expected 3 per region" in failed.detail
    # A decode without the plugin makes the sum no evidence at all.
    bare = m.Snapshot({})
    mixed = {**decodes, "http://d2": (bare, bare)}
    assert not evidence.capture(mixed, prefills)["plugin"]


def test_snapshots_add_per_sample() -> None:
    a = prefill_scrape(2) + m.Snapshot({(m.BYTES, frozenset()): 5.0})
    assert (a + prefill_scrape(1)).total(m.TRANSFERS) == 3
    assert a.total(m.BYTES) == 5


# --- the label ------------------------------------------------------------------------
def test_the_report_is_labelled_with_the_ratio(tmp_path: Path) -> None:
    run = goodput_run(tmp_path)
    plan_file = run / goodput.DIR / "plan.json"
    plan = json.loads(plan_file.read_text()) | {
        "prefill_urls": ["http://p0", "http://p1"],
        "decode_urls": ["http://d0", "http://d1"],
        "servers_from": topology.FROM_ROUTER,
    }
    plan_file.write_text(json.dumps(plan))
    meta = {"started": "t", "servers": {"ratio": "2P:2D"}}
    (run / "meta.json").write_text(json.dumps(meta))
    summary = report.build(run)
    assert summary["pd_ratio"] == summary["goodput"]["pd_ratio"] == "2P:2D"
    assert summary["answers"][0].startswith("P/D 2P:2D sustains")
    text = (run / "report.md").read_text()
    assert text.startswith("# P/D 2P:2D vs colocated")
    assert "every decode (http://d0, http://d1)" in text
