"""Test-only fault switch: corrupt KV right after decode receives it, or
skip prefill's KV geometry check.

Off unless the decode server's environment sets it, either for the whole
run (``PD_MOONCAKE_FAULT=corrupt_received_kv``) or while a file exists
(``PD_MOONCAKE_FAULT_FILE=/path``; the file holds the fault's name), so a
test can switch it on and off without restarting the server. It exists so
the e2e suite can show that its correctness check catches wrong KV.
Corrupting on the decode side leaves prefill's own cache, and so any
reference output computed on prefill, untouched.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FAULT_ENV = "PD_MOONCAKE_FAULT"
FAULT_FILE_ENV = "PD_MOONCAKE_FAULT_FILE"
CORRUPT_RECEIVED_KV = "corrupt_received_kv"
# The same, after decode's KV checksum (pd_mooncake.checksum) verified the
# blocks: what the checksum cannot see, and the correctness check must.
CORRUPT_CHECKED_KV = "corrupt_checked_kv"
# Only the draft's layers (Eagle3's GQA layer, an MTP layer: vLLM numbers
# them from the target's num_hidden_layers on), after the checksum: what a
# transfer that left the draft's region out would leave decode computing
# with. Greedy answers stay right (the target verifies every draft token);
# only acceptance can show it (e2e/test_spec_decode.py).
LOSE_DRAFT_KV = "lose_draft_kv"
# Prefill: serve pulls whose KV geometry it would refuse (pd_mooncake.geometry):
# the negative control of the geometry handshake.
SKIP_GEOMETRY_CHECK = "skip_geometry_check"
KNOWN_FAULTS = (
    CORRUPT_RECEIVED_KV,
    CORRUPT_CHECKED_KV,
    LOSE_DRAFT_KV,
    SKIP_GEOMETRY_CHECK,
)

logger = logging.getLogger(f"vllm.{__name__}")


def active_fault() -> str | None:
    """The fault switched on now, if any (checked on every received transfer)."""
    fault = os.environ.get(FAULT_ENV) or None
    path = os.environ.get(FAULT_FILE_ENV)
    if fault is None and path:
        try:
            fault = Path(path).read_text().strip() or None
        except FileNotFoundError:
            return None
    if fault is not None and fault not in KNOWN_FAULTS:
        raise ValueError(
            f"{FAULT_ENV}={fault!r} is not a known fault ({', '.join(KNOWN_FAULTS)})"
        )
    return fault


def configured_switch() -> str:
    """How this server can be faulted: "file" (switched by the file at
    PD_MOONCAKE_FAULT_FILE), "env" (PD_MOONCAKE_FAULT), or "none"."""
    if os.environ.get(FAULT_ENV):
        return "env"
    return "file" if os.environ.get(FAULT_FILE_ENV) else "none"


def corrupt_blocks(
    kv_caches: Mapping[str, torch.Tensor],
    kernel_block_ids: Iterable[int],
    num_blocks: int | None = None,
) -> int:
    """Overwrite the given kernel blocks of every layer; returns blocks hit.

    The block dimension is the one of ``num_blocks`` kernel blocks: dim 0 for
    MLA and CPU caches, dim 1 where a GPU backend puts K and V first
    (FlashAttention's ``(2, num_blocks, block_size, heads, head_size)``).
    """
    # Here, not at the top: the e2e suite imports the fault names above from
    # a client venv without torch.
    import torch

    ids = torch.tensor(sorted(set(kernel_block_ids)), dtype=torch.long)
    if ids.numel() == 0:
        return 0
    for name, cache in kv_caches.items():
        dim = _block_dim(cache, num_blocks)
        if dim is None:
            raise ValueError(
                f"{name}: no dimension of {num_blocks} blocks in {cache.shape}"
            )
        # Deterministic but far from any real activation.
        cache.index_fill_(dim, ids.to(cache.device), 3.0)
    return int(ids.numel())


def draft_caches(
    kv_caches: Mapping[str, torch.Tensor], target_layers: int
) -> dict[str, torch.Tensor]:
    """The draft's layers among ``kv_caches``: vLLM numbers an Eagle3 draft's
    and an MTP layer's attention from the target's num_hidden_layers on
    (``model.layers.<n>.``)."""
    found = {n: re.search(r"(?:^|\.)layers\.(\d+)\.", n) for n in kv_caches}
    return {
        name: cache
        for name, cache in kv_caches.items()
        if (m := found[name]) is not None and int(m.group(1)) >= target_layers
    }


def _block_dim(cache: torch.Tensor, num_blocks: int | None) -> int | None:
    if num_blocks is None or cache.shape[0] == num_blocks:
        return 0
    return next((d for d, n in enumerate(cache.shape) if n == num_blocks), None)
