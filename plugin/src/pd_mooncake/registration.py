"""Registration of KV cache tensors for mixed MLA + Eagle models.

Backport of vLLM PR 39596 ("[Mooncake] Fix mixed MLA+Eagle block-size
validation", in vLLM >= 0.20). Before it, the Mooncake worker derived the
kernel block size from each tensor's shape (``shape[-2 if use_mla else -3]``)
and asserted it equal to the configured block size. ``use_mla`` is global to
the model, but an Eagle draft's GQA cache does not follow the MLA layout: its
``shape[-2]`` is the number of KV heads, so the assert fails (or, without it,
blocks are addressed with the wrong stride). The fix, reproduced here:

* register every KV tensor by (data_ptr, nbytes) and take each layer's block
  length as ``nbytes // num_blocks``, whatever its shape;
* take the kernel block size from the active attention backends (the common
  size of main and draft backends, as ``select_common_block_size`` picks);
* address blocks at kernel granularity: one logical block is
  ``logical // kernel`` physical blocks (a wrong ratio makes decode read
  empty blocks: all-zero KV, garbage text).

Every vLLM the plugin runs on has the fix (it imports names only such
releases have), so the backport runs only with ``force_registration_backport``
(a test compares it with upstream's registration).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

# Re-exported: the plugin's modules and tests name them registration.*.
from pd_mooncake.metric_names import GQA_LAYOUT as GQA_LAYOUT
from pd_mooncake.metric_names import MLA_LAYOUT as MLA_LAYOUT

if TYPE_CHECKING:
    import torch


class KVLayoutError(ValueError):
    """A KV cache tensor that cannot be registered by byte length."""


@dataclass(frozen=True)
class Region:
    layer_name: str
    layout: str
    base_addr: int
    # Bytes between consecutive kernel blocks, and bytes moved per block.
    block_len: int
    kv_block_len: int


@dataclass(frozen=True)
class RegistrationPlan:
    ptrs: list[int]
    lens: list[int]
    regions: list[Region]


def upstream_has_fix(worker_cls: type) -> bool:
    """True where upstream carries PR 39596 (detected by feature, not version)."""
    return callable(getattr(worker_cls, "_sync_block_size_with_kernel", None))


def kernel_block_size(
    block_size: int, backends: Sequence[type], specs: Sequence[object] | None
) -> tuple[int, int]:
    """(kernel block size, physical blocks per logical block) for these backends."""
    from vllm.v1.worker.utils import select_common_block_size

    kernel = select_common_block_size(block_size, list(backends), specs)
    if block_size % kernel:
        raise KVLayoutError(
            f"kernel block size {kernel} does not divide block size {block_size}"
        )
    return kernel, block_size // kernel


def plan_registration(
    kv_caches: Mapping[str, torch.Tensor],
    mla_layers: set[str],
    num_kernel_blocks: int,
) -> RegistrationPlan:
    """Byte-length registration of every KV tensor; shapes are never read."""
    ptrs: list[int] = []
    lens: list[int] = []
    regions: list[Region] = []
    for name, cache in kv_caches.items():
        if not cache.is_contiguous():
            raise KVLayoutError(
                f"KV cache tensor of layer {name!r} is not contiguous "
                f"(shape {tuple(cache.shape)}, stride {cache.stride()}): it "
                "cannot be registered and addressed by byte length"
            )
        if cache.nbytes % num_kernel_blocks:
            raise KVLayoutError(
                f"KV cache tensor of layer {name!r} has {cache.nbytes} bytes, "
                f"not a whole number of {num_kernel_blocks} blocks"
            )
        block_len = cache.nbytes // num_kernel_blocks
        layout = MLA_LAYOUT if name in mla_layers else GQA_LAYOUT
        if cache.data_ptr() not in ptrs:
            ptrs.append(cache.data_ptr())
            lens.append(cache.nbytes)
        regions.append(Region(name, layout, cache.data_ptr(), block_len, block_len))
    if not ptrs:
        raise KVLayoutError("no KV cache tensors to register")
    return RegistrationPlan(ptrs, lens, regions)


def kernel_block_ids(logical_ids: Sequence[int], blocks_per_logical: int) -> list[int]:
    """Physical (kernel) block ids covering the given logical block ids."""
    return [
        logical * blocks_per_logical + offset
        for logical in logical_ids
        for offset in range(blocks_per_logical)
    ]
