"""bench.hosts_link: its target and report table from recorded JSON, and one
real, quick measurement between network namespaces.

The fixture (bench/fixtures/small-run/hosts_link.json) is a real
`python -m bench hosts-link` at 8 MiB x 2 on a busy machine: unshaped,
1 Gbit/s (the socket fills the link: judged) and 5 Gbit/s (the socket
reaches 83% of it: CPU-bound, not judged).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import hosts_link as hl
from bench import loopback, run
from bench.targets import HOSTS_LINK_TARGET, judge
from pdstack import netns
from tests.shared import SMALL_RUN, bench_settings, built

RECORDED = json.loads((SMALL_RUN / "hosts_link.json").read_text())
REASON = netns.missing_privileges()
HOSTS_TARGET = 6
CPU_BOUND = "not judged, CPU-bound: the socket reaches only"


def rates(**one_gbit: Any) -> list[hl.Rate]:
    """The recorded rates, with fields of the 1 Gbit/s one changed."""
    return [hl.Rate(**(r | one_gbit if r["rate"] == "1gbit" else r)) for r in RECORDED]


def verdict(data: list[hl.Rate]) -> Any:
    target = judge([], None, [], None, None, data)[HOSTS_TARGET]
    assert target.name.startswith("Engine between hosts")
    return target


def test_recorded_rates_round_trip_and_classify() -> None:
    recorded = hl.from_json(RECORDED)
    assert hl.from_json(json.loads(json.dumps(hl.to_json(recorded)))) == recorded
    by_rate = {r.rate: r for r in recorded}
    assert set(by_rate) == {None, "1gbit", "5gbit"}
    assert all(r.verified and not r.error for r in recorded)
    one = by_rate["1gbit"]
    assert one.link_bps == 125e6 and one.label == "1 Gbit/s"
    assert one.engine_vs_link == pytest.approx(one.engine_bps / 125e6)
    assert one.link_limited and not one.cpu_bound
    assert by_rate["5gbit"].cpu_bound and not by_rate["5gbit"].link_limited
    assert by_rate[None].cpu_bound and by_rate[None].engine_vs_link is None
    assert hl.parse_rates("unshaped, 1gbit,500mbit") == (None, "1gbit", "500mbit")
    with pytest.raises(hl.HostsLinkError):
        hl.parse_rates("1gbps")


def test_target_judges_only_where_the_link_is_the_limit() -> None:
    target = verdict(rates())
    assert target.met is True and target.advice == ""
    assert "1 Gbit/s: 95.2%" in target.measured
    # 5 Gbit/s: the socket short of the rate too, so reported with why.
    assert f"5 Gbit/s {CPU_BOUND} 83.5% too" in target.measured
    assert "unshaped: engine 0.71 vs socket 0.72 GB/s" in target.note
    # Nothing measured: unresolved.
    assert verdict([]).met is None and verdict([]).measured == "not measured"
    assert judge([], None, [], None)[HOSTS_TARGET].met is None


def test_target_negative_controls() -> None:
    """The engine at half a link the socket fills misses; so does a failed
    rate; a slow engine where the CPU is the limit is not judged."""
    target = verdict(rates(engine_bps=0.5 * 125e6))
    assert target.met is False and "1 Gbit/s: 50.0%" in target.measured
    assert "50.0% of the rate" in target.advice
    failed = verdict(rates(error="PeerError: Receiver exited (1)"))
    assert failed.met is False and "failed" in failed.measured
    cpu = verdict(rates(engine_bps=0.5 * 125e6, socket_bps=0.6 * 125e6))
    assert cpu.met is None and f"1 Gbit/s {CPU_BOUND} 60.0% too" in cpu.measured
    # Just at the target and just under it.
    at = HOSTS_LINK_TARGET * 125e6
    assert verdict(rates(engine_bps=at)).met is True
    assert verdict(rates(engine_bps=at * 0.99)).met is False


def test_report_renders_the_hosts_table(run_dir: Path) -> None:
    summary, text = built(run_dir)
    assert "## Mooncake transfer engine between hosts" in text
    one = next(r for r in RECORDED if r["rate"] == "1gbit")
    row = next(line for line in text.splitlines() if line.startswith("| 1 Gbit/s |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    gbps = [f"{one[key] / 1e9:.3f}" for key in ("engine_bps", "socket_bps")]
    assert [*cells[1:4], cells[-1]] == ["0.125", *gbps, "the link"]
    assert any(line.startswith("| 5 Gbit/s |") and "CPU-bound" in line
               for line in text.splitlines())  # fmt: skip
    assert "| unshaped | n/a |" in text
    got = {r["rate"]: r for r in summary["hosts_link"]}
    assert got["5gbit"]["cpu_bound"] is True and got["1gbit"]["cpu_bound"] is False
    assert summary["targets"][HOSTS_TARGET]["met"] is True
    # Negative control: without the measurement, no table and no verdict.
    (run_dir / "hosts_link.json").unlink()
    summary, text = built(run_dir)
    assert "## Mooncake transfer engine between hosts" not in text
    assert summary["targets"][HOSTS_TARGET]["met"] is None


def test_a_peer_in_a_missing_namespace_says_so() -> None:
    with pytest.raises(loopback.PeerError, match="start: FileNotFoundError"):
        loopback.Peer(loopback.Endpoint, 16, netns="pdh-blt-none")


@pytest.mark.skipif(REASON is not None, reason=f"needs root: {REASON}")
def test_engine_and_socket_between_hosts_for_real() -> None:
    """Real namespaces, real engines: 8 MiB once over a 1 Gbit/s link, the
    engine's bytes checked at the receiver; the network gone afterwards."""
    # Its own tag: not "bl", which `make bench` uses, nor "mh"/"ut".
    net = netns.Network("blt", [hl.HOST])
    try:
        (result,) = hl.measure(
            8 << 20, 1, ("1gbit",), progress=lambda _: None, network=net
        )
    finally:
        net.remove()
    assert result.error == "" and result.verified
    assert result.engine_bps > 0 and result.socket_bps > 0
    methods = {s["method"]: s for s in result.samples}
    assert set(methods) == {"engine", "socket"}
    assert all(s["verified"] and len(s["seconds"]) == 1 for s in methods.values())
    # Over a 1 Gbit/s link neither can beat the rate by much (the bucket's
    # burst): both went through the shaped link, not loopback.
    assert result.engine_vs_link is not None and result.engine_vs_link < 1.5
    assert result.socket_vs_link is not None and result.socket_vs_link < 1.5
    assert not [ns for ns in netns.namespaces() if ns.startswith(net.base)]


def test_make_bench_step_runs_the_subcommand_or_says_why_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen = bench_settings(["--hosts-link-size", "8M"])
    calls: list[list[str]] = []
    monkeypatch.setattr(run, "_bench_subprocess", lambda a, *_: calls.append(a))
    monkeypatch.setattr(netns, "missing_privileges", lambda: "uid 65534")
    note = run.hosts_link_step(chosen, tmp_path, lambda _: None)
    assert note is not None and "not measured: uid 65534" in note and not calls
    monkeypatch.setattr(netns, "missing_privileges", lambda: None)
    assert run.hosts_link_step(chosen, tmp_path, lambda _: None) is None
    (args,) = calls
    assert args[:3] == ["hosts-link", "--json", str(tmp_path / "hosts_link.json")]
    assert args[3:] == ["--hosts-link-size", str(8 << 20), "--hosts-link-repeats", "3"]
    # What the step passes, the subcommand parses.
    parsed = bench_settings(args[3:])
    assert (parsed.hosts_link_size, parsed.hosts_link_repeats) == (8 << 20, 3)
