"""Test-only fault switch: corrupt KV right after decode receives it.

Off unless ``PD_MOONCAKE_FAULT=corrupt_received_kv`` is set in the decode
server's environment. It exists so the e2e suite can show that its
correctness check catches wrong KV (a detector needs a negative control).
Corrupting on the decode side leaves prefill's own cache, and so any
reference output computed on prefill, untouched.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

import torch

FAULT_ENV = "PD_MOONCAKE_FAULT"
CORRUPT_RECEIVED_KV = "corrupt_received_kv"
KNOWN_FAULTS = (CORRUPT_RECEIVED_KV,)

logger = logging.getLogger(__name__)


def active_fault() -> str | None:
    fault = os.environ.get(FAULT_ENV) or None
    if fault is not None and fault not in KNOWN_FAULTS:
        raise ValueError(
            f"{FAULT_ENV}={fault!r} is not a known fault ({', '.join(KNOWN_FAULTS)})"
        )
    if fault is not None:
        logger.warning("TEST FAULT ACTIVE: %s=%s; KV will be wrong", FAULT_ENV, fault)
    return fault


def corrupt_blocks(
    kv_caches: Mapping[str, torch.Tensor], kernel_block_ids: Iterable[int]
) -> int:
    """Overwrite the given kernel blocks of every layer; returns blocks hit."""
    ids = torch.tensor(sorted(set(kernel_block_ids)), dtype=torch.long)
    if ids.numel() == 0:
        return 0
    for cache in kv_caches.values():
        # Deterministic but far from any real activation.
        cache.index_fill_(0, ids, 3.0)
    return int(ids.numel())
