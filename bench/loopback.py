"""Mooncake TransferEngines over TCP, the receiving one in a process of its
own: the one two-process harness of the transfer benchmark
(bench/transfer_engine.py, bench/hosts_link.py) and of the plugin's transfer
tests (plugin/tests), so all start, wait and clean up the same way.

An environment both processes need (Mooncake reads its ``MC_*`` settings when
an engine is created) is set around the whole exchange, e.g. with
``unittest.mock.patch.dict(os.environ, ...)``: a spawned process inherits it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import numpy as np

from pdstack.supervisor import HOST

DEADLINE_S = 60.0
# setns(2)'s nstype for a network namespace; `ip netns add` pins them here.
CLONE_NEWNET = 0x40000000
NETNS_RUN = "/var/run/netns"


class PeerError(RuntimeError):
    pass


def tcp_engine(host: str = HOST) -> Any:
    """A TransferEngine on TCP advertising ``host`` (loopback by default),
    peers found by P2P handshake."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise PeerError(f"Mooncake TransferEngine did not initialize on TCP at {host}")
    return engine


def enter_netns(name: str) -> None:
    """Move this process into network namespace ``name`` (``ip netns``'s).

    setns(2) moves the calling thread only, and threads started later follow
    it: call it before anything starts a thread (an engine, a server).
    Python 3.11 has no os.setns, hence ctypes.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_RUN, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Endpoint:
    """An engine with ``nbytes`` of zeroed memory registered (``data``),
    advertising ``host``: the usual receiver, and the usual sender."""

    def __init__(self, nbytes: int, host: str = HOST) -> None:
        self.host = host
        self.engine = tcp_engine(host)
        self.data = np.zeros(nbytes, dtype=np.uint8)
        self.base = self.data.ctypes.data
        if self.engine.register_memory(self.base, nbytes) != 0:
            raise PeerError("register_memory failed")

    def address(self) -> tuple[str, int]:
        """The session a sender writes to, and the buffer's address there."""
        return f"{self.host}:{self.engine.get_rpc_port()}", self.base

    def write(
        self, session: str, src: list[int], dst: list[int], lens: list[int]
    ) -> int:
        """Mooncake's status: 0 once the receiver has every byte."""
        return self.engine.batch_transfer_sync_write(session, src, dst, lens)

    def read(self) -> bytes:
        return self.data.tobytes()

    def clear(self, size: int) -> None:
        self.data[:size] = 0

    def digest(self, size: int) -> str:
        return digest(self.data, size)


def digest(buffer: np.ndarray, size: int) -> str:
    return hashlib.blake2b(memoryview(buffer[:size]), digest_size=16).hexdigest()


def _serve(
    conn: Any,
    cls: type,
    args: tuple[Any, ...],
    netns: str | None = None,
    log: str | None = None,
) -> None:
    """The peer process: answers (ok, value) to each (method, args) until None."""
    try:
        if log is not None:
            # Mooncake's C++ logging writes to fd 2 itself, past sys.stderr.
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        if netns is not None:
            enter_netns(netns)
        obj = cls(*args)
        conn.send((True, None))
        for name, call_args in iter(conn.recv, None):
            conn.send((True, getattr(obj, name)(*call_args)))
    except Exception as exc:
        conn.send((False, f"{type(exc).__name__}: {exc}"))


class Peer(contextlib.AbstractContextManager["Peer"]):
    """``cls(*args)`` in a spawned process (``cls`` importable by name), in
    network namespace ``netns`` if given (by its name under /var/run/netns),
    its output appended to ``log`` if given; ``call("read")`` runs its method
    there, each answer within the deadline, a peer that died or raised
    reported as such."""

    def __init__(
        self,
        cls: type,
        *args: Any,
        deadline_s: float = DEADLINE_S,
        netns: str | None = None,
        log: Path | None = None,
    ) -> None:
        self.name, self.deadline_s = cls.__name__, deadline_s
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        where = None if log is None else str(log)
        self.proc = ctx.Process(
            target=_serve, args=(child, cls, args, netns, where), daemon=True
        )
        self.proc.start()
        child.close()  # our copy: a peer that dies is then seen at once (EOF)
        try:
            self._answer("start")
        except BaseException:
            self.close()
            raise

    def _answer(self, what: str) -> Any:
        if not self._conn.poll(self.deadline_s):
            raise PeerError(
                f"{self.name} did not {what} within {self.deadline_s:.0f} s"
            )
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            raise PeerError(
                f"{self.name} exited ({self.proc.exitcode}) before {what}"
            ) from None
        if not ok:
            raise PeerError(f"{self.name}.{what}: {value}")
        return value

    def call(self, method: str, *args: Any) -> Any:
        with contextlib.suppress(OSError):  # a peer gone: _answer says so
            self._conn.send((method, args))
        return self._answer(method)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a peer already gone
            self._conn.send(None)
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self._conn.close()

    def __exit__(self, *exc: object) -> None:
        self.close()
