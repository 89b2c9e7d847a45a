"""The engine between hosts (bench.hosts_link): recorded JSON read back and
classified, and one real, quick measurement between network namespaces.

The fixture (bench/fixtures/small-run/hosts_link.json) is a real
`python -m bench hosts-link` at 8 MiB x 2 on a busy machine: unshaped,
1 Gbit/s (the socket fills the link: judged) and 5 Gbit/s (the socket
reaches 83% of it: CPU-bound, not judged).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import hosts_link as hl
from bench import loopback
from pdstack import netns

FIXTURE = Path(__file__).resolve().parent.parent / "bench" / "fixtures" / "small-run"
RECORDED = json.loads((FIXTURE / "hosts_link.json").read_text())
# The real test's own tag (not "bl", which `make bench` uses, nor "mh"/"ut").
TEST_TAG = "blt"
REASON = netns.missing_privileges()


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


def test_a_peer_in_a_missing_namespace_says_so() -> None:
    with pytest.raises(loopback.PeerError, match="start: FileNotFoundError"):
        loopback.Peer(loopback.Endpoint, 16, netns="pdh-blt-none")


@pytest.mark.skipif(REASON is not None, reason=f"needs root: {REASON}")
def test_engine_and_socket_between_hosts_for_real() -> None:
    """Real namespaces, real engines: 8 MiB once over a 1 Gbit/s link, the
    engine's bytes checked at the receiver; the network gone afterwards."""
    net = netns.Network(TEST_TAG, [hl.HOST])
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
