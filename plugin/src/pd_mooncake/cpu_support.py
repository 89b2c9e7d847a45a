"""What the Mooncake connector and a mixed MLA + GQA-Eagle model need on CPU hosts.

Two upstream obstacles, both absent on GPU hosts, where nothing here applies:

* ``MooncakeConnectorWorker.__init__`` calls
  ``torch.accelerator.current_device_index()``, which raises "Cannot access
  accelerator device when none is available" on a CPU-only host.
* CPU MLA fixes its kernel block size at 16 while the CPU GQA backend
  (CPU_ATTN) declares ``MultipleOf(32)``, so an MLA target with a GQA Eagle3
  draft stops with "No common block size for 16". CPU_ATTN already has a
  16-token kernel ("vec16", which ``_get_attn_isa`` picks for block sizes that
  are not a multiple of 32); it just does not declare it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger(f"vllm.{__name__}")

CPU_ATTN_BLOCK_BASE = 16


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def apply() -> None:
    if on_cpu():
        allow_cpu_attn_block_size_16()


def _accepts(declared: list, block_size: int) -> bool:
    from vllm.v1.attention.backend import MultipleOf

    return any(
        block_size % size.base == 0
        if isinstance(size, MultipleOf)
        else block_size == size
        for size in declared
    )


def _cpu_attn_block_sizes(kv_cache_spec: object = None) -> list:
    from vllm.v1.attention.backend import MultipleOf

    return [MultipleOf(CPU_ATTN_BLOCK_BASE)]


def allow_cpu_attn_block_size_16() -> bool:
    """Let CPU_ATTN run at block size 16 (its vec16 kernel). True if patched.

    Leaves upstream alone where it already accepts 16, or where the vec16
    kernel is not what it would pick for 16 (then the claim would be untested).
    """
    from vllm.v1.attention.backends import cpu_attn

    backend = cpu_attn.CPUAttentionBackend
    if _accepts(backend.get_supported_kernel_block_sizes(), CPU_ATTN_BLOCK_BASE):
        return False
    if cpu_attn._get_attn_isa(torch.float32, CPU_ATTN_BLOCK_BASE, 64) != "vec16":
        logger.warning("CPU_ATTN has no vec16 kernel here; block size 16 not enabled")
        return False
    backend.get_supported_kernel_block_sizes = staticmethod(_cpu_attn_block_sizes)
    logger.info("CPU_ATTN accepts block size %d (vec16 kernel)", CPU_ATTN_BLOCK_BASE)
    return True


@contextlib.contextmanager
def cpu_device_index() -> Iterator[None]:
    """Within the block, the accelerator device index reads 0 on CPU-only hosts.

    Scoped to the upstream worker's constructor, the only caller; on a host
    with an accelerator it changes nothing.
    """
    if torch.accelerator.current_accelerator() is not None:
        yield
        return
    original = torch.accelerator.current_device_index
    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.accelerator.current_device_index = original
