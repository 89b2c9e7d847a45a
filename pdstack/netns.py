"""Hosts on one machine: each a Linux network namespace on a private bridge.

The multi-host twin runs every server in a host of its own, as on separate
machines or Kubernetes pods: its own IP stack, its own address (which vLLM and
Mooncake advertise through ``VLLM_HOST_IP``), names from its own
``/etc/netns/<ns>/hosts`` (``ip netns exec`` mounts it over ``/etc/hosts``,
as a cluster DNS would answer). The hosts hang on a bridge in a namespace of
its own; this process reaches them through one more veth pair, the
"client" side. Addresses come from 198.18.0.0/16 (RFC 2544, network
benchmarks), a /24 of it for each tag; no host has a default route and
nothing is NATed, so no packet can leave the machine.

Everything is named ``pdh-<tag>-...``: ``remove`` (and ``create``, first)
deletes every namespace, hosts directory and client link of the tag, with
the processes still in them, so a run killed with SIGKILL is cleaned up by
the next. Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import subprocess
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

PREFIX = "pdh-"
# Each tag gets a /24 of its own: two tags' client links on one subnet would
# give the root namespace two routes to it, and one run would talk to the
# other's hosts (``create`` refuses a subnet some other link already routes).
# The lower half of RFC 2544's 198.18.0.0/15: the upper half, 198.19.0.0/16,
# is Docker's (scripts/docker-engine.sh, docker/compose.cpu.yaml).
SPACE = ipaddress.ip_network("198.18.0.0/16")
NETNS_ETC = Path("/etc/netns")
# Linux interface names: at most 15 characters.
IFNAME_MAX = 15
IP_TIMEOUT_S = 10.0


class NetnsError(RuntimeError):
    pass


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
        )
    except FileNotFoundError as exc:
        raise NetnsError(f"{argv[0]} not found: install iproute2") from exc
    if check and done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def missing_privileges() -> str | None:
    """Why this process cannot build hosts, or None if it can."""
    if shutil.which("ip") is None:
        return "the `ip` command (Debian package iproute2) is not installed"
    if os.geteuid() != 0:
        return (
            "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN); "
            f"this process runs as uid {os.geteuid()}"
        )
    return None


def namespaces() -> list[str]:
    out = _run("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pids_in(netns: str) -> list[int]:
    done = _run("ip", "netns", "pids", netns, check=False)
    return [int(p) for p in done.stdout.split()]


@dataclass
class Host:
    """One host: a namespace with ``eth0`` at ``address`` on the bridge."""

    name: str
    netns: str
    address: str
    # The bridge-side end of its veth pair (in the bridge's namespace).
    port: str

    def exec_prefix(self) -> list[str]:
        """Prefix an argv with this to run it on the host (same pid: ``ip
        netns exec`` enters the namespace and execs)."""
        return ["ip", "netns", "exec", self.netns]


@dataclass
class Network:
    """Hosts ``names`` on one bridge; ``tag`` keeps runs apart (short: it is
    part of interface names)."""

    tag: str
    names: Sequence[str]
    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.tag.isalnum() or len(self.tag) > 4:
            raise ValueError(f"tag {self.tag!r}: 1-4 letters or digits")
        if len(self.names) > 200:
            raise ValueError("at most 200 hosts on one /24")
        self.base = f"{PREFIX}{self.tag}-"
        # The tag's /24 of SPACE, chosen by a hash of the tag.
        index = zlib.crc32(self.tag.encode()) % 2 ** (24 - SPACE.prefixlen)
        start = int(SPACE.network_address) + index * 256
        self.subnet = ipaddress.IPv4Network((start, 24))
        self.client_address = str(self.subnet[1])
        self.bridge_ns = f"{self.base}bridge"
        self.client_link = f"{self.base}c"
        for index, name in enumerate(self.names):
            self.hosts[name] = Host(
                name,
                f"{self.base}{name}",
                str(self.subnet[10 + index]),
                f"{self.base}p{index}",
            )
        assert len(self.client_link) <= IFNAME_MAX
        assert all(len(h.port) <= IFNAME_MAX for h in self.hosts.values())

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # --- life cycle ----------------------------------------------------------

    def create(self) -> None:
        """Build the bridge, the hosts and the client link (after removing
        whatever a previous run of this tag left)."""
        if reason := missing_privileges():
            raise NetnsError(f"cannot build hosts: {reason}")
        self.remove()
        if taken := _run("ip", "route", "show", "exact", str(self.subnet)).stdout:
            raise NetnsError(
                f"tag {self.tag!r}: its subnet {self.subnet} is routed already "
                f"({taken.strip()}): another tag hashes to it, use another tag"
            )
        try:
            self._build()
        except BaseException:
            self.remove()
            raise

    def _build(self) -> None:
        br = self.bridge_ns
        _run("ip", "netns", "add", br)
        self._in(br, "ip", "link", "add", "br0", "type", "bridge")
        self._in(br, "ip", "link", "set", "br0", "up")
        for host in self.hosts.values():
            _run("ip", "netns", "add", host.netns)
            self._in(host.netns, "ip", "link", "set", "lo", "up")
            self._in(
                br, "ip", "link", "add", host.port, "type", "veth",
                "peer", "name", "eth0", "netns", host.netns,
            )  # fmt: skip
            self._in(br, "ip", "link", "set", host.port, "master", "br0", "up")
            self._address(host, host.address)
        # This process's way in: a link with only the subnet's connected route.
        _run(
            "ip", "link", "add", self.client_link, "type", "veth",
            "peer", "name", "client", "netns", br,
        )  # fmt: skip
        self._in(br, "ip", "link", "set", "client", "master", "br0", "up")
        _run("ip", "addr", "add", f"{self.client_address}/24", "dev", self.client_link)
        _run("ip", "link", "set", self.client_link, "up")
        self.write_hosts()

    def _address(self, host: Host, address: str) -> None:
        self._in(host.netns, "ip", "addr", "flush", "dev", "eth0")
        self._in(host.netns, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
        self._in(host.netns, "ip", "link", "set", "eth0", "up")
        host.address = address

    def remove(self) -> None:
        """Delete every namespace, hosts file and link of this tag, killing
        the processes still inside (a run killed before it cleaned up)."""
        if missing_privileges():
            return
        ours = [ns for ns in namespaces() if ns.startswith(self.base)]
        victims = []
        for pid in {pid for ns in ours for pid in pids_in(ns)}:
            with contextlib.suppress(psutil.Error):
                victims.append(psutil.Process(pid))
                victims[-1].kill()
        psutil.wait_procs(victims, 10.0)
        for ns in ours:
            _run("ip", "netns", "delete", ns, check=False)
        _run("ip", "link", "delete", self.client_link, check=False)
        if NETNS_ETC.is_dir():
            for path in NETNS_ETC.glob(f"{self.base}*"):
                shutil.rmtree(path, ignore_errors=True)

    @contextlib.contextmanager
    def up(self) -> Iterator[Network]:
        self.create()
        try:
            yield self
        finally:
            self.remove()

    # --- what Kubernetes and the network do to hosts --------------------------

    def write_hosts(self) -> None:
        """Every host's ``/etc/hosts``: localhost, and each host's name to its
        current address. Rewritten in place: a running process's bind mount
        keeps the inode."""
        entries = ["127.0.0.1 localhost"]
        entries += [f"{h.address} {h.name}" for h in self.hosts.values()]
        text = "\n".join(entries) + "\n"
        for host in self.hosts.values():
            directory = NETNS_ETC / host.netns
            directory.mkdir(parents=True, exist_ok=True)
            with (directory / "hosts").open("w") as out:
                out.write(text)

    def link(self, name: str, up: bool) -> None:
        """Take a host's link down (a partition, or a host gone silent: its
        peers see no refusal, only silence) or up again."""
        state = "up" if up else "down"
        self._in(self.bridge_ns, "ip", "link", "set", self[name].port, state)

    def readdress(self, name: str) -> str:
        """Give a host a new address, as a re-created pod gets a new pod IP;
        returns it. Start its processes again after: the old ones are bound
        to the old address."""
        host = self[name]
        taken = {h.address for h in self.hosts.values()} | {self.client_address}
        free = (str(a) for a in self.subnet.hosts() if int(a) % 256 > 100)
        fresh = next(a for a in free if a not in taken)
        self._address(host, fresh)
        self.write_hosts()
        return fresh

    def shape(self, name: str, rate: str | None) -> None:
        """Token-bucket shape both directions of a host's link to ``rate``
        (tc syntax, e.g. "1gbit"), or remove the shaping with None."""
        ends = ((self.bridge_ns, self[name].port), (self[name].netns, "eth0"))
        for netns, dev in ends:
            self._in(netns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if rate is not None:
                # A burst of 1 ms at the rate (at least 64 KiB); queue 50 ms.
                burst = max(64 * 1024, rate_bits(rate) // 8 // 1000)
                self._in(
                    netns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", rate, "burst", str(burst), "latency", "50ms",
                )  # fmt: skip

    def _in(self, netns: str, *argv: str, check: bool = True) -> None:
        _run("ip", "netns", "exec", netns, *argv, check=check)


def rate_bits(rate: str) -> int:
    """Bits per second of a tc rate such as "1gbit" or "500mbit"."""
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * factor)
    raise ValueError(f"rate {rate!r}: expected e.g. 500mbit or 1gbit")
