"""pdstack.netns on real namespaces: hosts reach each other and nothing else,
links cut and heal, addresses move, shaping installs, stale runs are cleaned."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pdstack import netns, wait

TAG = "ut"  # never "mh": another engineer's multi-host twin uses it
REASON = netns.missing_privileges()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"needs root: {REASON}")
T_S = 10.0
# "ok", "timeout" (socket.timeout, EAGAIN, ETIMEDOUT) or the errno.
CONNECT = """
import socket, sys
try: socket.create_connection((sys.argv[1], int(sys.argv[2])), float(sys.argv[3]))
except OSError as e: print("timeout" if e.errno in (None, 11, 110) else e.errno)
else: print("ok")
"""
# Prints its port, accepts until idle for 20 s (so it ends even if leaked).
SERVE = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(); s.settimeout(20)
print(s.getsockname()[1], flush=True)
while True: s.accept()[0].close()
"""


def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=T_S, **kw)


def python_in(host: netns.Host, code: str, *args: object) -> str:
    argv = [*host.exec_prefix(), sys.executable, "-c", code, *map(str, args)]
    return run(argv).stdout.strip()


def connect_from(host: netns.Host, address: str, port: int, t_s: float = 3) -> str:
    return python_in(host, CONNECT, address, port, t_s)


@contextlib.contextmanager
def started(host: netns.Host, code: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    argv = [*host.exec_prefix(), sys.executable, "-c", code, *args]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    proc = subprocess.Popen(argv, **pipes)
    try:
        assert select.select([proc.stdout], [], [], T_S)[0], "silent: never printed"
        yield proc
    finally:
        proc.kill()
        proc.wait(T_S)


@contextlib.contextmanager
def listener(host: netns.Host, address: str) -> Iterator[int]:
    with started(host, SERVE, address) as proc:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())


def leftovers(net: netns.Network) -> list[str]:
    found = [ns for ns in netns.namespaces() if ns.startswith(net.base)]
    found += [p.name for p in netns.NETNS_ETC.glob(f"{net.base}*")]
    if run(["ip", "link", "show", net.client_link]).returncode == 0:
        found.append(net.client_link)
    return sorted(found)


@contextlib.contextmanager
def removed(network: netns.Network) -> Iterator[netns.Network]:
    """``network``, removed at the end: nothing of its tag may be left."""
    try:
        yield network
    finally:
        network.remove()
    assert leftovers(network) == []


@pytest.fixture
def net() -> Iterator[netns.Network]:
    with removed(netns.Network(TAG, ["a", "b"])) as network:
        network.create()
        yield network


def test_remove_leaves_nothing_of_the_tag(net: netns.Network) -> None:
    # Namespaces and hosts directories of a and b; the bridge; the client link.
    hosts = ["pdh-ut-a", "pdh-ut-b"] * 2
    assert leftovers(net) == sorted([*hosts, "pdh-ut-bridge", "pdh-ut-c"])
    net.remove()
    assert leftovers(net) == []


def test_hosts_reach_each_other_by_address_and_name_and_nothing_else(
    net: netns.Network,
) -> None:
    a, b = net["a"], net["b"]
    with listener(b, b.address) as port:
        assert connect_from(a, b.address, port) == "ok"
        assert connect_from(a, "b", port) == "ok"
        # The root namespace, through the client link.
        assert f"dev {net.client_link}" in run(["ip", "route", "get", b.address]).stdout
        socket.create_connection((b.address, port), timeout=3).close()
    getent = run([*a.exec_prefix(), "getent", "hosts", "b"]).stdout
    assert getent.split() == [b.address, "b"]
    # No default route: an address off the subnet is unreachable at once.
    assert connect_from(a, "192.0.2.1", 80) == str(errno.ENETUNREACH)


def test_a_link_down_is_silence_and_up_heals(net: netns.Network) -> None:
    a, b = net["a"], net["b"]
    with listener(b, b.address) as port:
        assert connect_from(a, b.address, port) == "ok"
        net.link("b", False)
        assert connect_from(a, b.address, port, 1) == "timeout"  # not refused
        net.link("b", True)
        assert connect_from(a, b.address, port) == "ok"


def test_readdress_moves_the_name_to_a_new_address(net: netns.Network) -> None:
    a, b = net["a"], net["b"]
    old = b.address
    hosts = netns.NETNS_ETC / a.netns / "hosts"
    inode = hosts.stat().st_ino
    # A process of host a that runs across the move, resolving after it.
    code = "import socket; print(1, flush=True); print(socket.gethostbyname(input()))"
    with started(a, code) as reader:  # in host a now
        new = net.readdress("b")
        out = reader.communicate("b\n", timeout=T_S)[0]
    assert new != old and b.address == new
    assert out.split() == ["1", new]
    assert hosts.stat().st_ino == inode
    bind = "import socket, sys\ntry: socket.socket().bind((sys.argv[1], 0))\n"
    bind += "except OSError as e: print(e.errno)"
    assert python_in(b, bind, old) == str(errno.EADDRNOTAVAIL)
    with listener(b, new) as port:
        assert connect_from(a, "b", port) == "ok"


def test_shape_installs_and_removes_a_token_bucket(net: netns.Network) -> None:
    ends = [(net.bridge_ns, net["b"].port), (net["b"].netns, "eth0")]

    def qdiscs() -> list[str]:
        show = ["tc", "qdisc", "show", "dev"]
        return [run(["ip", "netns", "exec", ns, *show, dev]).stdout for ns, dev in ends]

    net.shape("b", "100mbit")
    assert all("qdisc tbf" in q and "rate 100Mbit" in q for q in qdiscs())
    net.shape("b", None)
    assert not any("tbf" in q for q in qdiscs())


def test_create_kills_and_replaces_a_stale_run() -> None:
    stale = netns.Network(TAG, ["a", "b"])
    with removed(netns.Network(TAG, ["a", "b"])) as fresh:
        stale.create()
        ns = stale["a"].netns
        sleeper = subprocess.Popen(
            [*stale["a"].exec_prefix(), "sleep", "300"], start_new_session=True
        )
        wait.poll(lambda: netns.pids_in(ns), lambda p: sleeper.pid in p, T_S, "sleep")
        marker = ["ip", "netns", "exec", ns, "ip", "addr"]
        run([*marker, "add", "10.99.0.1/32", "dev", "lo"], check=True)
        fresh.create()  # a new object: knows nothing of the stale one
        sleeper.wait(T_S)  # gone: killed (reaped by psutil or here)
        assert not psutil.pid_exists(sleeper.pid)
        assert netns.pids_in(ns) == []
        assert "10.99.0.1" not in run([*marker, "show", "dev", "lo"]).stdout
        refused = str(errno.ECONNREFUSED)
        assert connect_from(fresh["a"], fresh["b"].address, 9) == refused


def test_a_tag_whose_subnet_is_routed_already_is_refused(net: netns.Network) -> None:
    other = netns.Network("utb", ["a"])
    assert other.subnet != net.subnet  # each tag a /24 of its own
    other.subnet = net.subnet  # as if its hash hit "ut"'s
    with removed(other), pytest.raises(netns.NetnsError, match="routed already"):
        other.create()
    route = run(["ip", "route", "get", net["a"].address]).stdout
    assert f"dev {net.client_link}" in route  # "ut" untouched


REPO = Path(netns.__file__).resolve().parents[1]
SITE = Path(psutil.__file__).resolve().parents[1]
ENV = {"PYTHONPATH": f"{REPO}:{SITE}", "PATH": os.environ.get("PATH", "")}
NOBODY = dict(user=65534, group=65534, extra_groups=[], cwd="/", env=ENV)


def nobody_python() -> str | None:
    """An interpreter uid 65534 can run (the venv's base may be under /root,
    closed to it), with this repo and the venv's packages on its path."""
    for exe in (sys.executable, "/usr/bin/python3"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if run([exe, "-c", "import pdstack.netns"], **NOBODY).returncode == 0:
                return exe
    return None


def test_create_without_root_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    code = "import pdstack.netns as n\ntry: n.Network('ut', ['a']).create()\n"
    code += "except n.NetnsError as e: print(e)"
    if python := nobody_python():
        message = run([python, "-c", code], **NOBODY).stdout
    else:
        # No interpreter uid 65534 can run: fake its euid in this process.
        monkeypatch.setattr(os, "geteuid", lambda: 65534)
        with pytest.raises(netns.NetnsError) as caught:
            netns.Network(TAG, ["a"]).create()
        message = str(caught.value)
    assert "root" in message and "CAP_NET_ADMIN" in message
    assert "uid 65534" in message
    monkeypatch.undo()
    assert leftovers(netns.Network(TAG, ["a"])) == []
