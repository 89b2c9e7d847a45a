"""Mooncake's transfer engine between two hosts, against a single TCP stream
over the same link, unshaped and shaped (``python -m bench hosts-link``);
docs/bench.md ("What runs", step 1) describes the hosts and the link.

The measurement is bench.transfer_engine's ``engine`` and ``socket``,
unchanged. Where the socket falls short of ``LINK_LIMITED`` of the shaped
rate, the CPU is the limit (2 cores: sender, receiver and the kernel's
veth/bridge work share them), so the engine is reported, not judged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench import loopback
from bench import transfer_engine as te
from bench.levels import fmt_gbps, fmt_pct, ratio, table
from pdstack import netns

TAG = "bl"  # its own /24; never "mh" (the multi-host twin) or "ut" (tests)
HOST = "recv"
# None: the link unshaped (a veth pair through a bridge: no rate but the CPU's).
RATES: tuple[str | None, ...] = (None, "1gbit", "5gbit")
UNSHAPED = "unshaped"
# The socket at this share of the rate or more: the link is the limit.
LINK_LIMITED = 0.90
# A rate's fields and figures in the report's summary.json.
SUMMARY = ("rate", "link_bps", "engine_bps", "socket_bps", "engine_vs_link",
           "socket_vs_link", "engine_vs_socket", "cpu_bound", "verified",
           "error")  # fmt: skip


class HostsLinkError(RuntimeError):
    pass


def parse_rates(text: str) -> tuple[str | None, ...]:
    """``unshaped,1gbit,5gbit`` -> (None, "1gbit", "5gbit")."""
    parts = [p.strip().lower() for p in text.split(",") if p.strip()]
    if not parts:
        raise HostsLinkError(f"no rates in {text!r} (e.g. unshaped,1gbit,5gbit)")
    rates = tuple(None if part == UNSHAPED else part for part in parts)
    try:
        for rate in filter(None, rates):
            netns.rate_bits(rate)  # what tc would not take raises
    except ValueError as exc:
        raise HostsLinkError(str(exc)) from None
    return rates


@dataclass
class Rate:
    """One link rate's measurement: medians of the samples, bytes per second."""

    rate: str | None
    size: int
    repeats: int
    engine_bps: float = 0.0
    socket_bps: float = 0.0
    verified: bool = False
    error: str = ""
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        bps = self.link_bps
        return UNSHAPED if bps is None else f"{bps * 8 / 1e9:g} Gbit/s"

    @property
    def link_bps(self) -> float | None:
        """The tc rate in bytes per second; None unshaped."""
        return None if self.rate is None else netns.rate_bits(self.rate) / 8

    @property
    def engine_vs_link(self) -> float | None:
        return ratio(self.engine_bps, self.link_bps)

    @property
    def socket_vs_link(self) -> float | None:
        return ratio(self.socket_bps, self.link_bps)

    @property
    def engine_vs_socket(self) -> float | None:
        return ratio(self.engine_bps, self.socket_bps)

    @property
    def link_limited(self) -> bool:
        """The link, not the CPU, is the limit: the socket fills it."""
        share = self.socket_vs_link
        return share is not None and share >= LINK_LIMITED

    @property
    def cpu_bound(self) -> bool:
        """Unshaped (no rate but the CPU's), or the socket short of the rate
        too; not claimed for a rate that failed."""
        return not self.error and not self.link_limited

    def summary(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in SUMMARY}


def measure(
    size: int,
    repeats: int,
    rates: Sequence[str | None] = RATES,
    progress: Callable[[str], None] = print,
    network: netns.Network | None = None,
) -> list[Rate]:
    """Each rate in turn on one network, built here and removed at the end
    (also when a measurement fails: that rate records its error)."""
    if reason := netns.missing_privileges():
        raise HostsLinkError(f"cannot build hosts: {reason}")
    net = network or netns.Network(TAG, [HOST])
    out: list[Rate] = []
    with net.up():
        host = net[HOST]
        for rate in rates:
            out.append(result := Rate(rate, size, repeats))
            progress(f"  link {result.label} ({net.client_address} -> {host.address})")
            try:
                net.shape(HOST, rate)
                samples = te.run(
                    [size], repeats, progress=progress, methods=("engine", "socket"),
                    sender_host=net.client_address, receiver_host=host.address,
                    netns=host.netns,
                )  # fmt: skip
            except (te.TransferBenchError, loopback.PeerError, OSError) as exc:
                result.error = f"{type(exc).__name__}: {exc}"
                progress(f"  link {result.label} failed: {result.error}")
                continue
            bps = {s.method: s.median_bps() for s in samples}
            result.engine_bps, result.socket_bps = bps["engine"], bps["socket"]
            result.verified = all(s.verified for s in samples)
            result.samples = te.to_json(samples)
    return out


to_json = te.to_json


def from_json(data: Sequence[Mapping[str, Any]]) -> list[Rate]:
    return [Rate(**dict(item)) for item in data]


def limit(r: Rate) -> str:
    """What limits the rate, in words (the report's last column)."""
    if r.error:
        return f"failed: {r.error[:120]}"
    if r.rate is None:
        return "CPU (no shaping)"
    if r.link_limited:
        return "the link"
    return f"CPU-bound: the socket reaches only {fmt_pct(r.socket_vs_link)} too"


def markdown_table(rates: Sequence[Rate]) -> list[str]:
    def cells(r: Rate) -> list[str]:
        bps = (r.link_bps, r.engine_bps, r.socket_bps)
        return [
            r.label, *(fmt_gbps(value, 3) for value in bps),
            fmt_pct(r.engine_vs_link), fmt_pct(r.socket_vs_link),
            fmt_pct(r.engine_vs_socket), limit(r),
        ]  # fmt: skip

    head = [
        "link", "link GB/s", "engine GB/s", "socket GB/s", "engine / link",
        "socket / link", "engine / socket", "limited by",
    ]  # fmt: skip
    return table(head, map(cells, rates))


def markdown(rates: Sequence[Rate]) -> list[str]:
    """The report's section (empty without a measurement)."""
    if not rates:
        return []
    r = rates[0]
    return [
        "## Mooncake transfer engine between hosts (network namespaces, veth "
        "through a bridge, `tc tbf` on the receiver's link)",
        "",
        f"{r.size / (1 << 20):g} MiB per transfer, {r.repeats} repeats, medians; "
        "engine: one descriptor; socket: one TCP stream, 1-byte acknowledgement; "
        f"the link is the limit where the socket reaches {LINK_LIMITED:.0%} of it.",
        "",
        *markdown_table(rates),
    ]
