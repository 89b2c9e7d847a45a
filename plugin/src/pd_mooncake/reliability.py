"""Fault handling the upstream Mooncake connector lacks (vLLM 0.32).

Each piece is small, pure where it can be, and hooked into ``connector.py``
in one place:

- ``sibling_transfer_id`` (both schedulers): one transfer id per engine
  request. vllm-router gives one API request one ``transfer_id``, and vLLM
  turns an API request into several engine requests sharing it: the ``n``
  children of ``n > 1``, and one request per prompt of a batch completion.
  Upstream then pairs decode's requests with whichever prefill request
  registered the id last: a batch's second prompt was decoded from the first
  prompt's KV (wrong tokens, every metric saying success), and ``n`` children
  hung or failed once the shared send was done. Both legs derive the same
  per-request id from what vLLM itself adds to the API request's id (child
  index, prompt index), so each decode request pulls its own prefill twin.
- ``api_release`` (prefill worker): decode's rejection notice (a request
  refused before it reached decode's engine) names the API request, not its
  engine requests; it now also releases the siblings' sends.
- ``TransferIdGuard`` (prefill scheduler): one live request per transfer id.
  Upstream keys a prefill's pending send by transfer id alone, so a second
  request with the same id overwrites the first one's entry, and the first
  one's blocks are never reported as sent: they stay allocated for the life
  of the process (and the engine busy-loops on them). With sibling ids this
  takes a client that reaches the prefill directly and reuses an id. The
  guard lets the first request own the id; the others are served, and their
  blocks freed when they finish, with no send registered.
- ``known_not_processed`` (prefill worker): upstream pops every "not
  processed" transfer id without a default; an id that was never registered
  (a request aborted while still queued) raises ``KeyError`` in the sender
  loop and skips the rest of the batch.
- ``prefill_gone`` (decode worker): a pull waits for prefill's answer
  for ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` + 60 s (540 s by default), and
  a dead prefill never answers; the requests whose KV was on its way hang
  that long. Decode now probes the prefill's bootstrap port while a pull is
  pending and fails the pull when it is gone twice in a row: the port is
  refused (the bootstrap server lives in prefill's worker process and dies
  with it) or the host is silent (no SYN-ACK from its kernel, no route, its
  name no longer resolves: power loss, partition, a deleted pod).
- Prefill's sends against decode's wait for them: ``send_deadline``.
- ``side_channel_port`` and ``SideChannelContext`` (prefill worker): a
  stable ZMQ side-channel address. Upstream binds a random port and decode
  caches the address per engine id forever. With a configured, stable
  ``engine_id`` (which vllm-router reads only at its start), a restarted
  prefill must also come back at the same address, or decode keeps sending
  to the dead one; with both, neither router nor decode needs a restart.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import re
import socket
import urllib.request
from collections.abc import Collection, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

logger = logging.getLogger("vllm.pd_mooncake")


# Engine request ids (vllm/v1/engine): "[<child>_]<api id>[-<prompt>]-<8 hex>";
# chat serving joins the prompt index with "_" (chat_completion/serving.py:
# f"{request_id}_{i}"), completions with "-".
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
_CHILD_INDEX = re.compile(r"^(\d+)_")
_PROMPT_INDEX = re.compile(r"[-_](\d+)$")
# Joins an API request's transfer id and a sibling's indexes.
SIBLING_SEP = "~"


def _engine_request_part(request_id: str, randomized: bool) -> str | None:
    """The id without vLLM's random suffix; None for an id without one (an
    API-level id, such as decode's rejection notice)."""
    if not randomized:
        return request_id
    suffix = _RANDOM_SUFFIX.search(request_id)
    return request_id[: suffix.start()] if suffix else None


def sibling_transfer_id(
    transfer_id: str, request_id: str, *, randomized: bool = True
) -> str:
    """This engine request's own transfer id, equal on prefill and decode.

    ``randomized``: vLLM appends 8 random hex digits to every engine request
    id (unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION). The first child of the
    first prompt keeps the API request's id, so single requests and decode's
    rejection notice are unchanged.
    """
    rest = _engine_request_part(request_id, randomized)
    if rest is None:
        return transfer_id
    child = _CHILD_INDEX.match(rest)
    prompt = _PROMPT_INDEX.search(rest[child.end() if child else 0 :])
    k = int(child.group(1)) if child else 0
    j = int(prompt.group(1)) if prompt else 0
    if k == 0 and j == 0:
        return transfer_id
    return f"{transfer_id}{SIBLING_SEP}{k}.{j}"


def api_release(
    req_blocks: Mapping[str, tuple[str, Any]],
    pending: Mapping[str, Any],
    *,
    randomized: bool = True,
) -> list[str]:
    """Prefill worker: the siblings' pending sends that a release pull for the
    whole API request frees (decode's rejection notice: an API-level request
    id, no blocks). Sends in progress are left to finish."""
    released = []
    for d_req_id, (transfer_id, block_ids) in req_blocks.items():
        if any(block_ids) or (
            randomized and _engine_request_part(d_req_id, randomized) is not None
        ):
            continue
        prefix = f"{transfer_id}{SIBLING_SEP}"
        released += [
            key
            for key, send in pending.items()
            if key.startswith(prefix) and send.p_req_id and not send.sending
        ]
    if released:
        logger.info("PD Mooncake: rejected by decode, releasing %s", released)
    return released


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


# connect() errors that mean nobody is there: no route to the host or its
# network (a host that is down answers ARP with nothing; a router says so).
_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN}


def _probe(host: str, port: int, timeout_s: float) -> str | None:
    """Blocking TCP connect: why the peer is gone, or None if it may be alive.

    A listening port completes the handshake in the peer's kernel, whatever
    its process is doing, so a prefill whose event loop is busy (or that
    never calls accept) still counts as alive. Runs in a thread: the timeout
    is then the kernel's, not a deadline on decode's receiver loop, which can
    itself be busy (a loop-side timeout would call a slow decode's prefill
    gone).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        # A deleted pod's name stops resolving (headless service).
        return f"its name does not resolve ({exc})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(address)
        except ConnectionRefusedError:
            return "refuses connections"
        except TimeoutError:
            # No SYN-ACK: the host's kernel is not answering (power loss,
            # partition). Loopback and LAN handshakes take microseconds.
            return f"is silent (no TCP handshake within {timeout_s:g}s)"
        except OSError as exc:
            if exc.errno in _UNREACHABLE:
                return f"is unreachable ({exc.strerror})"
            return None
    return None


async def prefill_gone(url: str, timeout_s: float = 1.0) -> str | None:
    """Why ``url``'s host:port is gone (refused, silent, unreachable, name
    unresolved), or None when a connection was accepted or the error proves
    nothing."""
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        return None
    return await asyncio.to_thread(_probe, parts.hostname, parts.port, timeout_s)


def _registered_addrs(url: str, engine_id: str, timeout_s: float) -> set[str] | None:
    """The side-channel addresses ``url``'s bootstrap server lists for
    ``engine_id`` (upstream's /query answer), or None if it lists none or did
    not answer: that proves nothing (a prefill still registering)."""
    try:
        with urllib.request.urlopen(f"{url}/query", timeout=timeout_s) as answer:
            data = json.load(answer)
        entries = [e for e in data.values() if e.get("engine_id") == engine_id]
        addrs = {
            addr
            for entry in entries
            for per_pp in entry["worker_addr"].values()
            for addr in per_pp.values()
        }
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None
    return addrs or None


async def engine_moved(
    url: str, engine_id: str, worker_addr: str, timeout_s: float = 1.0
) -> str | None:
    """Why a pull to ``worker_addr`` can never be answered although the
    bootstrap server at ``url`` answers: it lists ``engine_id`` at other
    addresses now. A re-created prefill (a rescheduled pod: the same name and
    engine id, a new IP) registers anew, but upstream's decode keeps the
    first address it learnt per engine id for the life of the process."""
    addrs = await asyncio.to_thread(_registered_addrs, url, engine_id, timeout_s)
    if addrs is None or worker_addr in addrs:
        return None
    return (
        f"lists engine {engine_id} at {', '.join(sorted(addrs))} now, not at "
        f"{worker_addr} (a re-created prefill)"
    )


async def probe_pull(
    url: str, engine_id: str, worker_addr: str, timeout_s: float
) -> tuple[str | None, bool]:
    """Why a pull to ``worker_addr`` may never be answered (None: no proof),
    and whether its engine moved (proof at once, unlike a silent host)."""
    if reason := await prefill_gone(url, timeout_s):
        return reason, False
    moved = await engine_moved(url, engine_id, worker_addr, timeout_s)
    return moved, moved is not None


async def refuses_connections(url: str, timeout_s: float = 1.0) -> bool:
    """True if ``url``'s port is refused (the old probe's question)."""
    return (await prefill_gone(url, timeout_s)) == "refuses connections"


# Consecutive "gone" probes before a pull is failed.
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
