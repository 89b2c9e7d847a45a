"""The KV digest of pd_mooncake.checksum (its docstring says what it is and
why), without vLLM: the connector's checksum, the benchmark and
scripts/gpu-datapath-check use the same arithmetic."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

# Bytes gathered per step: large enough for few kernels, small enough that
# the gathered copy and its int64 products stay in cache.
CHUNK_BYTES = 1 << 20
_MASK = (1 << 64) - 1


# -- the digest --------------------------------------------------------------
def _splitmix64(n: int, seed: int) -> np.ndarray:
    x = (np.arange(1, n + 1, dtype=np.uint64) + np.uint64(seed)) * np.uint64(
        0x9E3779B97F4A7C15
    )
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))) | np.uint64(1)


@functools.cache
def _weights(n: int, seed: int, device: torch.device) -> torch.Tensor:
    with np.errstate(over="ignore"):
        table = _splitmix64(n, seed).view(np.int64)
    return torch.from_numpy(table.copy()).to(device)


def word_weights(words: int, device: torch.device) -> torch.Tensor:
    return _weights(words, 0x5EED_0001, device)


def position_weights(n: int, device: torch.device) -> torch.Tensor:
    # Cached in powers of two: requests differ in length.
    size = 1 << max(n - 1, 0).bit_length()
    return _weights(size, 0x5EED_0002, device)[:n]


def digest(pages: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The 0-d int64 digest of ``pages[block_ids]`` (``pages``: one row of
    int32 words per block), on ``pages``' device."""
    n, words = int(block_ids.numel()), pages.shape[1]
    total = torch.zeros((), dtype=torch.int64, device=pages.device)
    if n == 0:
        return total
    w = word_weights(words, pages.device)
    p = position_weights(n, pages.device)
    step = max(1, CHUNK_BYTES // max(1, words * pages.element_size()))
    for start in range(0, n, step):  # chunks of blocks, not blocks
        rows = pages.index_select(0, block_ids[start : start + step])
        per_block = (rows * w).sum(dim=1)
        total += (per_block * p[start : start + step]).sum()
    return total


def reference_digest(rows: Sequence[Sequence[int]]) -> int:
    """The digest in plain Python (the tests' check of the torch one)."""
    if not rows:
        return 0
    words = len(rows[0])
    w = _splitmix64(words, 0x5EED_0001).tolist()
    p = _splitmix64(len(rows), 0x5EED_0002).tolist()
    total = sum(
        p[i] * sum(wj * x for wj, x in zip(w, row, strict=True))
        for i, row in enumerate(rows)
    )
    value = total & _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def region_pages(
    caches: dict[str, torch.Tensor],
    base: int,
    block_len: int,
    page_len: int,
    num_blocks: int,
) -> torch.Tensor:
    """The (num_blocks, page_len / 4) int32 view of a registered region:
    block b's page is [base + b * block_len, + page_len), as Mooncake
    addresses it, on the tensor that holds it."""
    end = base + (num_blocks - 1) * block_len + page_len
    for cache in caches.values():
        storage = cache.untyped_storage()
        start = storage.data_ptr()
        if start <= base and end <= start + storage.nbytes():
            break
    else:
        raise ValueError(f"no KV tensor holds the region at {base:#x}")
    if (base - start) % 4 or block_len % 4 or page_len % 4 or storage.nbytes() % 4:
        raise ValueError(f"region at {base:#x}: pages are not whole int32 words")
    raw = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(storage)
    return raw.view(torch.int32).as_strided(
        (num_blocks, page_len // 4), (block_len // 4, 1), (base - start) // 4
    )
