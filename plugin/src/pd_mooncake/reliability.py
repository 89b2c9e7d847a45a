"""Fault handling the upstream Mooncake connector lacks (vLLM 0.32).

Each piece is small, pure where it can be, and hooked into ``connector.py``
in one place:

- ``TransferIdGuard`` (prefill scheduler): one live request per transfer id.
  Upstream keys a prefill's pending send by transfer id alone, so a second
  request with the same id overwrites the first one's entry, and the first
  one's blocks are never reported as sent: they stay allocated for the life
  of the process (and the engine busy-loops on them). It happens with any
  ``n > 1`` request through vllm-router (the ``n`` children share the
  request's ``kv_transfer_params``), and with any client that can reach the
  prefill directly and reuse an id. The guard lets the first request own the
  id; the others are served, and their blocks freed when they finish, with
  no send registered. Decode's ``n`` children pull the owner's copy of the
  (identical) prompt KV.
- ``known_not_processed`` (prefill worker): upstream pops every "not
  processed" transfer id without a default; an id that was never registered
  (a request aborted while still queued) raises ``KeyError`` in the sender
  loop and skips the rest of the batch.
- ``refuses_connections`` (decode worker): a pull waits for prefill's answer
  for ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` + 60 s (540 s by default), and
  a dead prefill never answers; the requests whose KV was on its way hang
  that long. Decode now probes the prefill's bootstrap port while a pull is
  pending and fails the pull when it is refused twice in a row (the
  bootstrap server lives in prefill's worker process and dies with it).
- ``side_channel_port`` and ``SideChannelContext`` (prefill worker): a
  stable ZMQ side-channel address. Upstream binds a random port and decode
  caches the address per engine id forever. With a configured, stable
  ``engine_id`` (which vllm-router reads only at its start), a restarted
  prefill must also come back at the same address, or decode keeps sending
  to the dead one; with both, neither router nor decode needs a restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

logger = logging.getLogger("vllm.pd_mooncake")


class TransferIdGuard:
    """Prefill side: at most one live request owns a transfer id.

    ``admit`` when blocks are allocated (upstream's
    ``update_state_after_alloc``), ``refuses`` when the request finishes,
    ``finished``/``sent`` when its blocks are freed.
    """

    def __init__(self) -> None:
        self._owner: dict[str, str] = {}  # transfer id -> request id
        self._owned: dict[str, str] = {}  # request id -> transfer id
        self._refused: set[str] = set()
        self.refused_total = 0

    @staticmethod
    def _transfer_id(params: Mapping[str, Any] | None) -> str | None:
        if not params or not params.get("do_remote_decode"):
            return None
        return params.get("transfer_id") or None

    def admit(self, request_id: str, params: Mapping[str, Any] | None) -> bool:
        """False if another live request owns this request's transfer id."""
        transfer_id = self._transfer_id(params)
        if transfer_id is None:
            return True
        owner = self._owner.setdefault(transfer_id, request_id)
        if owner == request_id:
            self._owned[request_id] = transfer_id
            return True
        if request_id not in self._refused:
            self._refused.add(request_id)
            self.refused_total += 1
            logger.warning(
                "PD Mooncake: transfer id %s is already used by request %s; "
                "request %s is served without a KV send (n > 1, or a reused id)",
                transfer_id,
                owner,
                request_id,
            )
        return False

    def refuses(self, request_id: str, params: Mapping[str, Any] | None) -> bool:
        """True if upstream must not see this request finish: it was refused,
        or it never got blocks and its id belongs to another live request
        (upstream would cancel the owner's send)."""
        if request_id in self._refused:
            return True
        transfer_id = self._transfer_id(params)
        owner = self._owner.get(transfer_id) if transfer_id else None
        return owner is not None and owner != request_id

    def finished(self, request_id: str, delayed: bool) -> None:
        """The request finished; unless its blocks wait for a send, release."""
        self._refused.discard(request_id)
        if not delayed:
            self._release(request_id)

    def sent(self, request_ids: Iterable[str]) -> None:
        """The worker reported these requests' sends done (or expired)."""
        for request_id in request_ids:
            self._release(request_id)

    def live(self) -> int:
        return len(self._owner)

    def _release(self, request_id: str) -> None:
        transfer_id = self._owned.pop(request_id, None)
        if transfer_id is not None and self._owner.get(transfer_id) == request_id:
            del self._owner[transfer_id]


def known_not_processed(
    not_processed: Collection[str], pending: Mapping[str, Any]
) -> set[str]:
    """The "not processed" transfer ids the worker actually has pending."""
    unknown = [t for t in not_processed if t not in pending]
    if unknown:
        logger.debug("PD Mooncake: never-registered transfer ids ignored: %s", unknown)
    return {t for t in not_processed if t in pending}


async def refuses_connections(url: str, timeout_s: float = 1.0) -> bool:
    """True only if ``url``'s host actively refuses a TCP connection to its
    port: the process is gone. A timeout or any other error is not proof."""
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        return False
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname, parts.port), timeout_s
        )
    except ConnectionRefusedError:
        return True
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return False


# Consecutive refusals before a pull is failed.
REFUSALS_TO_FAIL = 2


def side_channel_port(
    bootstrap_port: int,
    offset: int,
    *,
    dp_rank: int,
    pp_rank: int,
    tp_rank: int,
    pp_size: int,
    tp_size: int,
) -> int:
    """Fixed side-channel port of one prefill worker: the bootstrap port plus
    ``offset`` plus the worker's rank within the instance (dp, pp, tp)."""
    rank = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank
    port = bootstrap_port + offset + rank
    if not 0 < port < 65536:
        raise ValueError(
            f"side channel port {port} (bootstrap {bootstrap_port} + offset "
            f"{offset} + rank {rank}) is not a valid port"
        )
    return port


class SideChannelSocket(zmq.asyncio.Socket):
    """Binds the context's fixed port where upstream asks for a random one."""

    def bind_to_random_port(self, addr: str, *args: Any, **kwargs: Any) -> int:
        port = getattr(self.context, "side_channel_port", 0)
        if not port:
            return super().bind_to_random_port(addr, *args, **kwargs)
        self.bind(f"{addr}:{port}")
        return port


class SideChannelContext(zmq.asyncio.Context):
    """The prefill worker's ZMQ context, making its side channel stable."""

    _socket_class = SideChannelSocket
    side_channel_port = 0
