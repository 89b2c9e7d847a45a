"""Mooncake's TCP per-peer queue, sized for KV transfers.

Mooncake's TCP transport (0.3.x, ``TcpTransport``) admits at most 1024
descriptors per peer at a time (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``, plus
as many waiting for admission, ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER``) and
fails the whole batch beyond that ("TCP lane queue-full rejection"). The
connector sends one descriptor per region and run of contiguous blocks: a
4096-token prompt over 9 regions with scattered blocks needs 2304, and its
transfer fails at once, while every metric but the failure counter looks
normal. Both limits are raised to Mooncake's maximum (a bound on a queue, no
memory is reserved) unless the operator set them. Both are read when the
transport is constructed, so this runs before the TransferEngine is built.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import MutableMapping

logger = logging.getLogger("vllm.pd_mooncake")

QUEUE_LIMIT_ENV = (
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER",
)
# Mooncake's upper bound for both (tcp_transport.cpp, kMaxQueuedTransfersPerPeer).
MOONCAKE_MAX = 65535


def raise_queue_limits(
    protocol: str, environ: MutableMapping[str, str] = os.environ
) -> dict[str, str]:
    """Set the TCP queue limits not already set; returns what it set."""
    if protocol != "tcp":
        return {}
    applied = {
        name: str(MOONCAKE_MAX) for name in QUEUE_LIMIT_ENV if name not in environ
    }
    environ.update(applied)
    return applied


def queue_limit(environ: MutableMapping[str, str] = os.environ) -> int:
    """The per-peer descriptor limit Mooncake will use (its own parsing aside)."""
    value = environ.get(QUEUE_LIMIT_ENV[0], "1024")
    return int(value) if value.isdigit() else 1024


def warn_if_prompt_can_overflow(
    protocol: str,
    max_model_len: int,
    kernel_block_size: int,
    regions: int,
    environ: MutableMapping[str, str] = os.environ,
) -> int:
    """Warn when one maximal prompt may need more descriptors than the queue
    admits; returns that worst case (blocks x regions, nothing coalesced)."""
    worst = math.ceil(max_model_len / kernel_block_size) * regions
    limit = queue_limit(environ)
    if protocol == "tcp" and worst > limit:
        logger.warning(
            "PD Mooncake: a %d-token prompt may need up to %d descriptors "
            "(%d regions), over Mooncake's TCP per-peer queue of %d: such a "
            "transfer fails if its blocks are scattered. Use mooncake_protocol "
            "rdma, or a smaller max-model-len.",
            max_model_len,
            worst,
            regions,
            limit,
        )
    return worst
